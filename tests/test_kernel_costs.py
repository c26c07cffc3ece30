"""benchmarks/kernel_costs.py: the doubled launches, the variant names, and a run through on a tiny model on the CPU
(no Triton kernels there: timings only)."""
import json

import pytest


@pytest.fixture
def kernel_costs(benchmarks):
    import kernel_costs

    return kernel_costs


def test_a_doubled_kernel_launches_twice_with_the_same_arguments(kernel_costs):
    calls = []

    class Lazy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs)) or len(calls)

    assert kernel_costs.Doubled(Lazy())[(3, 1)](1, x=2) == 2
    assert calls == [((3, 1), (1,), {"x": 2})] * 2


def test_doubling_swaps_the_launcher_only_inside(kernel_costs):
    from hybridspec_hf.kernels import gemv_triton

    before = gemv_triton._gemv_kernel
    with kernel_costs.doubled("_gemv_kernel"):
        assert isinstance(gemv_triton._gemv_kernel, kernel_costs.Doubled)
        assert gemv_triton._gemv_kernel.lazy is before
    assert gemv_triton._gemv_kernel is before


def test_variant_names(kernel_costs):
    assert kernel_costs.parse_variant("plain") == (None, "ar")
    assert kernel_costs.parse_variant("+whole-slice") == (None, "ar+whole-slice")
    assert kernel_costs.parse_variant("gemv+whole-slice") == ("_gemv_kernel", "ar+whole-slice")
    assert kernel_costs.parse_variant("gate_up_decode-pdl") == ("_gate_up_decode_kernel", "ar-pdl")
    with pytest.raises(SystemExit, match="unknown variant 'gemm'"):
        kernel_costs.parse_variant("gemm")


def test_runs_through_on_a_tiny_model(kernel_costs, tmp_path, cpu_only):
    stem = tmp_path / "costs"
    kernel_costs.main(["--model", "tiny", "--context", "8", "--replays", "2",
                       "--variants", "plain,gemv,-whole-slice,plain", "--name", str(stem)])
    report = json.loads(stem.with_suffix(".json").read_text())
    assert [row["variant"] for row in report["rows"]] == ["plain", "gemv", "-whole-slice", "plain"]
    assert all(row["wall_ms"] > 0 for row in report["rows"])
    assert report["rows"][2]["switches"]["WHOLE_SLICE"] is False and report["switches"]["WHOLE_SLICE"] is True
    assert "µs per launch in situ" in stem.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="first variant must be 'plain'"):
        kernel_costs.main(["--model", "tiny", "--variants", "gemv", "--name", str(stem)])


def test_the_timeline_splits_the_middle_replay_around_our_kernels(kernel_costs):
    replay = [("elementwise", 0, 2), ("_rms_norm_kernel", 3, 1), ("Memcpy DtoD", 5, 1), ("_gemv_kernel", 7, 4),
              ("nvjet_gemm", 12, 5), ("argmax", 18, 2)]
    kernels = [{"name": name, "ts": 100.0 * r + ts, "us": us} for r in range(3) for name, ts, us in replay]
    t = kernel_costs.timeline(kernels, 3)
    assert [row[0] for row in t["kernels"]] == [name for name, _, _ in replay]
    assert t["kernels"][1][1] == 3.0  # from the middle replay's first kernel
    assert (t["head_us"], t["head_kernels"], t["tail_us"], t["tail_kernels"]) == (3.0, 1, 9.0, 2)
    assert t["between"] == {"Memcpy DtoD": 1}
    assert "3.0 µs and 1 kernels before" in kernel_costs.timeline_line(t)


def test_the_frontier_charges_each_microsecond_once(kernel_costs):
    t = {"kernels": [["a", 0.0, 2.0], ["b", 1.0, 4.0], ["c", 2.0, 1.0], ["b", 6.0, 1.0]]}
    f = kernel_costs.frontier(t)
    # a: 0-2 (2); b: ends 5 (3 past a); c ends 3, inside b (0); b again: 6-7 (2: the gap and its µs)
    assert f["by_kernel"] == {"b": {"kernels": 2, "us": 5.0}, "a": {"kernels": 1, "us": 2.0},
                              "c": {"kernels": 1, "us": 0.0}}
    assert f["total"] == 7.0
    rows = [{"variant": "plain", "frontier": f}, {"variant": "x", "frontier": kernel_costs.frontier(t)}]
    assert "| plain | 7.0 | 5 | 2 | 0 | 0 |" in kernel_costs.frontier_table(rows)


def test_compare_sets_plain_steps_side_by_side(kernel_costs, tmp_path):
    def source(path, kernels, wall):
        rows = [{"variant": "plain", "wall_ms": wall, "kernels": len(kernels), "timeline": {"kernels": kernels}},
                {"variant": "gemv", "wall_ms": 9.0, "kernels": 1, "timeline": {"kernels": [["x", 0.0, 99.0]]}}]
        path.write_text(json.dumps({"environment": {"date": "d"}, "rows": rows}))
        return str(path)

    a = source(tmp_path / "a.json", [["_gemv_kernel", 0.0, 4.0], ["argmax", 4.0, 2.0]], 0.01)
    b = source(tmp_path / "b.json", [["_gemv_kernel", 0.0, 3.0], ["_gemv_kernel", 3.0, 1.0]], 0.008)
    report = kernel_costs.compare([a, b], str(tmp_path / "cmp"))
    first, second = report["columns"]
    assert first["by_kernel"] == {"_gemv_kernel": [1.0, 4.0], "argmax": [1.0, 2.0]} and first["span_us"] == 6.0
    assert second["by_kernel"] == {"_gemv_kernel": [2.0, 4.0]} and second["span_us"] == 4.0
    table = (tmp_path / "cmp.md").read_text()
    assert "| _gemv_kernel | 1 | 4 | 2 | 4 |" in table and "| argmax | 1 | 2 | 0 | 0 |" in table
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"environment": {"date": "d"}, "rows": [{"variant": "plain", "wall_ms": 1.0,
                                                                          "kernels": 0, "timeline": {"kernels": []}}]}))
    with pytest.raises(SystemExit, match="no plain row with a timeline"):
        kernel_costs.compare([str(empty)], str(tmp_path / "x"))


def test_tiles_set_overrides_the_one_token_tiles_only_inside(kernel_costs):
    from hybridspec_hf.kernels import gdn_step_triton, gemv_triton, moe_triton

    assert kernel_costs.parse_tiles("gate_up=16x128s4w4") == {"gate_up": (16, 128, 4, 4)}
    assert kernel_costs.parse_tiles("gemv:2048x4096=32x128s8w4t4") == {("gemv", 2048, 4096): (32, 128, 8, 4, 4)}
    for bad in ("gate_up=16x128", "gemv=32x128s8w4t4", "route=4w1", "gdn=16"):
        with pytest.raises(SystemExit, match="unknown tiles"):
            kernel_costs.parse_tiles(bad)
    before = moe_triton.default_tiles(1, "decode"), moe_triton.default_tiles(2, "decode")
    table = dict(gemv_triton.TABLE)
    tiles = {**kernel_costs.parse_tiles("gate_up=16x128s4w4"), **kernel_costs.parse_tiles("down=32x128w8"),
             **kernel_costs.parse_tiles("gdn=32w4"), **kernel_costs.parse_tiles("gemv:48x64=16x32s2w4t3")}
    with kernel_costs.tiles_set(tiles):
        _, gate_up, down = moe_triton.default_tiles(1, "decode")
        assert gate_up == moe_triton.Tiles(16, 128, 4, 1, split_k=4) and down == moe_triton.Tiles(32, 128, 8, 1)
        assert moe_triton.default_tiles(2, "decode") == before[1]  # other token counts keep theirs
        assert gdn_step_triton.step_config(128, 32) == (32, 4)
        assert gemv_triton.choose_config(1, 48, 64) == gemv_triton.GemvConfig(16, 32, 2, 4, 3, True)
    assert moe_triton.default_tiles(1, "decode") == before[0] and gemv_triton.TABLE == table
    assert gdn_step_triton.step_config(128, 32) == (16, 2)
    assert kernel_costs.parse_variant("gemv-pdl@gdn=32w4") == ("_gemv_kernel", "ar-pdl")
