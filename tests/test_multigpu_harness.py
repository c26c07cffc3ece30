"""The tensor-parallel benchmark (benchmarks/multigpu.py) runs through on a tiny config: two CPU ranks over gloo,
the model built from a config-only checkpoint (transformers initialises every missing weight shard by shard), both
modes, results written by rank 0. The same script runs the Qwen3.5-122B-A10B shape on two GPUs over NCCL."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def test_the_tensor_parallel_benchmark_runs_both_modes_on_two_cpu_ranks(tmp_path):
    env = {**os.environ, "HYBRIDSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks even on a GPU machine (transformers' TP takes the accelerator)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "benchmarks" / "multigpu.py"), "--model", "tiny", "--device", "cpu",
               "--modes", "correctness,timing", "--tokens", "10", "--context", "8", "--profiles", "low",
               "--routing", "uniform", "--methods", "ar,dflash", "--strategies", "ar,dflash,static",
               "--correctness-tokens", "10", "--correctness-prompts", "8", "--out", str(tmp_path),
               "--scratch", str(tmp_path), "--name", "tiny"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "multigpu_tiny.json").read_text())
    assert report["world_size"] == 2 and report["environment"]["world_size"] == 2
    rows = report["profiles"]["low / uniform routing"]["methods"]
    assert set(rows) == {"ar", "dflash"} and rows["dflash"]["path"] == "static_eager" and rows["dflash"]["tau"] > 1
    floor = [c for c in report["correctness"] if c["strategy"] == "stock, eager attention"]
    cases = [c for c in report["correctness"] if c not in floor]
    assert len(floor) == 1 and floor[0]["equal"]  # fp32: stock through other attention kernels, the same text
    assert len(cases) == 3 and all(c["equal"] and c["output_device"] == "cpu" for c in cases), cases
    assert "Correctness" in (tmp_path / "multigpu_tiny.md").read_text()


def test_one_rank_runs_the_correctness_mode_without_tensor_parallelism(tmp_path):
    """`--nproc_per_node 1`: the target whole on one device (as benchmarks/e2e.py builds it), so the 35B-A3B
    shape's correctness mode runs on one H200; every speculative strategy is compared with our AR too."""
    env = {**os.environ, "HYBRIDSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(ROOT / "benchmarks" / "multigpu.py"), "--model", "tiny", "--device", "cpu",
               "--modes", "correctness", "--strategies", "ar,dflash,hybridspec", "--correctness-tokens", "10",
               "--correctness-prompts", "8,20", "--out", str(tmp_path), "--scratch", str(tmp_path), "--name", "one"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "multigpu_one.json").read_text())
    assert report["world_size"] == 1 and "no tensor parallelism" in report["device"]
    cases = [c for c in report["correctness"] if c["strategy"] != "stock, eager attention"]
    assert len(cases) == 6 and all(c["equal"] for c in cases), cases
    speculative = [c for c in cases if c["strategy"] != "ar"]
    assert len(speculative) == 4 and all(c["equal_to_our_ar"] for c in speculative)
    assert "equal to our captured AR" in (tmp_path / "multigpu_one.md").read_text()
