"""benchmarks/greedy_head.py runs through on the CPU (a small head, the Triton interpreter): every variant's tokens
are the head's first argmax, the one-pass candidates are a superset of the two-pass ones, and bad --rows are
refused."""
import os

import pytest
import torch


@pytest.fixture
def greedy_head(benchmarks, monkeypatch):
    # its import sets TRITON_INTERPRET on a machine without CUDA: set here, so that the test's end restores it
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    import greedy_head

    return greedy_head


def test_the_smoke_run_keeps_the_heads_argmax(greedy_head, cpu_only, triton_interpreter, tmp_path):
    payload = greedy_head.main(["--vocab", "3000", "--hidden", "128", "--rows", "1,3", "--seed", "4",
                                "--name", str(tmp_path / "gh")])
    rows = payload["results"]
    assert [(r["rows"], r["variant"]) for r in rows] == [
        (n, v) for n in (1, 3) for v in ("bf16 head + argmax", "int8 GEMV alone", "int8 greedy, two passes",
                                         "int8 greedy, two passes, every step", "int8 greedy, one pass")]
    for r in rows:
        if r["variant"] != "int8 GEMV alone":
            assert r["tokens_equal_truth"] == r["rows"], r
        assert r["weight_bytes"] == (3000 * 128 * 2 if r["variant"].startswith("bf16") else 3000 * 128 + 3000 * 4)
    for two, every, one in zip(rows[2::5], rows[3::5], rows[4::5]):
        assert 1 <= two["candidate_rows_mean"] == every["candidate_rows_mean"] <= one["candidate_rows_mean"] < 3000
    assert (tmp_path / "gh.md").read_text().count("| int8 greedy") == 6


def test_rows_past_the_kernels_limit_are_refused(greedy_head, tmp_path):
    with pytest.raises(SystemExit, match="--rows"):
        greedy_head.main(["--rows", "1,17", "--name", str(tmp_path / "gh")])


def test_captures_run_with_grad_off(greedy_head, cpu_only, triton_interpreter, monkeypatch, tmp_path):
    """Each variant is captured with grad off (on, linear_int8 takes its torch reference: run 163's 2.3 ms), and
    --block-v-wide reaches the kernel's module."""
    seen = []

    def capture(function):
        seen.append(torch.is_grad_enabled())
        function()
        return object()

    monkeypatch.setattr(greedy_head, "timed", lambda device: True)
    monkeypatch.setattr(greedy_head, "capture", capture)
    monkeypatch.setattr(greedy_head, "time_graph", lambda graph, calls, replays: {
        "median_us": 10.0, "p10_us": 9.0, "p90_us": 11.0, "replays": replays})
    monkeypatch.setattr(greedy_head.head_argmax_triton, "BLOCK_V_WIDE", greedy_head.head_argmax_triton.BLOCK_V_WIDE)
    greedy_head.main(["--vocab", "3000", "--hidden", "128", "--rows", "1,5", "--block-v-wide", "512",
                      "--name", str(tmp_path / "gh")])
    assert seen == [False] * 10  # 5 variants x 2 row counts
    assert greedy_head.head_argmax_triton.BLOCK_V_WIDE == 512
    with pytest.raises(SystemExit, match="--block-v-wide"):
        greedy_head.main(["--block-v-wide", "100", "--name", str(tmp_path / "gh")])
