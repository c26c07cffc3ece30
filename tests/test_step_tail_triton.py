"""The plain step's bookkeeping in one launch (kernels/step_tail_triton.py) against its torch reference, and whole
resident calls with it against the torch ops of ResidentRounds._commit_step (Triton interpreter on the CPU).

Integer updates only: the kernel must equal the reference exactly, for one row and a batch, mRoPE positions, rows
that end by EOS or their limit, finished rows (m = 0), and without device_commit (the host decides: live stays).
Through generate() every hand-off (tokens, a, m, live, w, kept, n_new, draft_next) is the same with and without it,
greedy and sampled, AR and HybridSpec's stretches of plain steps, one row and batches."""
import pytest
import torch
from _tiny import VOCAB, make_drafter, make_target
from test_batched import PAD, left_pad, random_prompts
from test_properties import latency_model
from test_resident_deferred_append import PATTERN, Pattern

pytest.importorskip("triton")

import hybridspec_hf  # noqa: E402
from hybridspec_hf import HybridSpecConfig  # noqa: E402
from hybridspec_hf.generation.resident import ResidentRounds  # noqa: E402
from hybridspec_hf.kernels import step_tail_triton  # noqa: E402
from hybridspec_hf.kernels.step_tail_triton import step_tail, step_tail_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # conftest.py
READ_HANDOFF = ResidentRounds._read_handoff


def _state(rows: int, width: int, position_rows: int, layers: int, seed: int) -> dict:
    """A random step's buffers: some rows finished (live 0), some one short of their limit, EOS among the tokens."""
    gen = torch.Generator().manual_seed(seed)
    length = torch.randint(0, 50, (rows,), generator=gen)
    eos = torch.full((8,), -1)
    eos[:3] = torch.tensor([5, 9, 0])
    return dict(
        token=torch.randint(0, 12, (rows,), generator=gen),  # ids 0, 5 and 9 are EOS
        live=(torch.rand(rows, generator=gen) > 0.25).long(),
        count=torch.full((rows,), 7),
        length=length,
        position=length.view(1, -1, 1) + torch.randint(0, 900, (position_rows, rows, 1), generator=gen),
        attention_lengths=torch.randint(0, 50, (layers,), generator=gen) if rows == 1 else None,
        last_token=torch.randint(0, VOCAB, (rows, 1), generator=gen),
        eos_ids=eos,
        limit=length + torch.randint(1, 4, (rows,), generator=gen),
        draft_next=torch.randint(0, 40, (1,), generator=gen),
        out=torch.full((rows * (width + 3) + 4,), -7),
    )


@pytest.mark.parametrize("device_commit", [True, False])
@pytest.mark.parametrize("rows, width, position_rows, layers", [(1, 1, 1, 3), (1, 8, 3, 10), (1, 16, 4, 0),
                                                                (3, 8, 1, 0), (16, 4, 3, 0)])
def test_the_kernel_equals_the_reference(rows, width, position_rows, layers, device_commit):
    for seed in range(4):
        state = _state(rows, width, position_rows, layers, seed)
        mine = {k: None if v is None else v.clone() for k, v in state.items()}
        step_tail_reference(**state, device_commit=device_commit)
        step_tail(**mine, device_commit=device_commit)
        for name, want in state.items():
            assert (mine[name] is None and want is None) or torch.equal(mine[name], want), name


def test_wrong_inputs_are_named():
    state = _state(2, 4, 1, 0, 0)
    with pytest.raises(ValueError, match="contiguous int64"):
        step_tail(**{**state, "token": state["token"].int()}, device_commit=True)


def _handoffs(monkeypatch, fused: bool, run):
    """Every hand-off of `run()` (its generate() call) with the kernel or the torch ops, and the output."""
    monkeypatch.setattr(step_tail_triton, "_ON_CPU", fused)
    seen, launches = [], [0]

    def counted(*args, **kwargs):
        launches[0] += 1
        return step_tail(*args, **kwargs)

    monkeypatch.setattr(ResidentRounds, "_read_handoff", lambda self: seen.append(READ_HANDOFF(self)) or seen[-1])
    monkeypatch.setattr("hybridspec_hf.generation.resident.step_tail", counted)
    out = run()
    assert (launches[0] > 0) == fused
    return out, seen


@pytest.mark.parametrize("strategy, do_sample", [("ar", False), ("ar", True), ("hybridspec", False)])
def test_calls_hand_off_the_same_with_the_kernel(strategy, do_sample, monkeypatch):
    """HybridSpec by a pattern of rounds: stretches of plain steps, their deciding steps (draft_next = the count
    of plain steps to come) and deferred appends."""
    target = make_target("qwen3_5_moe", seed=5, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 9))
    drafter = make_drafter(target, 8, error_rate=0.5).float()
    settings = HybridSpecConfig(selector=Pattern(PATTERN, 6), cuda_graphs="on", kernel_backend="torch")
    new = target.generate(prompt, do_sample=False, max_new_tokens=40)[0, 9:].tolist()
    eos = max(set(new), key=new.index)  # greedy calls end at its first occurrence, late in the call

    def run():
        hybridspec_hf.release_graphs(target)
        torch.manual_seed(1)
        return target.generate(prompt, do_sample=do_sample, max_new_tokens=40, generation_strategy=strategy,
                               assistant_model=None if strategy == "ar" else drafter, hybridspec_config=settings,
                               eos_token_id=[VOCAB - 1, eos])

    want, torch_handoffs = _handoffs(monkeypatch, False, run)
    got, kernel_handoffs = _handoffs(monkeypatch, True, run)
    assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert torch.equal(got, want) and kernel_handoffs == torch_handoffs
    if strategy == "hybridspec":  # deciding steps handed off a count of plain steps
        assert any(handoff[-1] > 0 and handoff[-4] == 1 for handoff in kernel_handoffs)


def test_batched_calls_hand_off_the_same_with_the_kernel(monkeypatch):
    """Rows that end at different times (EOS, max_new_tokens) and the inert rows of the bucket."""
    target = make_target("qwen3_next", seed=6, dtype=torch.float32)
    ids, mask = left_pad(random_prompts((4, 9, 6), seed=6))
    settings = HybridSpecConfig(cuda_graphs="on", kernel_backend="torch")

    def run():
        hybridspec_hf.release_graphs(target)
        return target.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, pad_token_id=PAD,
                               generation_strategy="ar", hybridspec_config=settings, eos_token_id=[3, 7, 11])

    want, torch_handoffs = _handoffs(monkeypatch, False, run)
    got, kernel_handoffs = _handoffs(monkeypatch, True, run)
    assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert torch.equal(got, want) and kernel_handoffs == torch_handoffs
    assert any(0 in handoff[-4 - 3 * 4: -4 - 4] for handoff in kernel_handoffs)  # a row ended before the last
