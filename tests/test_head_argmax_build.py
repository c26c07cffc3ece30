"""The greedy-token kernel (kernels/head_argmax_triton.py `_greedy_kernel`) builds for sm_90 on any machine at the
35B-A3B head's shape (K = 2 048, a 248 320-row head) for a bf16 and an fp16 head and the wider blocks of longer
verifications, with and without its first pass (`_lower_kernel`, built too), its candidates' loop bounded by each
block's count and walking every step, with its PDL wait, its counter's acq_rel atomic and its bf16 rounding in
integer arithmetic, at most one word spilled: the interpreter, which the CPU tests run it in, accepts code the GPU
compiler refuses. In a fresh process (see test_moe_decode_build.py)."""
import re

import pytest
from _build import ROOT, build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from moe_block import _ptxas_info
from hybridspec_hf.kernels import head_argmax_triton as ha

fn = triton.jit(ha._greedy_kernel.fn)
built = []
for kind, dtype, block_v, two, bounded in ((0, "*bf16", ha.BLOCK_V, True, True), (1, "*fp16", ha.BLOCK_V, True, True),
                                           (0, "*bf16", ha.BLOCK_V_WIDE, True, True),
                                           (0, "*bf16", ha.BLOCK_V, False, True),
                                           (0, "*bf16", ha.BLOCK_V, True, False)):
    programs = triton.cdiv(248320, block_v)
    constexprs = dict(K=2048, BLOCK_V=block_v, C=ha.CANDIDATES, BLOCK_K=ha.MAX_BLOCK_K, KP=2048,
                      BLOCK_P=triton.next_power_of_2(programs), KIND=kind, TWO_PASS=two, BOUNDED=bounded, PDL=True)
    pointers = dict(h=dtype, approx=dtype, scale="*fp32", w=dtype, lowers="*fp32", best="*i64", counters="*i32",
                    tokens="*i64")
    signature = {arg: pointers.get(arg, "fp32" if arg == "bound" else "i32")
                 for arg in fn.arg_names if arg not in constexprs}
    signature.update({arg: "constexpr" for arg in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=ha.NUM_WARPS))
    ptx = compiled.asm["ptx"]
    built.append(["griddepcontrol.wait" in ptx, "atom" in ptx and "acq_rel" in ptx, _ptxas_info(ptx)])
fn = triton.jit(ha._lower_kernel.fn)  # the first pass
constexprs = dict(K=2048, BLOCK_V=ha.BLOCK_V, KP=2048, PDL=True)
pointers = dict(h="*bf16", approx="*bf16", scale="*fp32", lowers="*fp32")
signature = {arg: pointers.get(arg, "fp32" if arg == "bound" else "i32")
             for arg in fn.arg_names if arg not in constexprs}
signature.update({arg: "constexpr" for arg in constexprs})
compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
built.append(["griddepcontrol.wait" in compiled.asm["ptx"], True, _ptxas_info(compiled.asm["ptx"])])
print(json.dumps(built))
"""


def test_the_greedy_token_kernel_compiles_for_sm90_with_its_wait_and_atomic():
    built = build(BUILD, ROOT / "benchmarks")
    assert [row[:2] for row in built] == [[True, True]] * 6
    # ptxas -v where triton ships it: at most one word spilled (ptxas 12.x keeps the 1 024-row block at 128
    # registers with a 4-byte spill; the 2 048-row one at 152 with none)
    spills = [int(n) for *_, ptxas in built for n in re.findall(r"(\d+) bytes spill stores", ptxas)]
    assert all(n <= 4 for n in spills), [ptxas for *_, ptxas in built]
