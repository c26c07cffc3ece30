"""The skinny GEMM (kernels/gemv_triton.py `_gemv_kernel`) with the RMSNorm prologue builds for sm_90 on any machine
at the AR step's shapes (the GDN input projection's copy 12352 x 2048 in 16 K steps, the attention's q|k|v copy
9216 x 2048) and a split-K one, and with int8 weight rows and their scales (the drafter's int8 LM head at
INT8_CONFIG, K = 2048 in 8 steps; a drafter layer's int8 down_proj 2048 x 6144 at `int8_config`'s split K): the
interpreter, which the CPU tests run it in, accepts code the GPU compiler
refuses. In a fresh process (see test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import gemv_triton

fn = triton.jit(gemv_triton._gemv_kernel.fn)
pointers = dict(x="*bf16", w="*bf16", bias="*bf16", y="*bf16", partials="*fp32", counters="*i32", norm_w="*bf16",
                scale="*fp32")
config = gemv_triton.INT8_CONFIG
narrow = gemv_triton.int8_config(2048, 6144)  # a drafter layer's down_proj in int8: K split
built = []
for block_n, block_k, steps, split, norm, scaled in [(64, 128, 16, 1, True, False), (64, 128, 16, 1, False, False),
                                                     (32, 256, 1, 8, True, False),
                                                     (config.block_n, config.block_k, 2048 // config.block_k, 1,
                                                      False, True),
                                                     (narrow.block_n, narrow.block_k,
                                                      6144 // narrow.split_k // narrow.block_k, narrow.split_k,
                                                      False, True)]:
    constexprs = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, STEPS=steps, SPLIT_K=split, DOT=True,
                      DOT_FP32=False, EVEN_K=True, HAS_BIAS=False, NORM=norm, NORM_CHUNK=256, NORM_STEPS=8,
                      SCALED=scaled, OUT_DTYPE=triton.language.bfloat16, PDL=True)
    signature = {arg: dict(pointers, w="*i8" if scaled else "*bf16").get(arg, "fp32" if arg == "eps" else "i32")
                 for arg in fn.arg_names if arg not in constexprs}
    signature.update({arg: "constexpr" for arg in constexprs})
    # as the JIT specializes them at launch: 16-byte aligned pointers, sizes and strides divisible by 16
    attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]]
             for arg in ("x", "w", "y", "scale", "K", "stride_xm", "stride_wn", "stride_ym")}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps if scaled else 4,
                                           num_stages=config.num_stages if scaled else 4))
    ptx = compiled.asm["ptx"]
    built.append([norm, "griddepcontrol.wait" in ptx, "rsqrt" in ptx, "cp.async" in ptx and "mma" in ptx])
print(json.dumps(built))
"""


def test_the_gemv_kernel_with_the_norm_prologue_and_int8_rows_compiles_for_sm90():
    built = build(BUILD)
    assert [row[:3] for row in built] == [[True, True, True], [False, True, False], [True, True, True],
                                           [False, True, False], [False, True, False]]
    assert built[3][3] and built[4][3], "an int8 build streams no weight tile asynchronously into tensor cores"
