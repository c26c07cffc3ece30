"""What transformers users rely on keeps working with generation_strategy=...: streamer, processors, stop strings,
scores/logits, stopping criteria, and exception safety."""
import string

import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.selector import LatencyModel


class Recorder(BaseStreamer):
    def __init__(self, fail_at: int | None = None):
        self.puts, self.ended, self.fail_at = [], False, fail_at

    def put(self, value):
        if self.fail_at is not None and len(self.puts) == self.fail_at:
            raise RuntimeError("streamer failed")
        self.puts.append(value.clone())

    def end(self):
        self.ended = True

    def tokens(self):
        return torch.cat([p.reshape(-1) for p in self.puts]).tolist()


def setup(name="qwen3_5_moe", prompt_len=7, seed=0, block_size=8, **ar_kwargs):
    target = make_target(name, seed=seed)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    ar = target.generate(prompt, do_sample=False, max_new_tokens=40, **ar_kwargs)
    drafter = make_drafter(target, block_size, ar, error_rate=0.2, seed=seed)
    return target, prompt, drafter


def spec(target, prompt, drafter, **kwargs):
    kwargs.setdefault("max_new_tokens", 40)
    return target.generate(prompt, do_sample=False, assistant_model=drafter, generation_strategy="dflash", **kwargs)


def test_streamer_receives_prompt_then_every_token_like_ar(fp64_gdn):
    target, prompt, drafter = setup()
    ar_stream, ours_stream = Recorder(), Recorder()
    ar = target.generate(prompt, do_sample=False, max_new_tokens=25, streamer=ar_stream)
    ours = spec(target, prompt, drafter, max_new_tokens=25, streamer=ours_stream)
    assert torch.equal(ours, ar)
    assert torch.equal(ours_stream.puts[0], prompt)
    assert ours_stream.tokens() == ar_stream.tokens() and ours_stream.ended


@pytest.mark.parametrize(
    "options",
    [
        dict(repetition_penalty=1.4),
        dict(no_repeat_ngram_size=2),
        dict(suppress_tokens=[3, 5, 7, 11]),
        dict(bad_words_ids=[[4], [9, 10]]),
        dict(min_new_tokens=12, eos_token_id=None),  # eos filled in below
        dict(sequence_bias={(2,): 3.0, (5, 6): -2.0}),
        dict(encoder_repetition_penalty=1.6),  # applied to the prompt's tokens
        dict(encoder_no_repeat_ngram_size=1),  # none of the prompt's tokens
        # green lists seeded by the prefix ("selfhash" too, but stock generate() fails on it under torch 2.14)
        dict(watermarking_config={"bias": 4.0, "context_width": 1}),
    ],
)
def test_logits_processors_scores_and_logits_equal_ar(options, fp64_gdn):
    target, prompt, drafter = setup(seed=2)
    options = dict(options)
    if "min_new_tokens" in options:
        free = target.generate(prompt, do_sample=False, max_new_tokens=20)[0, prompt.shape[1] :]
        options["eos_token_id"] = int(free[4])  # would stop at token 5 without min_new_tokens
        options["pad_token_id"] = 0
    common = dict(max_new_tokens=30, return_dict_in_generate=True, output_scores=True, output_logits=True, **options)
    ar = target.generate(prompt, do_sample=False, **common)
    drafter.steer(ar.sequences, 0.2, 0)
    ours = spec(target, prompt, drafter, **common)
    assert torch.equal(ours.sequences, ar.sequences)
    assert len(ours.scores) == len(ar.scores) == len(ours.logits)
    for mine, theirs in zip(ours.scores + ours.logits, ar.scores + ar.logits, strict=True):
        assert mine.dtype == theirs.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    assert max(r.accepted for r in hybridspec_hf.get_telemetry(target).rounds) > 0


def test_returned_scores_and_logits_own_their_memory(fp64_gdn):
    """Each step's [1, V] scores/logits is a copy, not a view keeping the round's whole [T, V] tensor alive."""
    target, prompt, drafter = setup(seed=3)
    out = spec(target, prompt, drafter, max_new_tokens=30, return_dict_in_generate=True, output_scores=True,
               output_logits=True, repetition_penalty=1.2)
    for step in out.scores + out.logits:
        assert step.untyped_storage().nbytes() == step.numel() * step.element_size()


def char_tokenizer():
    """One token per character (96 of them), so stop strings can end inside a verified block."""
    chars = string.digits + string.ascii_letters + string.punctuation + " \n"
    assert len(chars) == VOCAB
    tokenizer = Tokenizer(WordLevel({c: i for i, c in enumerate(chars)}, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_stop_strings_stop_where_ar_stops(fp64_gdn):
    target, prompt, drafter = setup(seed=4)
    tokenizer = char_tokenizer()
    free = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, prompt.shape[1] :]
    pieces = tokenizer.convert_ids_to_tokens(free.tolist())
    stop = pieces[9] + pieces[10]
    ar = target.generate(prompt, do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    ours = spec(target, prompt, drafter, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(ours, ar)
    assert ours.shape[1] < prompt.shape[1] + 30


class StopAfter(StoppingCriteria):
    def __init__(self, length, fail=False):
        self.length, self.fail, self.calls = length, fail, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.fail and input_ids.shape[1] >= self.length:
            raise RuntimeError("criterion failed")
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_user_stopping_criteria_checked_after_each_token(fp64_gdn):
    target, prompt, drafter = setup(seed=5)
    for length in (prompt.shape[1] + 3, prompt.shape[1] + 10):
        criteria = StoppingCriteriaList([StopAfter(length)])
        ar = target.generate(prompt, do_sample=False, max_new_tokens=40, stopping_criteria=criteria)
        ours = spec(target, prompt, drafter, stopping_criteria=StoppingCriteriaList([StopAfter(length)]))
        assert torch.equal(ours, ar) and ours.shape[1] == length


@pytest.mark.parametrize("where", ["streamer", "criterion"])
def test_failure_mid_round_leaves_target_and_drafter_usable(where, fp64_gdn):
    target, prompt, drafter = setup(seed=6)
    ar = target.generate(prompt, do_sample=False, max_new_tokens=30)
    with pytest.raises(RuntimeError, match="failed"):
        if where == "streamer":
            spec(target, prompt, drafter, max_new_tokens=30, streamer=Recorder(fail_at=9))
        else:
            spec(target, prompt, drafter, max_new_tokens=30,
                 stopping_criteria=StoppingCriteriaList([StopAfter(prompt.shape[1] + 12, fail=True)]))
    assert torch.equal(spec(target, prompt, drafter, max_new_tokens=30), ar)
    assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=30), ar)


def test_telemetry_after_each_call(fp64_gdn):
    target, prompt, drafter = setup(seed=7)
    out = spec(target, prompt, drafter, max_new_tokens=33)
    telemetry = hybridspec_hf.get_telemetry(target)
    assert telemetry.new_tokens == out.shape[1] - prompt.shape[1] == 33
    assert all(1 <= r.w <= 8 and 0 <= r.accepted <= r.w - 1 and r.emitted <= r.accepted + 1 for r in telemetry.rounds)
    assert sum(r.committed for r in telemetry.rounds) == 32  # the last emitted token is not in the cache, as in AR
    assert telemetry.mean_emitted > 1.0


def test_telemetry_says_whether_the_routing_correction_ran(fp64_gdn):
    """"hybridspec" runs the correction on one unpadded prompt under a latency model that prices experts; the
    telemetry says when it did not and why (a batch; a model pricing no expert), and has nothing to say for
    strategies without one."""
    from test_properties import latency_model

    target, prompt, drafter = setup(seed=7)
    free = latency_model(8, 0.2)  # no expert model: nothing priced beyond C(w)
    priced = LatencyModel(cost=free.cost, cost_ar=free.cost_ar, context_lens=free.context_lens,
                          sunk=torch.full((1, 7), 2e-5))  # stage 0's sunk cost: the correction can keep a token
    runs = [("hybridspec", priced, prompt, True, None), ("hybridspec", free, prompt, False, "prices no distinct expert"),
            ("hybridspec", priced, prompt.repeat(2, 1), False, "batched loop"), ("nominal", priced, prompt, False, None),
            ("dflash", priced, prompt, False, None)]
    for strategy, model, ids, ran, why in runs:
        target.generate(ids, assistant_model=drafter, generation_strategy=strategy, do_sample=False, max_new_tokens=9,
                        hybridspec_config=HybridSpecConfig(latency_model=model))
        telemetry = hybridspec_hf.get_telemetry(target)
        assert telemetry.routing_correction is ran, strategy
        assert (telemetry.routing_correction_off is None) if why is None else why in telemetry.routing_correction_off
        assert telemetry.to_dict()["routing_correction"] is ran
