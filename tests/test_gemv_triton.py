"""The skinny GEMM (kernels/gemv_triton.py) against torch.matmul and the float64 product, its dispatch (`linear`),
and its wiring into resident forwards (patches/_linear.py), on the CPU under the Triton interpreter.

Tolerance, elementwise, against the float64 product r of the same (rounded) inputs:
    |y - r| <= ulp · |r| + K · 2^-24 · (|x| @ |W|ᵀ)
the first term one rounding of the output (ulp = 2^-7 bf16, 2^-10 fp16, 0 fp32: the interpreter truncates fp32 ->
bf16/fp16, a GPU rounds to nearest, half of it), the second the worst case of an fp32 sum of K products in any order
(tensor-core dots, the split-K partials, numpy's blocked matmul in the interpreter). torch.matmul satisfies the same
bound, so ours and torch's differ by at most twice it.
"""
from __future__ import annotations

import copy
import importlib
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from _tiny import VOCAB, make_drafter, make_target  # noqa: E402

import hybridspec_hf  # noqa: E402,F401  (installs the patches)
from hybridspec_hf import patches  # noqa: E402
from hybridspec_hf.kernels import gemv_triton  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import GemvConfig, fit_config, gemv, linear, m_bucket  # noqa: E402
from hybridspec_hf.patches import _decoder, _linear, _moe  # noqa: E402
from hybridspec_hf.patches._weight_copies import hooked  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 0.0}


def inputs(rows: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, weight, b


def bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: torch.Tensor) -> torch.Tensor:
    """The elementwise error bound of the module docstring (bias: one more exact term in the sum)."""
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return ULP[x.dtype] * exact.abs() + (x.shape[-1] + 1) * 2.0**-24 * magnitude


def assert_close_to_truth(y, x, weight, bias=None):
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert y.dtype == x.dtype and y.shape == exact.shape
    limit = bound(x, weight, bias, exact)
    assert bool(((y.double() - exact).abs() <= limit).all()), f"max excess {((y.double() - exact).abs() - limit).max()}"
    theirs = torch.matmul(x, weight.T) if bias is None else torch.matmul(x, weight.T) + bias
    slack = 2 * limit
    if bias is not None:  # torch rounds the product, then the sum: one more rounding, of the product's magnitude
        slack = slack + ULP[x.dtype] * (exact - bias.double()).abs()
    assert bool(((y.double() - theirs.double()).abs() <= slack).all())


KS = (512, 2048, 4096)


@pytest.mark.parametrize("n", [1, 256, 1025, 2048])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_gemv_matches_torch_matmul(rows, n):
    """Every M and N, with K in turn 512, 2048, 4096 (each (M, K) and (N, K) pair occurs), bf16: a tensor-core config
    with K in 4 slices (the last program sums the partials) and one without a split (FMAs for M <= 4)."""
    k = KS[([1, 3, 8, 16].index(rows) + [1, 256, 1025, 2048].index(n)) % 3]
    x, weight, _ = inputs(rows, n, k, torch.bfloat16, seed=rows * n + k)
    for config in (GemvConfig(128, min(512, k // 4), 4), GemvConfig(64, 1024, 1, dot=False)):
        assert_close_to_truth(gemv(x, weight, None, config), x, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gemv_dtypes_bias_uneven_k_and_leading_dims(dtype):
    """K not a multiple of the blocks or slices (masked tails), N not of the blocks, a bias, x [B, T, K] with a row
    stride (a column slice of a wider tensor): output [B, T, N] in x's dtype."""
    x, weight, bias = inputs(6, 200, 328, dtype, seed=5, bias=True)
    wide = torch.cat([x, torch.ones(6, 8, dtype=dtype)], dim=1)[:, :328].view(2, 3, 328)
    for config in (GemvConfig(64, 64, 4), GemvConfig(128, 32, 8), GemvConfig(256, 128, 1),
                   GemvConfig(32, 128, 3, dot=False)):
        y = gemv(wide, weight, bias, config)
        assert y.shape == (2, 3, 200)
        assert_close_to_truth(y.reshape(6, 200), x, weight, bias)
        assert_close_to_truth(gemv(x[:2], weight, bias, config), x[:2], weight, bias)  # FMAs: 2 rows


@pytest.mark.parametrize("rows", [1, 5])
def test_whole_slice_loads_each_program_slice_in_one_tile_and_stays_within_the_bound(rows, monkeypatch):
    """WHOLE_SLICE: a program's [BLOCK_N, K / SPLIT_K] slice as one tile (STEPS = 1) where it fits WHOLE_SLICE_BYTES
    (and, uneven K, its masked tail); a slice too large keeps its BLOCK_K tiles. Both within the bound."""
    launches = []
    kernel = gemv_triton._gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((meta["BLOCK_K"], meta["STEPS"]))
                return kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(gemv_triton, "_gemv_kernel", Spy())
    monkeypatch.setattr(gemv_triton, "WHOLE_SLICE", True)
    x, weight, _ = inputs(rows, 96, 1024, torch.bfloat16, seed=rows)
    assert_close_to_truth(gemv(x, weight, None, GemvConfig(32, 64, 4)), x, weight)  # 32 x 256 bf16: 16 KB
    assert_close_to_truth(gemv(x, weight, None, GemvConfig(32, 64, 1)), x, weight)  # 32 x 1024: 64 KB, too large
    x, weight, _ = inputs(rows, 40, 200, torch.bfloat16, seed=7)
    assert_close_to_truth(gemv(x, weight, None, GemvConfig(16, 32, 2)), x, weight)  # slices of 128, the last masked
    x, weight, _ = inputs(rows, 40, 328, torch.bfloat16, seed=8)
    assert_close_to_truth(gemv(x, weight, None, GemvConfig(16, 32, 4)), x, weight)  # slices of 96: not a power of 2
    assert launches == [(256, 1), (64, 16), (128, 1), (32, 3)]
    monkeypatch.setattr(gemv_triton, "WHOLE_SLICE", False)
    gemv(x, weight, None, GemvConfig(16, 64, 4))
    assert launches[-1] == (64, 2)


def normed_truth(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm (1 + w) of x's rows in float64 (what transformers' Qwen norms compute, before their rounding)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + norm_weight.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_norm_prologue_is_the_gemm_of_the_normed_rows(rows, dtype, monkeypatch):
    """`gemv(..., norm=RowNorm)` against the float64 GEMM of the float64 normed rows: the bound of the module
    docstring plus one rounding of each normed input (the kernel rounds them to x's dtype, as the norm's launch
    would; fp32: a few ulps of rsqrt and the sum's order). Tiles with several K steps and with one (whole slice),
    K in uneven slices, the sum of squares in several chunks (NORM_TILE small) and in one, FMAs and dots."""
    gen = torch.Generator().manual_seed(rows)
    for k, chunks in ((96, 4096), (328, 64)):
        monkeypatch.setattr(gemv_triton, "NORM_TILE", chunks)
        x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
        weight = (torch.randn(40, k, generator=gen) * k**-0.5).to(dtype)
        norm = gemv_triton.RowNorm((torch.randn(k, generator=gen) * 0.3).to(dtype), 1e-6)
        exact_in = normed_truth(x, norm.weight, norm.eps)
        exact = exact_in @ weight.double().T
        magnitude = exact_in.abs() @ weight.double().abs().T
        limit = (ULP[dtype] or 2.0**-20) * (exact.abs() + magnitude) + (k + 1) * 2.0**-24 * magnitude
        for whole in (True, False):
            monkeypatch.setattr(gemv_triton, "WHOLE_SLICE", whole)
            for config in (GemvConfig(16, 32, 2), GemvConfig(32, 64, 1, dot=False)):
                y = gemv(x, weight, None, config, norm)
                assert y.dtype == dtype and y.shape == (rows, 40)
                excess = (y.double() - exact).abs() - limit
                assert bool((excess <= 0).all()), f"k {k} whole {whole} {config}: max excess {excess.max()}"


@torch.no_grad()  # the kernel runs without grad
def test_linear_with_a_norm_takes_the_prologue_or_calls_the_module(monkeypatch):
    """`linear(x, W, norm=module)`: the prologue where the kernel takes the call (same output as the module's norm
    followed by the kernel, within one rounding of the normed input), else the module, then F.linear: the switch
    off, a norm weight of another dtype, or a shape the table does not name."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    calls = []
    module = Qwen3_5RMSNorm(64, eps=1e-6)
    module.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    module.register_forward_hook(lambda *args: calls.append(1))
    x, weight, _ = inputs(2, 48, 64, torch.float32, seed=11)
    expected = F.linear(module(x), weight)
    calls.clear()
    monkeypatch.setattr(gemv_triton, "_FORCE", GemvConfig(16, 32, 2))
    monkeypatch.setattr(gemv_triton, "NORM_PROLOGUE", True)
    torch.testing.assert_close(linear(x, weight, norm=module), expected, rtol=1e-5, atol=1e-5)
    assert calls == []  # in the prologue
    monkeypatch.setattr(gemv_triton, "NORM_PROLOGUE", False)
    torch.testing.assert_close(linear(x, weight, norm=module), expected, rtol=1e-5, atol=1e-5)
    assert calls == [1]
    monkeypatch.setattr(gemv_triton, "NORM_PROLOGUE", True)
    module.to(torch.float64)  # weight of another dtype: the module
    linear(x, weight, norm=module)
    assert calls == [1, 1]
    monkeypatch.setattr(gemv_triton, "_FORCE", None)
    module.to(torch.float32)
    torch.testing.assert_close(linear(x, weight, norm=module), expected)  # not in the table: module + F.linear
    assert calls == [1, 1, 1]


def test_split_k_is_deterministic_and_leaves_the_counters_zero():
    x, weight, _ = inputs(5, 96, 1024, torch.float32, seed=9)
    config = GemvConfig(16, 64, 16)
    first = gemv(x, weight, None, config)
    assert all(torch.equal(first, gemv(x, weight, None, config)) for _ in range(3))
    assert not gemv_triton._COUNTERS[torch.device("cpu")].any()


def test_fit_config_keeps_launches_within_the_problem():
    assert fit_config(GemvConfig(128, 512, 8), 1, 1, 40) == GemvConfig(16, 64, 1)  # tl.dot's 16, one K step
    assert fit_config(GemvConfig(16, 256, 32), 1, 256, 2048) == GemvConfig(16, 256, 8)  # one slice per step at most
    assert fit_config(GemvConfig(4, 512, 4, dot=False), 3, 256, 2048).dot is False
    assert fit_config(GemvConfig(4, 512, 4, dot=False), 5, 256, 2048) == GemvConfig(16, 512, 4)  # > 4 rows: dots
    assert fit_config(GemvConfig(16, 64, 4), 1, 16 * gemv_triton.COUNTERS + 1, 512).split_k == 1


def test_linear_takes_the_kernel_only_where_the_table_names_the_shape(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv_triton, "gemv", lambda *args: calls.append(args[1].shape) or F.linear(*args[:3]))
    x, weight, bias = inputs(3, 48, 64, torch.float32, seed=1, bias=True)
    with torch.no_grad():
        assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias)) and not calls  # empty table
        monkeypatch.setitem(gemv_triton.TABLE, (48, 64, 4), GemvConfig(16, 32))
        linear(x, weight, bias)
        assert calls == [(48, 64)]
        linear(x[:1], weight, bias)  # the M = 1 bucket is not listed
        linear(torch.randn(17, 64), weight)  # more rows than the kernel takes
        linear(x.double(), weight.double())  # float64
        with torch.enable_grad():
            linear(x, weight)
        monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensors without the interpreter
        linear(x, weight, bias)
    assert calls == [(48, 64)]
    assert [m_bucket(m) for m in range(1, 17)] == [1, 4, 4, 4, 8, 8, 8, 8] + [16] * 8


def test_pdl_shapes_are_taken_only_with_the_switch_on(monkeypatch):
    """PDL_TABLE's shapes run F.linear unless PDL_SHAPES is on; TABLE's entry wins where both name a shape."""
    assert all(key[2] in (1, 4, 8, 16) and key not in gemv_triton.TABLE for key in gemv_triton.PDL_TABLE)
    calls = []
    monkeypatch.setattr(gemv_triton, "gemv", lambda *args: calls.append(args[3]) or F.linear(*args[:3]))
    monkeypatch.setattr(gemv_triton, "PDL_TABLE", {(48, 64, 1): GemvConfig(16, 32), (48, 64, 4): GemvConfig(16, 64)})
    monkeypatch.setattr(gemv_triton, "PDL_SHAPES", False)
    x, weight, _ = inputs(3, 48, 64, torch.float32, seed=2)
    with torch.no_grad():
        linear(x[:1], weight)
        assert not calls
        monkeypatch.setattr(gemv_triton, "PDL_SHAPES", True)
        linear(x[:1], weight)
        assert calls == [GemvConfig(16, 32)]
        monkeypatch.setitem(gemv_triton.TABLE, (48, 64, 4), GemvConfig(32, 32))
        assert torch.allclose(linear(x, weight), F.linear(x, weight))
    assert calls == [GemvConfig(16, 32), GemvConfig(32, 32)]


def test_wide_pdl_shapes_are_taken_only_with_their_switch_on(monkeypatch):
    """PDL_WIDE_TABLE's shapes (M > 1) run F.linear unless PDL_WIDE is on; TABLE and PDL_TABLE win where they name
    the shape; each config fits its shape (the kernel's rules) and gives F.linear's result."""
    for (n, k, bucket), config in gemv_triton.PDL_WIDE_TABLE.items():
        assert bucket in (4, 8, 16) and (n, k, bucket) not in gemv_triton.TABLE
        assert n % config.block_n == 0 and k % (config.block_k * config.split_k) == 0 and config.dot
    calls = []
    monkeypatch.setattr(gemv_triton, "gemv", lambda *args: calls.append(args[3]) or F.linear(*args[:3]))
    monkeypatch.setattr(gemv_triton, "PDL_WIDE_TABLE", {(48, 64, 4): GemvConfig(16, 64), (48, 64, 1): GemvConfig(8, 8)})
    monkeypatch.setattr(gemv_triton, "PDL_TABLE", {(48, 64, 1): GemvConfig(16, 32)})
    x, weight, _ = inputs(3, 48, 64, torch.float32, seed=3)
    with torch.no_grad():
        monkeypatch.setattr(gemv_triton, "PDL_WIDE", False)
        linear(x, weight)
        assert not calls
        monkeypatch.setattr(gemv_triton, "PDL_WIDE", True)
        assert torch.allclose(linear(x, weight), F.linear(x, weight))
        linear(x[:1], weight)  # PDL_TABLE's M = 1 entry wins
        monkeypatch.setattr(gemv_triton, "PDL_SHAPES", False)
        linear(x[:1], weight)  # without PDL_SHAPES the wide table's own M = 1 entry
    assert calls == [GemvConfig(16, 64), GemvConfig(16, 32), GemvConfig(8, 8)]


def test_routed_linears_are_installed_inert_outside_the_flag_and_released(monkeypatch):
    model = make_target("qwen3_5_moe", seed=2, dtype=torch.float32)
    linears = patches.decoder_linears(model)
    assert linears and model.lm_head not in linears
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m in linears}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj", "gate_proj", "down_proj",
            "shared_expert_gate"} <= names
    own = linears[0]
    own.forward = lambda x: x  # someone else's forward: left alone
    patches.prepare_linears(linears)
    assert all(_linear.is_routed(m) for m in linears[1:]) and not _linear.is_routed(own)
    assert not hooked(linears[1:])  # ours is not a change the fused paths must respect
    calls = []
    monkeypatch.setattr(_linear, "linear", lambda *args: calls.append(1) or F.linear(*args))
    x = torch.randn(1, 2, linears[1].in_features)
    with torch.no_grad():
        assert torch.equal(linears[1](x), F.linear(x, linears[1].weight, linears[1].bias)) and not calls
        with patches.fused_kernels():
            linears[1](x)
    assert calls == [1]
    for twin in (copy.deepcopy(linears[1]), pickle.loads(pickle.dumps(linears[1]))):  # bound to the twin
        assert _linear.is_routed(twin) and twin.forward.args[0] is twin
    patches.release_linears(linears)
    assert not any(_linear.is_routed(m) for m in linears) and "forward" in own.__dict__


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_resident_generate_with_the_kernel_on_every_projection_equals_ar(name, monkeypatch):
    from test_exactness import run

    target = make_target(name, seed=8, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ar = target.generate(prompt, do_sample=False, max_new_tokens=6)
    drafter = make_drafter(target, 4, ar, error_rate=0.3).to(torch.float32)
    seen, normed = set(), set()  # weights the kernel read, by address; those it read with the norm prologue
    launch = gemv_triton.gemv

    def counted(x, weight, bias, config, norm=None):
        seen.add(weight.data_ptr())
        if norm is not None:
            normed.add(weight.data_ptr())
        return launch(x, weight, bias, config, norm)

    monkeypatch.setattr(gemv_triton, "gemv", counted)
    monkeypatch.setattr(gemv_triton, "_FORCE", GemvConfig(16, 16, 2))  # every shape, K in two slices
    monkeypatch.setattr(_moe, "_ON_CPU", True)  # the fused router and shared expert on CPU tensors too
    monkeypatch.setattr(_decoder, "_ON_CPU", True)  # and the fused decoder layer, which leaves its input norm
    monkeypatch.setattr(gemv_triton, "NORM_PROLOGUE", True)  # (A/B switch, off by default)
    out = run(target, prompt, drafter, "dflash", 6, hybridspec_config=hybridspec_hf.HybridSpecConfig(cuda_graphs="on"))
    assert torch.equal(out, ar)
    routers = {block.gate.weight.data_ptr() for block in patches.moe_blocks(target)}  # the fused route reads them
    assert seen >= projection_weights(target) - routers
    # the decoder's input norms in the prologue of the GDN copies' GEMMs (Qwen3-Next's GDN projections are modules;
    # the attention's q|k|v copy takes it where the fused attention layer runs: CUDA, tests/test_resident_cuda.py)
    from hybridspec_hf.patches import _gdn

    copies = {layer.__dict__[_gdn._COPY].weight.data_ptr() for layer in patches.gdn_layers(target)
              if _gdn._COPY in layer.__dict__}
    assert normed == copies and bool(copies) == (name == "qwen3_5_moe")
    hybridspec_hf.release_graphs(target)
    assert not any(_linear.is_routed(m) for m in patches.decoder_linears(target))


def projection_weights(model) -> set[int]:
    """Addresses of every weight a resident forward multiplies by through this kernel: the decoder layers' Linears,
    except those read through a concatenated copy (the Qwen3.5 GDN input projections, the attention's q, k and v, the
    shared expert's gate, up and gate logit), the copies themselves and the routers; with the one-pass MoE block
    (`_moe.SHARED_EXPERT_SLOT`, every resident call here has <= 16 tokens) the experts kernels read the shared
    expert's copy and down weight."""
    from hybridspec_hf.patches import _attention, _gdn

    weights = {m.weight.data_ptr() for m in patches.decoder_linears(model)}
    for layer in patches.attention_layers(model):
        if _attention._QKV in layer.__dict__:
            weights -= {getattr(layer, name).weight.data_ptr() for name in _attention.QKV_PROJECTIONS}
            weights.add(layer.__dict__[_attention._QKV].weight.data_ptr())
    for layer in patches.gdn_layers(model):
        if _gdn._COPY in layer.__dict__:
            weights -= {getattr(layer, name).weight.data_ptr() for name in _gdn.SEPARATE_PROJECTIONS}
            weights.add(layer.__dict__[_gdn._COPY].weight.data_ptr())
    for block in patches.moe_blocks(model):
        weights -= {m.weight.data_ptr() for m in (block.shared_expert.gate_proj, block.shared_expert.up_proj,
                                                  block.shared_expert_gate)}
        weights |= {block.__dict__[_moe._CACHE].weight.data_ptr(), block.gate.weight.data_ptr()}
        if _moe.SHARED_EXPERT_SLOT:
            weights -= {block.__dict__[_moe._CACHE].weight.data_ptr(), block.shared_expert.down_proj.weight.data_ptr()}
    return weights


def test_benchmark_smoke_run_writes_results(tmp_path, benchmarks, cpu_only):
    benchmark = importlib.import_module("gemv")
    report = benchmark.main(["--smoke", "--replays", "1", "--name", str(tmp_path / "gemv")])
    cells = [cell for shape in report["shapes"] for cell in shape["cells"]]
    assert cells and all(row["ok"] for cell in cells for row in cell["configs"])
    assert (tmp_path / "gemv.md").exists() and "TABLE" in (tmp_path / "gemv.md").read_text()
    sys.modules.pop("gemv", None)
