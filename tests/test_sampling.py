"""Sampling (do_sample=True) keeps the target's distribution: the acceptance rule exactly, end to end statistically."""
import torch
from _tiny import VOCAB, make_drafter, make_target

from hybridspec_hf.generation.acceptance import speculative_sample


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())


def test_each_emitted_token_has_the_target_distribution():
    """200k draws of the rule against the target's p, for the first emitted position and after one acceptance."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 200_000, 6
    probs = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)  # p at 3 verified positions
    drafts = torch.tensor([[2, 4]]).expand(n, 2)  # a fixed (deterministic) draft per position
    a, token = speculative_sample(drafts, probs.expand(n, 3, vocab), generator=gen)
    first = torch.where(a > 0, drafts[:, 0], token)  # the first emitted token
    assert total_variation(torch.bincount(first, minlength=vocab).float(), probs[0]) < 0.006
    given = first == 2  # second emitted token, given the first draft was accepted
    second = torch.where(a[given] > 1, drafts[given, 1], token[given])
    assert total_variation(torch.bincount(second, minlength=vocab).float(), probs[1]) < 0.01
    # with a valid length of 2 only d_1 can be accepted; the token after it is sampled from p_2 unmodified
    a2, token2 = speculative_sample(drafts, probs.expand(n, 3, vocab), torch.full((n,), 2), generator=gen)
    assert int(a2.max()) == 1
    assert total_variation(torch.bincount(token2[a2 == 1], minlength=vocab).float(), probs[1]) < 0.01


def test_sampled_generation_matches_ar_distribution_end_to_end():
    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=12)
    drafter = make_drafter(target, 8, greedy, error_rate=0.0).float()  # always proposes the greedy path
    options = dict(do_sample=True, temperature=1.0, top_k=4, max_new_tokens=3)
    torch.manual_seed(0)
    ar = torch.stack([target.generate(prompt, **options)[0, -2:] for _ in range(300)])
    ours = torch.stack([target.generate(prompt, assistant_model=drafter, generation_strategy="dflash", **options)[0, -2:]
                        for _ in range(300)])
    for position in range(2):
        counts = [torch.bincount(x[:, position], minlength=VOCAB).float() for x in (ar, ours)]
        assert total_variation(*counts) < 0.2, f"token {position + 2}: distributions differ"
    always_greedy = float((ours == greedy[0, 7:9]).all(1).float().mean())  # new tokens 2 and 3 of the greedy path
    assert always_greedy < 0.9, "drafts must not be accepted blindly"


def test_sampling_is_reproducible_with_a_seed():
    """With a length rule that does not read the clock ("dflash", "static", "confidence") a seed fixes the output.
    (The calibrated strategies pick w from measured throughput, so the random stream, not the distribution,
    can differ between runs.)"""
    target = make_target("qwen3_next", seed=3, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 5))
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=20)
    drafter = make_drafter(target, 8, greedy).float()
    outs = []
    for _ in range(2):
        drafter.steer(greedy, 0.25, seed=0)  # the oracle drafter's own random errors restart too
        torch.manual_seed(123)
        outs.append(target.generate(prompt, do_sample=True, max_new_tokens=20, assistant_model=drafter,
                                    generation_strategy="confidence"))
    assert torch.equal(*outs) and outs[0].shape[1] == 25


def test_num_return_sequences_gives_independent_samples_of_the_target():
    """generate(num_return_sequences=n, do_sample=True) expands each prompt to n rows (transformers' order: prompt 0's
    rows first), which the batched loop samples independently: the same distribution as stock sampling of n rows."""
    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=12)
    drafter = make_drafter(target, 8, greedy, error_rate=0.0).float()
    options = dict(do_sample=True, temperature=1.0, top_k=4, max_new_tokens=3, num_return_sequences=400)
    torch.manual_seed(0)
    ar = target.generate(prompt, **options)[:, -2:]
    ours = target.generate(prompt, assistant_model=drafter, generation_strategy="dflash", **options)
    assert ours.shape == (400, 9) and (ours[:, :6] == prompt).all()
    for position in range(2):
        counts = [torch.bincount(x[:, position], minlength=VOCAB).float() for x in (ar, ours[:, -2:])]
        assert total_variation(*counts) < 0.2, f"token {position + 2}: distributions differ"

    two = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(target.generate(two, assistant_model=drafter, generation_strategy="static", do_sample=True,
                                    max_new_tokens=6, num_return_sequences=3))
    assert torch.equal(*outs) and outs[0].shape == (6, 11)
    assert (outs[0][:3, :5] == two[0]).all() and (outs[0][3:, :5] == two[1]).all()


def test_resident_rounds_sample_the_target_distribution_through_short_verifies(monkeypatch):
    """Max-shape resident rounds with verify branches at several short lengths (resident.SHORT_VERIFY; the random
    numbers drawn before the branch, each branch reading its prefix of them) keep the target's distribution."""
    from hybridspec_hf import HybridSpecConfig
    from hybridspec_hf.generation import resident

    monkeypatch.setattr(resident, "SHORT_VERIFY", True)
    monkeypatch.setattr(resident, "SHORT_LENGTHS", (2, 4, 6, 7))
    verified = []
    verify = resident.ResidentRounds._verify
    monkeypatch.setattr(resident.ResidentRounds, "_verify",
                        lambda self, n, *args, **kwargs: verified.append(n) or verify(self, n, *args, **kwargs))
    target = make_target("qwen3_5_moe", seed=9, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    greedy = target.generate(prompt, do_sample=False, max_new_tokens=12)
    drafter = make_drafter(target, 8, greedy, error_rate=0.0).float()
    options = dict(do_sample=True, temperature=1.0, top_k=4, max_new_tokens=3)
    torch.manual_seed(0)
    ar = torch.stack([target.generate(prompt, **options)[0, -2:] for _ in range(600)])
    settings = HybridSpecConfig(cuda_graphs="on", verify_shape="max")
    ours = torch.stack([target.generate(prompt, assistant_model=drafter, generation_strategy="confidence",
                                        hybridspec_config=settings, **options)[0, -2:] for _ in range(600)])
    assert target.__dict__["_hybridspec_resident"].short_lengths == (2, 4, 6, 7)
    assert set(verified) & {2, 4, 6, 7}, verified
    for position in range(2):  # two 600-sample draws of AR itself differ by ≈ 0.1 at token 3
        counts = [torch.bincount(x[:, position], minlength=VOCAB).float() for x in (ar, ours)]
        assert total_variation(*counts) < 0.2, f"token {position + 2}: distributions differ"
