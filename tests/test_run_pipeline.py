"""The tiny pair's one-call training script (`scripts/tiny_pair/run_pipeline.py`): drafter variants side by side."""
from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

from hybridspec_hf.tiny_pair import ASSETS_DIR

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tiny_pair" / "run_pipeline.py"


@pytest.fixture(scope="module")
def pipeline():
    spec = importlib.util.spec_from_file_location("run_pipeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variants_train_side_by_side_on_one_response_stage(pipeline, tmp_path):
    """Two variants of the shipped drafter (plain, and distilled + reading one more target layer) each train in their
    own process on the same responses and come back with their weights, recipe and held-out τ."""
    data = tmp_path / "data"
    data.mkdir()
    prompts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(12)]
    for name, chosen in (("train", prompts[:8]), ("heldout", prompts[8:])):
        (data / f"{name}_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in chosen))
    out = tmp_path / "out"
    pipeline.main(["--work", str(tmp_path / "work"), "--out", str(out), "--data-dir", str(data), "--smoke",
                   "--target-dir", str(ASSETS_DIR / "target"), "--init-drafter", str(ASSETS_DIR / "drafter"),
                   "--deadline-s", "300", "--eval-reserve-s", "30", "--variant", "plain={}",
                   "--variant", 'wide={"distill_weight": 0.5, "distill_topk": 8, "target_layer_ids": [1, 3, 5, 7]}'])
    assert sorted(p.name for p in out.iterdir()) == ["drafter_plain.tar", "drafter_wide.tar", "results.json",
                                                      "variant_logs.tar"]
    results = json.loads((out / "results.json").read_text())
    plain, wide = results["variants"]["plain"], results["variants"]["wide"]
    assert plain["returncode"] == 0 and wide["returncode"] == 0
    assert plain["training_log"]["recipe"]["distill_weight"] == 0.0
    assert wide["training_log"]["recipe"]["distill_weight"] == 0.5
    for variant in (plain, wide):
        assert 1.0 <= variant["eval"]["block_sizes"]["16"]["tau"] <= 16.0
    with tarfile.open(out / "drafter_wide.tar") as tar:
        config = json.load(tar.extractfile("drafter_wide/config.json"))
    assert config["target_layer_ids"] == [1, 3, 5, 7]


@pytest.mark.parametrize("variant, message", [
    ("noequals", "write NAME=JSON"),
    ("bad name={}", "write NAME=JSON"),
    ("kd={distill_weight: 1}", "is not JSON"),
    ('kd={"steps": 3}', "keys must be among"),
    ('kd=[1]', "keys must be among"),
])
def test_a_bad_variant_is_refused_with_its_form(pipeline, variant, message):
    with pytest.raises(ValueError, match=message):
        pipeline.parse_variant(variant)


def test_variant_names_are_unique_and_few(pipeline, tmp_path, capsys):
    base = ["--work", str(tmp_path), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        pipeline.main(base + ["--variant", "a={}", "--variant", "a={}"])
    assert "each with its own name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pipeline.main(base + [arg for i in range(6) for arg in ("--variant", f"v{i}={{}}")])
    assert "at most 5" in capsys.readouterr().err
    assert pipeline.strip_variants(["--work", "w", "--variant", "a={}", "--variant=b={}", "--smoke"]) == [
        "--work", "w", "--smoke"]
