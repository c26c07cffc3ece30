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
    # the routing pass: the routers' distinct experts over each forced round's valid rows, priced into the roofline
    import e2e

    target, _ = e2e.build("tiny", None, "cpu")
    config = target.config.get_text_config()
    k, size = config.num_experts_per_tok, 3 * config.hidden_size * config.moe_intermediate_size * 4  # fp32
    layers = sum(1 for name, _ in target.named_modules() if name.endswith(".mlp.experts"))
    for label, n in zip(forced, (1, 4, 16)):
        routing = parts[label]["routing"]
        assert routing["valid_tokens"] == n and routing["replays"] == 2
        assert k <= routing["distinct_per_layer"] <= min(n * k, config.num_experts)
        assert routing["uniform_per_layer"] == pytest.approx(breakdown.uniform_distinct(target, n))
        measured, uniform = parts[label]["bytes_measured_routing"], parts[label]["bytes"]
        assert measured["experts"] == pytest.approx(layers * routing["distinct_per_layer"] * size)
        assert {key: v for key, v in measured.items() if key != "experts"} == {
            key: v for key, v in uniform.items() if key != "experts"}
    assert parts[forced[0]]["routing"]["distinct_per_layer"] == k  # one token: its k experts, all distinct
    assert all("routing" not in row for label, row in parts.items() if label not in forced)
    assert "Routing as measured" in stem.with_suffix(".md").read_text()


def test_the_routing_pass_counts_what_the_routers_picked(benchmarks, cpu_only):
    """`measured_routing` against a count made apart: the same forced rounds run with a RouterRecorder's hooks too,
    whose host copies of every router call give the distinct experts over the valid rows independently."""
    import breakdown
    import e2e
    import torch
    from hybridspec_hf.generation.calibration import ForcedLength, shadow_selector
    from hybridspec_hf.generation.router_hooks import RouterRecorder
    from hybridspec_hf import patches

    target, drafter = e2e.build("tiny", None, "cpu")
    prompt = torch.randint(0, target.config.get_text_config().vocab_size, (1, 24),
                           generator=torch.Generator().manual_seed(3))
    forced = ForcedLength(16, shadow_selector(target, 16))
    recorder = RouterRecorder(patches.moe_blocks(target))
    kwargs = breakdown.generate_kwargs("hybridspec", "forced", prompt, drafter, forced)
    try:
        result = breakdown.measured_routing(target, prompt, 64, kwargs, forced, [3, 16], 2)
    finally:
        recorder.remove()
    # the recorder saw every forward; the last 2 per w are the replays' (w = 3 then w = 16), each [layers, T, k]
    replays = [f for f in recorder.forwards if f.shape[1] == 16][-4:]
    for n, pair in zip((3, 16), (replays[:2], replays[2:])):
        counts = [len(set(layer[:n].flatten().tolist())) for f in pair for layer in f]
        assert result[n]["distinct_per_layer"] == pytest.approx(sum(counts) / len(counts))
        assert result[n]["valid_tokens"] == n


def test_a_greedy_int8_head_counts_its_copy_not_the_head(benchmarks, cpu_only):
    """Parts that take greedy tokens from the head's int8 copy price it as that copy and its row scales (V·K + 4·V
    bytes) in place of the float head; the drafter's head as its config quantizes it; nothing else moves."""
    import breakdown
    import e2e

    target, drafter = e2e.build("tiny", None, "cpu")
    head = target.get_output_embeddings().weight
    vocab, hidden = head.shape
    float_head, int8_head = head.numel() * head.element_size(), vocab * hidden + 4 * vocab
    assert float_head > int8_head
    plain = breakdown.part_bytes(target, drafter, 4, 32, False)
    copy = breakdown.part_bytes(target, drafter, 4, 32, False, int8_head=True)
    assert plain[breakdown.DENSE] - copy[breakdown.DENSE] == float_head
    assert copy.pop("LM head's int8 copy (greedy tokens)") == int8_head
    assert {k: v for k, v in copy.items() if k != breakdown.DENSE} == \
        {k: v for k, v in plain.items() if k != breakdown.DENSE}
    assert breakdown.part_bytes(target, drafter, 0, 32, True, int8_head=True)["LM head"] == float_head
    assert "LM head's int8 copy (greedy tokens)" not in breakdown.part_bytes(target, drafter, 0, 32, True,
                                                                             int8_head=True)
    drafter.config.head_quantization = "int8"
    try:
        assert breakdown.part_bytes(target, drafter, 0, 32, True)["LM head"] == int8_head
    finally:
        drafter.config.head_quantization = None


def test_kernels_are_attributed_to_module_op_and_the_python_line_that_launched_them(benchmarks):
    """`attribute_events` on a chrome trace of two launches: each kernel charged (by correlation id, then by time on
    the launching thread) to the innermost module range, aten op and Python frame of our package or transformers;
    a kernel whose launch is unknown or has nothing around it goes to the round code."""
    from breakdown import attribute_events

    def span(cat, name, ts, dur, tid=1, **args):
        return dict(cat=cat, name=name, ts=ts, dur=dur, tid=tid, args=args)

    events = [
        span("user_annotation", "hs:layers.N.mlp", 0, 100),
        span("python_function", "/x/site-packages/transformers/models/m.py(7): forward", 1, 90),
        span("python_function", "/work/repo/hybridspec_hf/kernels/moe_triton.py(1260): _launch", 2, 50),
        span("python_function", "/usr/lib/python3/functools.py(9): wrapper", 3, 20),  # not ours: skipped
        span("cpu_op", "aten::copy_", 60, 10),
        span("cuda_runtime", "cudaLaunchKernel", 5, 1, correlation=11),
        span("cuda_runtime", "cudaLaunchKernel", 62, 1, correlation=12),
        span("cuda_runtime", "cudaLaunchKernel", 63, 1, tid=2, correlation=13),  # another thread: no CPU op
        span("kernel", "_down_kernel", 200, 4.0, correlation=11),
        span("kernel", "direct_copy_kernel_cuda", 210, 1.5, correlation=12),
        span("kernel", "direct_copy_kernel_cuda", 220, 2.5, correlation=12),
        span("kernel", "lonely", 230, 3.0, correlation=99),
        span("kernel", "elsewhere", 240, 0.5, correlation=13),
    ]
    table = attribute_events(events)
    assert table == {
        "layers.N.mlp | _down_kernel | hybridspec_hf/kernels/moe_triton.py(1260): _launch": {"kernels": 1, "us": 4.0},
        "layers.N.mlp | aten::copy_ | transformers/models/m.py(7): forward": {"kernels": 2, "us": 4.0},
        "(round code) | ? | ?": {"kernels": 1, "us": 3.0},
        "(round code) | elsewhere | ?": {"kernels": 1, "us": 0.5},  # its launch's thread ran no op around it
    }
