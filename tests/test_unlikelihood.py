"""The tiny target's unlikelihood stage (scripts/tiny_pair/train_target.py): which tokens count as repeats, and
that the loss pushes exactly those tokens' probabilities down."""
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "tiny_pair"))

import train_target as tt  # noqa: E402


def test_repeated_ngram_mask_marks_the_tokens_that_complete_a_seen_ngram():
    loop = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 9]])
    mask = tt.repeated_ngram_mask(loop, 4)
    # 4-grams ending at t = 3..9: (5678) (6785) (7856) (8567) (5678)* (6785)* (7859)
    assert mask.tolist() == [[False] * 7 + [True, True, False]]
    assert not tt.repeated_ngram_mask(torch.arange(12).view(1, 12), 4).any()
    # after the first eos nothing counts, not even a repeat of an earlier 4-gram
    valid = tt.after_eos(torch.tensor([[5, 6, 7, 8, 0, 6, 7, 8, 5, 6]]), eos_id=0)
    assert valid.tolist() == [[True] * 5 + [False] * 5]
    looped = torch.tensor([[5, 6, 7, 8, 0, 5, 6, 7, 8, 5]])
    assert not tt.repeated_ngram_mask(looped, 4, tt.after_eos(looped, 0)).any()


def test_unlikelihood_loss_lowers_the_repeated_tokens_probability_only():
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    config = tt.tiny_target_config(64, hidden_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                                   num_layers=4)
    model = Qwen3_5MoeForCausalLM(config)
    model.set_experts_implementation("eager")
    prompts = torch.randint(3, 64, (2, 6))
    continuations = torch.tensor([[9, 10, 11, 12, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]])
    loss, share = tt.unlikelihood_loss(model, prompts, continuations, 4, 0, nullcontext)
    assert 0 < share < 1 and loss.item() > 0
    ids = torch.cat([prompts, continuations], 1)

    def probs():
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1:-1]
        return torch.softmax(logits.float(), -1).gather(-1, continuations.unsqueeze(-1)).squeeze(-1)

    before = probs()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    after = probs()
    assert (after[0, 7] < before[0, 7]).item()  # the token completing the repeated 4-gram (9 10 11 12) again
    repeated = tt.repeated_ngram_mask(continuations, 4)
    assert repeated.sum() == 1 and repeated[0, 7]
