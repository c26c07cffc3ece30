"""The MoE direct-row kernels (kernels/moe_triton.py) build for sm_90 on any machine at every tile they take at the
Qwen3.5-35B-A3B shape (16, 32 and 64 rows: up to 4 batch rows verifying 16 tokens), with the launch's stages, and so
does the align kernel at up to 4,096 pairs: the interpreter, which the CPU tests run them in, accepts code the GPU
compiler refuses. In a fresh process (see test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import moe_triton

pointers = dict(hidden="*bf16", ids="*i64", block_expert="*i32", block_pairs="*i32", w1="*bf16", act="*fp32",
                shared_w1="*bf16", logit="*fp32", weights="*bf16", w2="*bf16", rows="*fp32", shared_w2="*bf16")
built = []
for tokens, deep in ((16, False), (16, True), (32, False), (64, False)):
    moe_triton.DIRECT_DEEP_K = deep
    block_m, gate_up, down = moe_triton.default_tiles(tokens, "direct")
    common = dict(H=2048, INTER=512, DIRECT=True, K=8, KP=8, SP=triton.next_power_of_2(block_m * 8), BM=block_m,
                  DOT_FP32=False, SHARED=True, SHARED_FIRST=True, PDL=True)
    for name, tiles in (("_gate_up_kernel", gate_up), ("_down_kernel", down)):
        fn = triton.jit(getattr(moe_triton, name).fn)
        constexprs = dict(common, BN=tiles.block_n, BK=tiles.block_k)
        signature = {arg: pointers.get(arg, "i32") for arg in fn.arg_names if arg not in constexprs}
        signature.update({arg: "constexpr" for arg in constexprs})
        source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
        built.append([tokens, block_m, name, compiled.metadata.shared])
for pairs in (256, 2048, 4096):  # the align kernel: one program sorting up to 4,096 pairs
    spp = triton.next_power_of_2(pairs)
    fn = triton.jit(moe_triton._align_kernel.fn)
    constexprs = dict(BM=16, SPP=spp, FILL=1024, FILLS=8, PDL=True)
    signature = dict(ids="*i64", block_pairs="*i32", block_expert="*i32", scratch="*i32", S="i32", E="i32", NB="i32",
                     ROWS="i32", **{k: "constexpr" for k in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4 if spp <= 1024 else 8))
    built.append([pairs, spp, "_align_kernel", compiled.metadata.shared])
print(json.dumps(built))
"""


def test_the_direct_kernels_and_the_align_kernel_compile_for_sm90():
    built = build(BUILD)
    assert [(t, m) for t, m, *_ in built] == [(16, 16), (16, 16), (16, 16), (16, 16), (32, 32), (32, 32), (64, 64),
                                              (64, 64),
                                              (256, 256), (2048, 2048), (4096, 4096)]
    assert all(0 < shared <= 160 * 1024 for *_, shared in built), built  # fits an H200 SM with room to spare
