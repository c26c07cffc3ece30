"""The one-launch add + norm + router kernel (kernels/router_triton.py `_add_norm_route_kernel`) builds for sm_90 on any
machine at the Qwen3.5-35B-A3B shape (H = 2048, E = 256, top-8) and a tiny odd one: the interpreter, which the CPU
tests run it in, accepts code the GPU compiler refuses. In a fresh process (see test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import router_triton

fn = triton.jit(router_triton._add_norm_route_kernel.fn)
pointers = dict(x="*bf16", r="*bf16", norm_w="*bf16", router_w="*bf16", h="*bf16", y="*bf16", logits="*bf16",
                scores="*bf16", ids="*i64", counters="*i32")
built = []
for hidden, experts, k, block_n, warps in [(2048, 256, 8, 2, 1), (2048, 256, 8, 4, 4), (40, 6, 3, 2, 1)]:
    constexprs = dict(OFFSET=True, BLOCK_H=triton.next_power_of_2(hidden), BLOCK_N=block_n,
                      BLOCK_E=triton.next_power_of_2(experts), K=k, KP=triton.next_power_of_2(k), NORMALIZE=True,
                      OUT_DTYPE=triton.language.bfloat16, PDL=True)
    signature = {arg: pointers.get(arg, "fp32" if arg == "eps" else "i32") for arg in fn.arg_names
                 if arg not in constexprs}
    signature.update({arg: "constexpr" for arg in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps)).asm["ptx"]
    built.append([hidden, "griddepcontrol.wait" in ptx, "atom" in ptx])
print(json.dumps(built))
"""


def test_the_add_norm_route_kernel_compiles_for_sm90():
    assert build(BUILD) == [[2048, True, True], [2048, True, True], [40, True, True]]
