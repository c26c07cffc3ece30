"""The GDN decoding step kernel (kernels/gdn_step_triton.py) builds for sm_90 on any machine, with the folded norm
and the early state read (before the PDL wait) on and off, at the Qwen3.5-35B-A3B layer's shape: the interpreter,
which the CPU tests run it in, accepts code the GPU compiler refuses. In a fresh process (see
test_moe_decode_build.py)."""
import pytest
from _build import build

pytest.importorskip("triton")

BUILD = """
import json, triton
from triton.backends.compiler import GPUTarget
from hybridspec_hf.kernels import gdn_step_triton

fn = triton.jit(gdn_step_triton._gdn_step_kernel.fn)
pointers = dict(x="*bf16", conv_state="*bf16", conv_w="*bf16", conv_bias="*bf16", a="*bf16", b="*bf16",
                A_log="*fp32", dt_bias="*bf16", state="*fp32", z="*bf16", norm_w="*bf16", out="*bf16",
                counters="*i32")
floats = {"scale", "threshold", "eps"}
built = []
for block_v, fold, early, loads_first in [(16, True, True, True), (16, True, True, False), (16, False, False, True),
                                         (128, False, True, True)]:
    constexprs = dict(K=4, BK=128, BV=block_v, BW=4, BD=128, ARRIVALS=4 * 128 // block_v, TILES=128 // block_v,
                      HAS_BIAS=False, NORM=block_v == 128, FOLD_NORM=fold, EARLY=early, LOADS_FIRST=loads_first,
                      X_DTYPE=triton.language.bfloat16,
                      W_DTYPE=triton.language.bfloat16, BETA_DTYPE=triton.language.bfloat16, PDL=True)
    signature = {arg: pointers.get(arg, "fp32" if arg in floats else "i32") for arg in fn.arg_names
                 if arg not in constexprs}
    signature.update({arg: "constexpr" for arg in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=2 if block_v == 16 else 8))
    ptx = compiled.asm["ptx"]
    built.append([block_v, fold, early, "griddepcontrol.wait" in ptx, "atom" in ptx])
print(json.dumps(built))
"""


def test_the_step_kernel_compiles_for_sm90_with_the_folded_norm_early_reads_and_loads_first():
    built = build(BUILD)
    # every variant waits (PDL) and the narrow tiles count arrivals (window roll, folded norm)
    assert built == [[16, True, True, True, True], [16, True, True, True, True], [16, False, False, True, True],
                     [128, False, True, True, True]]
