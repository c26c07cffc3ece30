"""benchmarks/round_tiles.py runs through on a tiny model on the CPU (timings only): each variant's round captured
with its length forced verifies exactly the forced w, and a malformed variant is refused before any model is built."""
import json

import pytest


@pytest.fixture
def round_tiles(benchmarks):
    import round_tiles

    return round_tiles


def test_round_tiles_times_each_forced_length_per_variant(tmp_path, round_tiles, cpu_only):
    stem = tmp_path / "round_tiles_tiny"
    round_tiles.main(["--model", "tiny", "--replays", "1", "--lengths", "1,4,16", "--variants",
                      "base,g16x64w2s3-d32x64-moe-decode,base", "--name", str(stem)])
    report = json.loads(stem.with_suffix(".json").read_text())
    assert [r["variant"] for r in report["rows"]] == ["base", "g16x64w2s3-d32x64-moe-decode", "base"]
    assert [r["switches"]["DECODE_PATH"] for r in report["rows"]] == [True, False, True]  # the switch, then back
    assert all(r["verified"] == {"1": 1, "4": 4, "16": 16} for r in report["rows"])
    assert all(len(r["wall_ms_all"]["4"]) == 3 and r["wall_ms"]["4"] > 0 for r in report["rows"])
    assert "| g16x64w2s3-d32x64-moe-decode |" in stem.with_suffix(".md").read_text()


def test_round_tiles_variants_parse_or_are_refused(round_tiles):
    from hybridspec_hf.kernels.moe_triton import Tiles

    assert round_tiles.parse_variant("base") is None
    assert round_tiles.parse_variant("g16x128-d32x64w8s3") == (Tiles(16, 128, 4, 4), Tiles(32, 64, 8, 3))
    with pytest.raises(SystemExit, match="unknown variant 'g16-d32'"):
        round_tiles.main(["--variants", "base,g16-d32"])
    with pytest.raises(SystemExit, match="unknown variant 'base\\+nonsense'"):
        round_tiles.main(["--variants", "base+nonsense"])


def test_direct_tiles_apply_at_the_block_only(round_tiles):
    from hybridspec_hf.kernels import moe_triton

    tiles = round_tiles.parse_variant("g16x64-d16x64")
    before = moe_triton.default_tiles(4, "direct")
    with round_tiles.direct_tiles(tiles, 16):
        assert moe_triton.default_tiles(16, "direct")[1:] == tiles
        assert moe_triton.default_tiles(4, "direct") == before
        assert moe_triton.default_tiles(16, "sorted") != (16, *tiles)
    assert moe_triton.default_tiles(16, "direct")[1:] != tiles
