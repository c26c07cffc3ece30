"""The GDN verify prologue's one-launch kernel (kernels/gdn_prologue_triton.py `_conv_gates_kernel`: conv + silu and
gates in one grid) builds for sm_90 on any machine at the Qwen3.5-35B-A3B layer's shape (C = 8192, HV = 32, a
16-token verification; and the rolling one-token form): the interpreter, which the CPU tests run it in, accepts code
the GPU compiler refuses. In a fresh process (see test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import gdn_prologue_triton

fn = triton.jit(gdn_prologue_triton._conv_gates_kernel.fn)
pointers = dict(state="*bf16", x="*bf16", w="*bf16", bias="*bf16", out="*bf16", a="*bf16", b="*bf16",
                A_log="*fp32", dt_bias="*bf16", g="*fp32", beta="*bf16")
built = []
for block_t, roll in [(16, False), (2, True)]:
    constexprs = dict(K=4, BT=block_t, BC=128, HAS_BIAS=False, X_DTYPE=triton.language.bfloat16,
                      W_DTYPE=triton.language.bfloat16, ROLL=roll, BW=4, BR=16, BH=32,
                      BETA_DTYPE=triton.language.bfloat16, PDL=True)
    signature = {arg: pointers.get(arg, "fp32" if arg == "threshold" else "i32") for arg in fn.arg_names
                 if arg not in constexprs}
    signature.update({arg: "constexpr" for arg in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = compiled.asm["ptx"]
    built.append([roll, "griddepcontrol.wait" in ptx, "ex2.approx" in ptx])
print(json.dumps(built))
"""


def test_the_conv_and_gates_kernel_compiles_for_sm90():
    # both forms wait (PDL) and compute exponentials (silu, softplus, sigmoid)
    assert build(BUILD) == [[False, True, True], [True, True, True]]
