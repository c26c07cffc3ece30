"""benchmarks/breakdown.py runs through on a tiny model on the CPU (no kernels to trace: timings only), issue 15's
figure included: the max-shape round against its target forward replayed alone."""
import json

import pytest


def test_breakdown_times_the_round_and_its_forward_alone(tmp_path, benchmarks, cpu_only):
    import breakdown

    stem = tmp_path / "breakdown_tiny"
    breakdown.main(["--model", "tiny", "--replays", "2", "--lengths", "1,16", "--name", str(stem)])
    report = json.loads(stem.with_suffix(".json").read_text())
    parts = report["parts"]
    forward_16, forward_1 = breakdown.forward_label(16), breakdown.forward_label(1)
    assert list(parts) == [breakdown.AR_STEP, breakdown.HS_STEP, breakdown.DRAFT, "verify w = 1 (+ accept, commit)",
                           "verify w = 16 (+ accept, commit)", breakdown.ROUND, forward_16, forward_1]
    assert all(row["kernels"] == 0 and row["wall_ms"] > 0 for row in parts.values())  # CPU: timings only
    # the forward alone neither drafts nor commits; a round commits at least its anchor, a plain step exactly it
    committed = {label: row["committed_per_replay"] for label, row in parts.items()}
    assert committed[forward_16] == committed[forward_1] == committed[breakdown.DRAFT] == 0
    assert committed[breakdown.ROUND] >= 1 and committed[breakdown.AR_STEP] == committed[breakdown.HS_STEP] == 1
    assert "drafter weights" in parts[breakdown.ROUND]["bytes"] and "drafter weights" not in parts[forward_16]["bytes"]
    outside = report["outside_the_forward"]
    assert outside["block"] == 16
    assert outside["outside_ms"] == pytest.approx(parts[breakdown.ROUND]["wall_ms"] - parts[forward_16]["wall_ms"])
    assert outside["draft_ms"] == parts[breakdown.DRAFT]["wall_ms"]
    assert outside["forward_1_ms"] == parts[forward_1]["wall_ms"]
    assert "outside the forward (round - forward)" in stem.with_suffix(".md").read_text()


def test_breakdown_sets_the_plain_steps_side_by_side_at_batch_2(tmp_path, benchmarks, cpu_only):
    """--plain-only --batch 2: AR's plain step and HybridSpec's, each committing one token per row."""
    import breakdown

    stem = tmp_path / "breakdown_plain"
    breakdown.main(["--model", "tiny", "--replays", "2", "--batch", "2", "--plain-only", "--name", str(stem)])
    report = json.loads(stem.with_suffix(".json").read_text())
    assert list(report["parts"]) == [breakdown.AR_STEP, breakdown.HS_STEP]
    assert all(row["committed_per_replay"] == 1 for row in report["parts"].values())
    assert report["outside_the_forward"] is None


def test_breakdown_times_the_max_shape_round_at_forced_lengths(tmp_path, benchmarks, cpu_only):
    """--round-lengths: the max-shape round captured once with a forced length, replayed at each w; a round commits
    at least its anchor and no more than w + 1 tokens, and its bytes grow with w (the forward's tokens)."""
    import breakdown

    stem = tmp_path / "breakdown_forced"
    breakdown.main(["--model", "tiny", "--replays", "2", "--lengths", "1", "--round-lengths", "1,4,16",
                    "--name", str(stem)])
    parts = json.loads(stem.with_suffix(".json").read_text())["parts"]
    forced = [breakdown.forced_label(n) for n in (1, 4, 16)]
    assert list(parts)[-3:] == forced and breakdown.ROUND in parts
    assert [parts[label]["verified"] for label in forced] == [1, 4, 16]
    assert all(1 <= parts[label]["committed_per_replay"] <= n + 1 for label, n in zip(forced, (1, 4, 16)))
    assert all(parts[label]["frontier"] == {"by_kernel": {}, "total": 0} for label in forced)  # CPU: nothing traced
    roofline = [parts[label]["roofline_ms"] for label in forced]
    assert roofline[0] < roofline[1] < roofline[2]
    assert "round, max shape, w = 4 forced" in stem.with_suffix(".md").read_text()
