"""benchmarks/headline.sh (the README's "Where it stands" batch figures in one GPU call) runs through on the tiny
model (CPU) and packs every step's files into one tar."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_step_runs_and_lands_in_one_tar(tmp_path, cpu_only):
    env = {**os.environ, "MODEL": "tiny", "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "benchmarks/headline.sh", str(tmp_path), "t"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    steps = ["batch_b1_t_max", "batch_b1_t_exact", "batch_b4_t_max", "batch_b4_t_exact"]
    assert [line.split(":")[0] for line in done.stdout.splitlines() if ": rc " in line] == steps
    assert done.stdout.count(": rc 0 ") == 4, done.stdout
    with tarfile.open(tmp_path / "t.tar.gz") as tar:
        names = {Path(name).name for name in tar.getnames()}
        assert {f"{s}.{ext}" for s in steps for ext in ("md", "json", "log")} <= names
        b1_max = tar.extractfile("./batch_b1_t_max.md").read().decode()
        b4_exact = tar.extractfile("./batch_b4_t_exact.md").read().decode()
    assert all(f"| {m} |" in b1_max for m in ("ar", "hybridspec+int8-head", "hybridspec", "dflash"))
    assert "verify shape exact" in b4_exact and "| 4 | medium" in b4_exact


def test_steps_picks_the_steps_and_refuses_an_unknown_one(tmp_path, cpu_only):
    env = {**os.environ, "MODEL": "tiny", "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "STEPS": "b4_max"}
    done = subprocess.run(["bash", "benchmarks/headline.sh", str(tmp_path), "s"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines() if ": rc " in line] == ["batch_b4_s_max"]
    with tarfile.open(tmp_path / "s.tar.gz") as tar:
        assert {Path(name).name for name in tar.getnames()} >= {"batch_b4_s_max.md", "batch_b4_s_max.log"}
        assert not any("b1" in name for name in tar.getnames())
    refused = subprocess.run(["bash", "benchmarks/headline.sh", str(tmp_path), "u"], cwd=ROOT,
                             env={**env, "STEPS": "b4_max,b2_max"}, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "unknown step 'b2_max'" in refused.stderr
    assert not (tmp_path / "u.tar.gz").exists()
