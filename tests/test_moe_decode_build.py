"""The decode MoE kernels (kernels/moe_triton.py) build for sm_90 on any machine: the Triton interpreter, which the
CPU tests run them in, accepts code the GPU compiler refuses (benchmarks/moe_block.py --compile-check does this for
every swept tile too). In a fresh process: once the interpreter has run, triton.language's helpers no longer
compile in that process."""
import re

import pytest
from _build import ROOT, build

pytest.importorskip("triton")

BUILD = """
import json, moe_block
from hybridspec_hf.kernels import pdl
rows = moe_block.compile_check(moe_block.FULL, swept=False)
pdl.EARLY_READS = False  # the down kernel's other path: every read after the PDL wait
rows += moe_block.compile_check(moe_block.FULL, swept=False)
print(json.dumps([[r["kernel"], r["constexprs"]["TP"], r["constexprs"]["SHARED"], r["ptxas"]] for r in rows]))
"""


def test_the_decode_kernels_compile_for_sm90_at_the_default_tiles():
    rows = build(BUILD, ROOT / "benchmarks")
    built = {(kernel, block_t, shared) for kernel, block_t, shared, _ in rows}
    assert built == {(kernel, block_t, shared) for kernel in ("gate_up", "down") for block_t in (1, 2, 4)
                     for shared in (True, False)}
    spills = [int(n) for *_, ptxas in rows for n in re.findall(r"(\d+) bytes spill stores", ptxas)]
    assert not any(spills), [ptxas for *_, ptxas in rows]  # ptxas -v where triton ships it: no spills
