"""benchmarks/greedy_head_ab.sh (the int8 greedy head's decision in one GPU call) runs through on tiny shapes (CPU)
and packs every step's files into one tar."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_step_runs_and_lands_in_one_tar(tmp_path, cpu_only):
    env = {**os.environ, "MODEL": "tiny", "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "benchmarks/greedy_head_ab.sh", str(tmp_path), "t"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    steps = ["cuda_tests_t", "greedy_head_t", "kernel_costs_t", "batch_b1_t"]
    assert [line.split(":")[0] for line in done.stdout.splitlines() if ": rc " in line] == steps
    assert done.stdout.count(": rc 0 ") == 4, done.stdout
    with tarfile.open(tmp_path / "t.tar.gz") as tar:
        names = {Path(name).name for name in tar.getnames()}
        assert {f"{s}.{ext}" for s in steps[1:] for ext in ("md", "json", "log")} <= names
        assert "cuda_tests_t.log" in names
        costs = tar.extractfile("./kernel_costs_t.md").read().decode()
        batch = tar.extractfile("./batch_b1_t.md").read().decode()
        head = tar.extractfile("./greedy_head_t.md").read().decode()
    assert costs.count("| plain |") == 2 and "| +int8-greedy-head-greedy-two-pass |" in costs
    assert all(f"| {m} |" in batch for m in ("ar", "ar+int8-greedy-head", "hybridspec+int8-head",
                                            "hybridspec+int8-head+int8-greedy-head"))
    assert "| 3 | int8 greedy, one pass |" in head and "3/3" in head
