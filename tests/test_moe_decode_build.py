"""The decode MoE kernels (kernels/moe_triton.py) build for sm_90 on any machine: the Triton interpreter, which the
CPU tests run them in, accepts code the GPU compiler refuses (benchmarks/moe_block.py --compile-check does this for
every swept tile too). In a fresh process: once the interpreter has run, triton.language's helpers no longer
compile in that process."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
BUILD = """
import json, moe_block
rows = moe_block.compile_check(moe_block.FULL, swept=False)
print(json.dumps([[r["kernel"], r["constexprs"]["TP"], r["constexprs"]["SHARED"], r["ptxas"]] for r in rows]))
"""


def test_the_decode_kernels_compile_for_sm90_at_the_default_tiles():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    built = {(kernel, block_t, shared) for kernel, block_t, shared, _ in rows}
    assert built == {(kernel, block_t, shared) for kernel in ("gate_up", "down") for block_t in (1, 2, 4)
                     for shared in (True, False)}
    spills = [int(n) for *_, ptxas in rows for n in re.findall(r"(\d+) bytes spill stores", ptxas)]
    assert not any(spills), [ptxas for *_, ptxas in rows]  # ptxas -v where triton ships it: no spills
