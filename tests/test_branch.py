"""graphs/capture.py `branch`: one of two functions by a device predicate, eagerly (the host reads it) and captured
into CUDA graph conditional nodes (a replay runs the body its predicate chose, nested too, with our PDL launches
inside). A body may not draw random numbers (torch refuses it when the capture ends): resident rounds draw before. The CUDA tests skip without a GPU; the resident rounds that use it are tested in test_resident*.py."""
import pytest
import torch
from test_pdl_cuda import _chain, chain_inputs  # dependent launches (PDL on Hopper): norm → gemv → gemv → add

from hybridspec_hf.graphs import capture
from hybridspec_hf.graphs.capture import Replay, branch, branches_capture

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not branches_capture(torch.device("cuda")),
                          reason="needs CUDA with conditional graph nodes (CUDA >= 12.4)")


def _pick(out: torch.Tensor, pred: torch.Tensor, x: torch.Tensor) -> None:
    """out <- 2x + 1 where pred holds, else x - 3 (each branch writes the same buffer)."""
    branch(pred, lambda: out.copy_(x * 2 + 1), lambda: out.copy_(x - 3))


def test_eager_branch_runs_only_the_chosen_function():
    x = torch.arange(4.0)
    out = torch.zeros(4)
    calls = []
    for holds in (True, False, True):
        branch(torch.tensor([holds]), lambda: calls.append("if"), lambda: calls.append("else"))
        _pick(out, torch.tensor([holds]), x)
        assert torch.equal(out, x * 2 + 1 if holds else x - 3)
    assert calls == ["if", "else", "if"]


def test_a_cpu_replay_reads_the_predicate_at_each_call():
    x, out, pred = torch.arange(3.0), torch.zeros(3), torch.tensor([False])
    replay = Replay(lambda: _pick(out, pred, x), torch.device("cpu"))
    for holds in (False, True, False):
        pred.fill_(holds)
        replay()
        assert torch.equal(out, x * 2 + 1 if holds else x - 3)
    assert not capture._warming


@cuda
def test_captured_branches_replay_the_chosen_body_nested_with_pdl_launches():
    pairs, norm_weight, x = chain_inputs(1024, 2048, 3, 2)
    out = torch.zeros_like(x)
    length = torch.zeros(1, dtype=torch.long, device="cuda")
    # three bodies: length <= 1 → one pair of the chain, <= 2 → two pairs, else all three (and a scale)
    bodies = {1: lambda: out.copy_(_chain(x, pairs[:1], norm_weight)),
              2: lambda: out.copy_(_chain(x, pairs[:2], norm_weight)),
              3: lambda: out.copy_(_chain(x, pairs, norm_weight) * 0.5)}

    def round_fn():
        y = x * 1.0  # work before the branch, in the parent graph
        branch(length <= 1, bodies[1], lambda: branch(length <= 2, bodies[2], bodies[3]))
        out.add_(y)

    replay = Replay(round_fn, torch.device("cuda"))
    assert replay.captured and not capture._warming
    expected = {n: bodies[n]() + x for n in bodies}  # eager, after the capture
    for n in (3, 1, 2, 2, 3, 1):
        length.fill_(n)
        out.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected[n]), n
    assert all(not torch.equal(expected[1], expected[n]) for n in (2, 3))


@cuda
def test_the_warm_up_runs_both_bodies_and_the_capture_captures_each_once():
    calls = []
    pred = torch.ones(1, dtype=torch.bool, device="cuda")
    Replay(lambda: branch(pred, lambda: calls.append("if"), lambda: calls.append("else")), torch.device("cuda"))
    assert calls == ["if", "else", "if", "else"]
