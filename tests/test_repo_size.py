"""The tracked tree must fit what a GPU call carries (the device tool copies the working tree: at most 64 MiB)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 60  # 64 MiB a call, less room for the carried call scripts, wheels and a session's new results


def test_the_tracked_files_leave_room_under_the_gpu_calls_limit():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / name for name in names.decode().split("\0") if name]
    sizes = {path.relative_to(ROOT): path.stat().st_size for path in files if path.is_file()}
    total = sum(sizes.values()) / 2**20
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    largest = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in largest)
    assert total < LIMIT_MIB, (f"tracked files {total:.1f} MiB, over {LIMIT_MIB} MiB: GPU calls would soon be refused. "
                               f"Compress results (benchmarks/common.write_results writes large JSON as .json.gz) or "
                               f"drop what is not needed; largest: {largest}")
