"""Context lookup's device kernel (kernels/lookup_triton.py `_context_lookup_kernel`) builds for sm_90 on any machine
(the interpreter, which the CPU tests run it in, accepts code the GPU compiler refuses): the tiny pair's match
lengths 2-4 and block 16, and 1-3 with block 5. In a fresh process (see test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import lookup_triton

fn = triton.jit(lookup_triton._context_lookup_kernel.fn)
built = []
for low, high, block, chunks in [(2, 4, 16, 3), (1, 3, 5, 1)]:
    constexprs = dict(MIN_N=low, MAX_N=high, NP=triton.next_power_of_2(high + 1),
                      BLOCK_B=triton.next_power_of_2(block - 1), BLOCK_S=lookup_triton.BLOCK_S, CHUNKS=chunks,
                      CP=triton.next_power_of_2(chunks))
    signature = {arg: "i32" if arg.startswith("stride") or arg == "B1" else "*i64" for arg in fn.arg_names
                 if arg not in constexprs}
    signature["counters"] = "*i32"
    signature.update({arg: "constexpr" for arg in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    built.append(len(compiled.asm["ptx"]) > 0)
print(json.dumps(built))
"""


def test_the_lookup_kernel_compiles_for_sm90():
    assert build(BUILD) == [True, True]
