"""benchmarks/draft_head.py runs through on the CPU: the kernel part's smoke run (a small head, the Triton
interpreter; the draft graph of the tiny drafter with either head) agrees with the references, and its configs are
parsed or refused."""
import os

import pytest


@pytest.fixture
def draft_head(benchmarks, monkeypatch):
    # its import sets TRITON_INTERPRET on a machine without CUDA: set here, so that the test's end restores it
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    import draft_head

    return draft_head


def test_the_kernel_part_runs_on_the_cpu_with_either_head(draft_head, cpu_only, triton_interpreter):
    from hybridspec_hf.drafter import fused

    payload = draft_head.main(["--part", "kernel", "--rows", "1,3"])
    assert fused._ON_CPU is False  # the smoke run's switch is put back
    alone = payload["head_alone"]
    assert [(row["rows"], row["variant"].split()[0]) for row in alone] == [
        (1, "bf16"), (1, "int8"), (1, "int8"), (3, "bf16"), (3, "int8"), (3, "int8")]
    for row in alone:  # int8 rows within a quantization step of the fp32 head; argmax on random data kept
        assert row["rel_error_vs_fp32"] < (0.005 if row["variant"].startswith("bf16") else 0.03)
        assert row["weight_bytes"] == (1000 * 256 * 2 if row["variant"].startswith("bf16") else 1000 * 256 + 4000)
    graph = payload["draft_graph"]
    assert [(row["head"], row["layers"]) for row in graph] == [
        ("bf16 (the target's)", "bf16"), ("int8", "bf16"), ("bf16 (the target's)", "int8"), ("int8", "int8")]
    assert graph[0]["largest_logit_difference"] == 0 and graph[0]["draft_agreement"] == 1
    for row in graph[1:]:  # each int8 choice changes the logits, by less than a quantization step's worth
        assert 0 < row["largest_logit_difference"] < 0.1
    assert graph[3]["largest_logit_difference"] > 0 and graph[3]["largest_logit_difference"] != graph[1][
        "largest_logit_difference"]  # the layers' copies were taken (the head's alone would give row 1's logits)
    layers = payload["layers_alone"]  # each projection group at 1 and 16 rows: bf16, int8_config's, one listed
    assert [row["shape"] for row in layers[::6]] == ["q|k|v", "o", "gate|up", "down"]
    assert [(row["rows"], row["variant"].split()[:2]) for row in layers[:3]] == [
        (1, ["bf16", "(the"]), (1, ["int8", "auto"]), (1, ["int8", "32x128s1w4t4"])]
    for row in layers:
        assert row["rel_error_vs_fp32"] < (0.005 if row["variant"].startswith("bf16") else 0.03), row


def test_configs_are_parsed_or_refused(draft_head):
    config = draft_head.parse_config("64x128s2w8t3")
    assert (config.block_n, config.block_k, config.split_k, config.num_warps, config.num_stages) == (64, 128, 2, 8, 3)
    with pytest.raises(SystemExit, match="BNxBK"):
        draft_head.parse_config("64x128w4")


def test_the_tau_part_measures_every_variant_on_the_same_continuations(draft_head, cpu_only):
    """--part tau on 2 prompts x 16 tokens: τ at blocks 16 and 8 for the head as it is / int8 and the layers as
    they are / as their int8 copies multiply, over the same anchors."""
    result = draft_head.tau(2, 16)
    assert list(result) == [label for label, *_ in draft_head.TAU_VARIANTS]
    anchors = {r["block_sizes"]["16"]["num_anchors"] for r in result.values()}
    assert len(anchors) == 1 and anchors.pop() > 0
    for r in result.values():
        assert 1.0 <= r["block_sizes"]["8"]["tau"] <= 8.0 and 1.0 <= r["block_sizes"]["16"]["tau"] <= 16.0
