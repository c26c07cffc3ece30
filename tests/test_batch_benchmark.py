"""benchmarks/batch.py (the batched H200 benchmark) runs through on the tiny model (CPU)."""
import json
from pathlib import Path

import pytest


@pytest.fixture
def batch_benchmark(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import batch

    return batch


def test_every_method_batch_and_profile_is_measured_and_written(batch_benchmark, tmp_path, cpu_only):
    stem = tmp_path / "batch_tiny"
    batch_benchmark.main(["--model", "tiny", "--batches", "1,3", "--profiles", "high,low", "--tokens", "6",
                          "--context", "8", "--name", str(stem)])
    report = json.loads(stem.with_suffix(".json").read_text())
    assert set(report["batches"]) == {"1", "3"} and report["latency_ms"].keys() == {"1", "3"}
    for batch, profiles in report["batches"].items():
        assert set(profiles) == {"high", "low"}
        for label, entry in profiles.items():
            assert entry["profile"] == batch_benchmark.PROFILES[label]
            methods = entry["methods"]
            assert set(methods) == {"ar", "dflash", "hybridspec"}
            for method, row in methods.items():
                assert row["new_tokens_per_row"] == 6 and row["tokens_per_s"] > 0
                # GPU-resident rounds (their CPU twin here); the profiles replayed per row
                assert row["path"] == "static_eager", row["path_reason"]
            assert methods["dflash"]["mean_w"] > methods["ar"]["mean_w"] == 1.0
    high = report["batches"]["3"]["high"]["methods"]["dflash"]["tau"]
    low = report["batches"]["3"]["low"]["methods"]["dflash"]["tau"]
    assert high > low  # the declared profiles' acceptance, replayed per row
    text = stem.with_suffix(".md").read_text()
    assert "HybridSpec over vanilla DFlash" in text and "| 3 | low" in text
    assert stem.with_suffix(".png").exists()
