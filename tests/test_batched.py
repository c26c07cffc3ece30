"""Batched HybridSpec (batch > 1, left padding): each row's greedy output equals its own generate() in float64, and
the batch behaves as transformers' batched generate() (padding after EOS, stopping criteria, scores, cache)."""
import pytest
import torch
from _tiny import TARGETS, VOCAB, cache_tensors, make_drafter, make_target, output_cache
from test_exactness import assert_same_as_ar
from test_generate_semantics import Recorder
from test_properties import latency_model
from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation.strategy import RoundStrategy
from hybridspec_hf.selector import draft_signals, expected_tokens

PAD = 0
DRAFTING = ["dflash", "static", "ratio", "confidence", "nominal", "hybridspec"]
BLOCK = 8


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and attention mask, each prompt right-aligned after PAD tokens."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel():] = prompt
        mask[row, width - prompt.numel():] = 1
    return ids, mask


def random_prompts(lengths, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]  # no PAD inside a prompt


def own_generate(target, prompts, max_new_tokens, **kwargs):
    """Each prompt's own generate() (batch 1, no padding), with logits for the near-tie check."""
    return [target.generate(p[None], do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                            output_logits=True, **kwargs) for p in prompts]


def spec_batch(target, prompts, drafter, strategy, max_new_tokens, cuda_graphs="auto", verify_shape="auto",
               **kwargs):
    """The prompts left-padded into one batch through generate() (cuda_graphs="on": resident rounds, the CPU
    twin; tests/test_resident_batched.py)."""
    ids, mask = left_pad(prompts)
    config = HybridSpecConfig(latency_model=latency_model(BLOCK, 0.2), static_length=5, cuda_graphs=cuda_graphs,
                              verify_shape=verify_shape)
    kwargs.setdefault("do_sample", False)
    return target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, assistant_model=drafter,
                           generation_strategy=strategy, hybridspec_config=config, pad_token_id=PAD, **kwargs)


def assert_rows_equal_own(out: torch.Tensor, prompts, own, width: int | None = None) -> None:
    """Row b = its prompt's own output after the left padding (`width` columns of prompt), then only PAD."""
    width = width or max(p.numel() for p in prompts)
    for row, (prompt, ar) in enumerate(zip(prompts, own, strict=True)):
        new = ar.sequences.shape[1] - prompt.numel()
        mine = torch.cat([prompt, out[row, width: width + new]])[None]
        assert_same_as_ar(mine, ar)
        assert (out[row, width + new:] == PAD).all(), f"row {row} is not padded after its end"


@pytest.mark.parametrize("cuda_graphs", ["auto", "on"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_every_strategy_gives_each_row_its_own_generate(name, cuda_graphs, fp64_gdn):
    """Mixed prompt lengths (1 to 13 tokens: up to 12 pads), every drafting strategy and "ar", every family; the
    eager batched loop ("auto" on the CPU) and resident rounds ("on": 3 prompts in the bucket of 4, one inert row)."""
    target = make_target(name)
    prompts = random_prompts((1, 13, 6), seed=len(name))
    own = own_generate(target, prompts, 18)
    drafter = make_drafter(target, BLOCK, [o.sequences[0] for o in own], error_rate=0.25)
    for strategy in [*DRAFTING, "ar"]:
        out = spec_batch(target, prompts, drafter if strategy != "ar" else None, strategy, 18, cuda_graphs)
        assert_rows_equal_own(out, prompts, own)
        telemetry = hybridspec_hf.get_telemetry(target)
        assert telemetry.path == ("static_eager" if cuda_graphs == "on" else "eager"), telemetry.path_reason
        if cuda_graphs == "on":
            assert target.__dict__["_hybridspec_resident"].rows == 4
        rounds = telemetry.rounds
        assert all(1 <= r.w <= BLOCK and r.rows <= 3 for r in rounds)
        if strategy != "ar":
            assert max(r.accepted for r in rounds) > 0, strategy


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_5_moe_vlm", "qwen3_next", "qwen3_5_dense"])
def test_eos_at_different_positions_pads_like_batched_generate(name, fp64_gdn):
    """Rows stop at EOS tokens at different offsets (one never): they leave the batch, later rows are unaffected,
    and the output equals both each row's own generate() and transformers' batched generate()."""
    target = make_target(name, seed=1)
    prompts = random_prompts((4, 9, 2, 7), seed=3)
    free = [o.sequences[0, p.numel():] for o, p in zip(own_generate(target, prompts, 30), prompts)]
    eos = sorted({int(free[0][2]), int(free[1][9])} - {PAD})
    own = own_generate(target, prompts, 30, eos_token_id=eos, pad_token_id=PAD)
    drafter = make_drafter(target, BLOCK, [o.sequences[0] for o in own], error_rate=0.2)
    ids, mask = left_pad(prompts)
    stock = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=eos,
                            pad_token_id=PAD)
    for strategy in ("dflash", "hybridspec"):
        out = spec_batch(target, prompts, drafter, strategy, 30, eos_token_id=eos)
        assert_rows_equal_own(out, prompts, own)
        assert torch.equal(out, stock)
        rows = [r.rows for r in hybridspec_hf.get_telemetry(target).rounds]
        assert rows == sorted(rows, reverse=True) and rows[-1] < len(prompts)  # finished rows left the batch


def test_max_new_tokens_across_calls(fp64_gdn):
    """Separate calls with different max_new_tokens (transformers has no per-row limit): every row stops there."""
    target = make_target("qwen3_5_moe_odd", seed=2)
    prompts = random_prompts((3, 8, 5), seed=4)
    full = own_generate(target, prompts, 24)
    drafter = make_drafter(target, BLOCK, [o.sequences[0] for o in full], error_rate=0.1)
    for max_new in (1, 2, 7, 8, 9, 17):
        own = own_generate(target, prompts, max_new)
        for strategy in ("static", "nominal"):
            out = spec_batch(target, prompts, drafter, strategy, max_new)
            assert out.shape[1] == max(p.numel() for p in prompts) + max_new
            assert_rows_equal_own(out, prompts, own)


class StopAtTokens(StoppingCriteria):
    """A user criterion: a row is done once its last token is one of `tokens` (asked with the batch or one row)."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens.to(input_ids.device))


@pytest.mark.parametrize("with_eos", [False, True])
def test_stopping_criteria_per_row_like_batched_generate(with_eos, fp64_gdn):
    """A user criterion stops rows at different lengths. With an EOS criterion the stopped rows are padded; without
    one transformers keeps generating them until every row has stopped, and so do we."""
    target = make_target("qwen3_next", seed=4)
    prompts = random_prompts((5, 3, 10), seed=5)
    free = [o.sequences[0, p.numel():] for o, p in zip(own_generate(target, prompts, 30), prompts)]
    stop_tokens = [int(free[0][3]), int(free[1][8]), int(free[2][13])]  # every row stops, at different lengths
    eos = dict(eos_token_id=[VOCAB - 1]) if with_eos else dict(eos_token_id=None)
    ids, mask = left_pad(prompts)
    criteria = StoppingCriteriaList([StopAtTokens(stop_tokens)])
    stock = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30, pad_token_id=PAD,
                            stopping_criteria=criteria, **eos)
    drafter = make_drafter(target, BLOCK, [torch.cat([p, f]) for p, f in zip(prompts, free)], error_rate=0.2)
    out = spec_batch(target, prompts, drafter, "dflash", 30, stopping_criteria=criteria, **eos)
    assert torch.equal(out, stock)
    assert out.shape[1] < ids.shape[1] + 30  # the criterion ended the call before max_new_tokens


def test_scores_logits_and_cache_like_batched_generate(fp64_gdn):
    """return_dict_in_generate: one [B, V] score and logit row per step, and a cache whose column j holds the keys
    of sequences[:, j] and whose GDN states are after the same tokens: equal to transformers' batched generate()."""
    target = make_target("qwen3_5_moe", seed=5)
    prompts = random_prompts((6, 2, 11), seed=6)
    ids, mask = left_pad(prompts)
    common = dict(attention_mask=mask, do_sample=False, max_new_tokens=15, return_dict_in_generate=True,
                  output_scores=True, output_logits=True, repetition_penalty=1.3, pad_token_id=PAD)
    stock = target.generate(ids, **common)
    free = [torch.cat([p, s[ids.shape[1]:]]) for p, s in zip(prompts, stock.sequences)]
    drafter = make_drafter(target, BLOCK, free, error_rate=0.2)
    ours = target.generate(ids, assistant_model=drafter, generation_strategy="dflash", **common)
    assert torch.equal(ours.sequences, stock.sequences)
    assert len(ours.scores) == len(stock.scores) == len(ours.logits) == len(stock.logits)
    for mine, theirs in zip(ours.scores + ours.logits, stock.scores + stock.logits, strict=True):
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-9)
    for mine, theirs in zip(cache_tensors(output_cache(ours)), cache_tensors(output_cache(stock)), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)


def test_prefix_constraint_sees_each_rows_own_batch_id(fp64_gdn):
    """Batch-shaped processors (prefix_allowed_tokens_fn's batch_id) see each row's batch id, also after earlier
    rows left the batch: equal to transformers' batched generate()."""
    target = make_target("qwen3_5_moe", seed=6)
    prompts = random_prompts((3, 7, 5), seed=10)
    ids, mask = left_pad(prompts)
    allowed = {0: list(range(1, 33)), 1: list(range(33, 65)), 2: list(range(65, VOCAB))}
    common = dict(attention_mask=mask, do_sample=False, max_new_tokens=14, pad_token_id=PAD,
                  prefix_allowed_tokens_fn=lambda batch_id, sentence: allowed[batch_id])
    free = target.generate(ids, **common)
    common["eos_token_id"] = int(free[0, ids.shape[1] + 2])  # row 0 leaves first
    stock = target.generate(ids, **common)
    drafter = make_drafter(target, BLOCK, [torch.cat([p, s[ids.shape[1]:]]) for p, s in zip(prompts, stock)], 0.2)
    ours = target.generate(ids, assistant_model=drafter, generation_strategy="dflash", **common)
    assert torch.equal(ours, stock)
    assert hybridspec_hf.get_telemetry(target).rounds[-1].rows < 3


@pytest.mark.parametrize("options", [dict(encoder_repetition_penalty=1.6), dict(encoder_no_repeat_ngram_size=1)])
def test_encoder_penalties_see_each_rows_own_prompt(options, fp64_gdn):
    """The encoder penalties hold one row per prompt (built by generate() for the whole batch): each row sees its
    own, also after earlier rows left the batch, as in transformers' batched generate()."""
    target = make_target("qwen3_5_moe", seed=6)
    prompts = []
    for prompt in random_prompts((3, 7, 5), seed=10):  # each prompt + its first 4 greedy tokens, which then repeat
        greedy = target.generate(prompt[None], do_sample=False, max_new_tokens=4)[0]
        prompts.append(greedy)
    ids, mask = left_pad(prompts)
    common = dict(attention_mask=mask, do_sample=False, max_new_tokens=14, pad_token_id=PAD, **options)
    free = target.generate(ids, **common)
    assert not torch.equal(free, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14,
                                                 pad_token_id=PAD)), "the penalty must matter"
    common["eos_token_id"] = int(free[0, ids.shape[1] + 2])  # row 0 leaves first
    stock = target.generate(ids, **common)
    drafter = make_drafter(target, BLOCK, [torch.cat([p, s[ids.shape[1]:]]) for p, s in zip(prompts, stock)], 0.2)
    ours = target.generate(ids, assistant_model=drafter, generation_strategy="dflash", **common)
    assert torch.equal(ours, stock)


def test_encoder_penalty_with_several_samples_per_prompt():
    """num_return_sequences=3: rows 3p..3p+2 are prompt p's samples and see prompt p's n-grams only."""
    target = make_target("qwen3_5_moe", seed=6, dtype=torch.float32)
    prompts = random_prompts((6, 6), seed=12)
    ids = torch.stack(prompts)
    drafter = make_drafter(target, BLOCK).float()
    out = target.generate(ids, assistant_model=drafter, generation_strategy="dflash", do_sample=True, max_new_tokens=12,
                          num_return_sequences=3, encoder_no_repeat_ngram_size=1, pad_token_id=PAD)
    assert out.shape == (6, 18)
    for row in range(6):
        banned = set(prompts[row // 3].tolist())
        assert not banned & set(out[row, 6:].tolist()), f"row {row} repeats a token of its own prompt"


def test_one_left_padded_prompt_runs_the_batched_loop_and_streams(fp64_gdn):
    target = make_target("qwen3_5_dense")
    prompt = random_prompts((5,), seed=7)[0]
    own = own_generate(target, [prompt], 20)
    drafter = make_drafter(target, BLOCK, own[0].sequences, error_rate=0.2)
    ids = torch.cat([torch.full((1, 3), PAD), prompt[None]], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], dim=1)
    stock_stream, stream = Recorder(), Recorder()
    stock = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, streamer=stock_stream)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                          generation_strategy="dflash", pad_token_id=PAD, streamer=stream)
    assert_rows_equal_own(out, [prompt], own, width=ids.shape[1])
    assert torch.equal(out, stock) and hybridspec_hf.get_telemetry(target).path == "eager"
    assert torch.equal(stream.puts[0], ids) and stream.tokens() == stock_stream.tokens() and stream.ended


def test_sampling_batch_runs_and_a_seed_fixes_it():
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    prompts = random_prompts((4, 9), seed=8)
    drafter = make_drafter(target, BLOCK).float()
    outs = []
    for _ in range(2):
        torch.manual_seed(11)
        outs.append(spec_batch(target, prompts, drafter, "dflash", 12, do_sample=True, temperature=0.8, top_k=20))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape == (2, 9 + 12) and ((outs[0] >= 0) & (outs[0] < VOCAB)).all()


def nominal_strategy() -> RoundStrategy:
    """"nominal" over a float32 tiny target with a synthetic C(w) (slope 0.3): the shared-length tests."""
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    drafter = make_drafter(target, BLOCK).float()
    settings = HybridSpecConfig(latency_model=latency_model(BLOCK, 0.3))
    return RoundStrategy.build("nominal", settings, target, drafter, has_router=True)


def test_shared_length_maximises_the_pooled_objective():
    """choose_shared: w = argmax_w Σ_b G_b(w) − ρ·N·C(w), i.e. the rows' summed expected tokens at one price."""
    strategy = nominal_strategy()
    generator = torch.Generator().manual_seed(0)
    for case in range(20):
        sharpness = 1 + 4 * torch.rand(3, 1, 1, generator=generator)
        logits = torch.randn(3, BLOCK - 1, VOCAB, generator=generator) * sharpness
        w, _ = strategy.choose_shared(logits, 64, BLOCK)
        gain = expected_tokens(strategy.estimator.survival(draft_signals(logits))).sum(0)  # Σ_b G_b(w)
        rho = strategy.selector.throughput.rho  # per row
        objective = gain - 3 * rho * latency_model(BLOCK, 0.3).cost_for(64)[0]
        assert w == int(objective.argmax()) + 1, case


def test_batched_errors_name_the_problem():
    target = make_target("qwen3_5_moe", dtype=torch.float32)
    drafter = make_drafter(target, BLOCK).float()
    prompts = random_prompts((3, 5), seed=9)
    ids, mask = left_pad(prompts)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, assistant_model=drafter, generation_strategy="dflash",
                  pad_token_id=PAD)

    with pytest.raises(ValueError, match="batch size 2.*streamer"):
        target.generate(ids, streamer=Recorder(), **kwargs)
    with pytest.raises(ValueError, match="StaticCache"):
        target.generate(ids, past_key_values=StaticCache(config=target.config, max_cache_len=32), **kwargs)
    with pytest.raises(ValueError, match="cuda_graphs='on'.*output_scores"):  # resident rounds keep no scores
        target.generate(ids, hybridspec_config=HybridSpecConfig(cuda_graphs="on"), return_dict_in_generate=True,
                        output_scores=True, **kwargs)
