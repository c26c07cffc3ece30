"""The decode MoE kernels (kernels/moe_triton.py) build for sm_90 on any machine: the Triton interpreter, which the
CPU tests run them in, accepts code the GPU compiler refuses (benchmarks/moe_block.py --compile-check does this for
every swept tile too)."""
import importlib
import re
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_the_decode_kernels_compile_for_sm90_at_the_default_tiles(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    benchmark = importlib.import_module("moe_block")
    rows = benchmark.compile_check(benchmark.FULL, swept=False)
    sys.modules.pop("moe_block", None)
    built = {(row["kernel"], row["constexprs"]["TP"], row["constexprs"]["SHARED"]) for row in rows}
    assert built == {(kernel, block_t, shared) for kernel in ("gate_up", "down") for block_t in (1, 2, 4)
                     for shared in (True, False)}
    spills = [int(n) for row in rows for n in re.findall(r"(\d+) bytes spill stores", row["ptxas"])]
    assert not any(spills), [row["ptxas"] for row in rows]  # ptxas -v where triton ships it: no spills
