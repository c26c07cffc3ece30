"""The plain step's bookkeeping kernel (kernels/step_tail_triton.py `_step_tail_kernel`) builds for sm_90 on any
machine: one row with the attention layers' lengths and three mRoPE rows, a batch of 16 with one position row, with
and without device_commit (the interpreter, which the CPU tests run it in, accepts code the GPU compiler refuses).
In a fresh process (see test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import step_tail_triton

fn = triton.jit(step_tail_triton._step_tail_kernel.fn)
built = []
for rows, width, position_rows, attention, device_commit in [(1, 1, 3, True, True), (1, 16, 1, True, False),
                                                             (16, 16, 1, False, True)]:
    constexprs = dict(R=position_rows, E=8, BLOCK_N=rows, BLOCK_T=width, BLOCK_L=16, ATTENTION=attention,
                      DEVICE_COMMIT=device_commit, PDL=True)
    signature = {arg: "i32" if arg in ("N", "L", "T") else "*i64" for arg in fn.arg_names if arg not in constexprs}
    signature.update({arg: "constexpr" for arg in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    built.append("griddepcontrol.wait" in compiled.asm["ptx"])
print(json.dumps(built))
"""


def test_the_step_tail_kernel_compiles_for_sm90():
    assert build(BUILD) == [True, True, True]
