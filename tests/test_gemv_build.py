"""The skinny GEMM (kernels/gemv_triton.py `_gemv_kernel`) with the RMSNorm prologue builds for sm_90 on any machine
at the AR step's shapes (the GDN input projection's copy 12352 x 2048 in 16 K steps, the attention's q|k|v copy
9216 x 2048) and a split-K one: the interpreter, which the CPU tests run it in, accepts code the GPU compiler
refuses. In a fresh process (see test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import gemv_triton

fn = triton.jit(gemv_triton._gemv_kernel.fn)
pointers = dict(x="*bf16", w="*bf16", bias="*bf16", y="*bf16", partials="*fp32", counters="*i32", norm_w="*bf16")
built = []
for block_n, block_k, steps, split, norm in [(64, 128, 16, 1, True), (64, 128, 16, 1, False), (32, 256, 1, 8, True)]:
    constexprs = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, STEPS=steps, SPLIT_K=split, DOT=True,
                      DOT_FP32=False, EVEN_K=True, HAS_BIAS=False, NORM=norm, NORM_CHUNK=256, NORM_STEPS=8,
                      OUT_DTYPE=triton.language.bfloat16, PDL=True)
    signature = {arg: pointers.get(arg, "fp32" if arg == "eps" else "i32") for arg in fn.arg_names
                 if arg not in constexprs}
    signature.update({arg: "constexpr" for arg in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4))
    ptx = compiled.asm["ptx"]
    built.append([norm, "griddepcontrol.wait" in ptx, "rsqrt" in ptx])
print(json.dumps(built))
"""


def test_the_gemv_kernel_with_the_norm_prologue_compiles_for_sm90():
    assert build(BUILD) == [[True, True, True], [False, True, False], [True, True, True]]
