"""The drafter's int8 LM head (DFlashConfig.head_quantization="int8"): per-row quantization (`quantize_rows`), the
int8 GEMV (`gemv(..., scale=)`, under the Triton interpreter) against `linear_int8_reference` and float64 math, the
dispatch (`linear_int8`), the config field, `DFlashDrafter.compute_logits` / `quantized_head` on the shipped tiny
pair, and greedy generate() with the int8 head token-identical to AR.

Kernel tolerance, elementwise, of the int8 GEMV y against r = linear_int8_reference (or the float64 product of the
dequantized weight): both sum the same exact products in fp32 in different orders, each bounded by
(K + 1) · 2^-24 · (|x| @ |q|ᵀ) · scale, plus the fp32 product by the scale, plus one rounding of the output to x's
dtype: the interpreter truncates fp32 -> bf16/fp16 where torch (and a GPU) rounds to nearest, so the two may differ
by a full ulp of the value (ULP: 2^-7 bf16, 2^-10 fp16, 0 fp32), counted twice for safety.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import hybridspec_hf  # noqa: E402  (registers the generation strategies)
from hybridspec_hf import DFlashConfig, HybridSpecConfig  # noqa: E402
from hybridspec_hf.drafter import modeling_dflash  # noqa: E402
from hybridspec_hf.drafter.configuration_dflash import QUANTIZATIONS  # noqa: E402
from hybridspec_hf.kernels import gemv_triton  # noqa: E402
from hybridspec_hf.kernels.gemv_triton import (  # noqa: E402
    INT8_CONFIG,
    MAX_ROWS,
    GemvConfig,
    QuantizedRows,
    RowNorm,
    gemv,
    int8_config,
    linear_int8,
    linear_int8_reference,
    quantize_rows,
)
from hybridspec_hf.tiny_pair import heldout_prompts, load_tiny_pair  # noqa: E402

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 0.0}


@pytest.fixture
def interpreter():
    """TRITON_INTERPRET=1 for one test, as conftest's module-scoped `triton_interpreter` does it (the kernels bind to
    triton.jit at launch; jit'd helpers called from an interpreted kernel run as interpreted device functions).
    Function-scoped here: the tiny pair's generate() tests in this module must run without it (interpreting every
    kernel of a tiny-pair generate() takes minutes)."""
    from conftest import interpreted

    with interpreted():
        yield


@pytest.fixture
def no_interpreter(monkeypatch):
    """The CPU as it is (no TRITON_INTERPRET): Triton kernels do not run on CPU tensors."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def random_weight(n: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """[N, K] with row magnitudes spread over ~e^±2 (so a scale read from the wrong row shows)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, k, generator=gen) * k**-0.5
    return (rows * torch.randn(n, 1, generator=gen).mul(0.7).exp()).to(dtype)


def random_x(rows: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dequantized(quantized: QuantizedRows) -> torch.Tensor:
    return quantized.weight.double() * quantized.scale.double()[:, None]


def magnitude(x: torch.Tensor, quantized: QuantizedRows) -> torch.Tensor:
    """(|x| @ |q|ᵀ) · scale in float64: what the fp32 sums' rounding errors are relative to."""
    return (x.double().abs() @ quantized.weight.double().abs().T) * quantized.scale.double()


def assert_within_bound(y: torch.Tensor, r: torch.Tensor, x: torch.Tensor, quantized: QuantizedRows) -> None:
    """|y - r| within the module docstring's bound, elementwise (r in x's dtype or float64)."""
    assert y.dtype == x.dtype and y.shape == r.shape
    k = x.shape[-1]
    ref = r.double()
    limit = (2 * ULP[x.dtype] + 2.0**-22) * ref.abs() + 2 * (k + 2) * 2.0**-24 * magnitude(x, quantized) + 2.0**-30
    excess = (y.double() - ref).abs() - limit
    assert bool((excess <= 0).all()), f"max excess {excess.max():.3g} (max |y - r| {(y.double() - ref).abs().max():.3g})"


# ------------------------------------------------------------------------------------------------- quantize_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rows_error_is_at_most_half_a_scale_step(dtype):
    weight = random_weight(37, 300, dtype, seed=3)
    before = weight.clone()
    quantized = quantize_rows(weight)
    q, scale = quantized.weight, quantized.scale
    assert isinstance(quantized, QuantizedRows) and quantized.shape == weight.shape
    assert q.dtype == torch.int8 and q.shape == (37, 300) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    assert torch.equal(weight, before)  # not modified
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127  # -128 never appears
    expected_scale = weight.float().abs().amax(dim=1) / 127.0
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    # every row reaches ±127 at its largest element
    assert torch.equal(q.abs().amax(dim=1), torch.full((37,), 127, dtype=torch.int8))
    error = (weight.double() - dequantized(quantized)).abs()
    half_step = scale.double()[:, None] / 2
    assert bool((error <= half_step * (1 + 1e-5) + 1e-12).all()), f"max error / step {(error / (2 * half_step)).max()}"
    # and it is round to nearest, not truncation: some elements are off by more than a quarter step
    assert bool((error > half_step / 2).any())


def test_quantize_rows_all_zero_row_has_scale_one_and_zero_codes():
    weight = random_weight(5, 64, seed=4)
    weight[2] = 0.0
    quantized = quantize_rows(weight)
    assert float(quantized.scale[2]) == 1.0
    assert not bool(quantized.weight[2].any())
    others = [0, 1, 3, 4]
    assert bool((quantized.scale[others] != 1.0).all()) and bool(quantized.weight[others].any(dim=1).all())
    assert torch.isfinite(quantized.scale).all()
    # what a GEMV reads of the copy: 5 x 64 int8 codes and 5 float32 scales
    assert quantized.nbytes == quantized.weight.nbytes + quantized.scale.nbytes == 5 * 64 + 5 * 4


def test_quantize_rows_in_chunks_of_rows_is_the_same():
    """`chunk_rows` (a large head made a slice of rows at a time): the same codes and scales, chunks not dividing N."""
    weight = random_weight(50, 40, seed=10)
    weight[17] = 0.0
    whole = quantize_rows(weight)
    for chunk_rows in (1, 7, 50, 64):
        chunked = quantize_rows(weight, chunk_rows=chunk_rows)
        assert torch.equal(chunked.weight, whole.weight) and torch.equal(chunked.scale, whole.scale), chunk_rows


def test_quantize_rows_takes_a_parameter_and_keeps_no_graph():
    weight = torch.nn.Parameter(random_weight(8, 32, seed=5))
    quantized = quantize_rows(weight)
    assert not quantized.weight.requires_grad and not quantized.scale.requires_grad
    assert torch.equal(quantized.weight, quantize_rows(weight.detach().clone()).weight)


@pytest.mark.parametrize("bad", [
    torch.randn(16),
    torch.randn(2, 4, 8),
    torch.randint(-5, 5, (4, 8)),
    torch.randint(-5, 5, (4, 8), dtype=torch.int8),
])
def test_quantize_rows_rejects_non_2d_and_integer_weights(bad):
    with pytest.raises(ValueError, match="quantize_rows"):
        quantize_rows(bad)


# --------------------------------------------------------------------------------------- reference and float64


def test_reference_matches_float64_dequantized_math():
    quantized = quantize_rows(random_weight(300, 520, seed=6))
    x = random_x(7, 520, seed=7)
    exact = x.double() @ dequantized(quantized).T
    reference = linear_int8_reference(x, quantized)
    assert reference.dtype == torch.float32 and reference.shape == (7, 300)
    assert_within_bound(reference, exact, x, quantized)
    # rows of q widened in chunks: the same values, within the bound too, for chunks that do not divide N
    chunked = linear_int8_reference(x, quantized, chunk_rows=7)
    assert chunked.shape == (7, 300)
    assert_within_bound(chunked, exact, x, quantized)
    # float64 x: computed in float64
    wide = linear_int8_reference(x.double(), quantized, chunk_rows=64)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, exact, rtol=1e-12, atol=1e-12)
    # and it is the quantized product, not the original weight's: off by at most Σ|x| · scale / 2
    original = x.double() @ random_weight(300, 520, seed=6).double().T
    assert not torch.allclose(wide, original, rtol=1e-6, atol=0)
    allowed = x.double().abs().sum(-1, keepdim=True) * quantized.scale.double() / 2
    assert bool(((wide - original).abs() <= allowed * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_returns_x_dtype_and_leading_dims(dtype):
    quantized = quantize_rows(random_weight(40, 24, seed=8))
    x = random_x(6, 24, seed=9).to(dtype).view(2, 3, 24)
    y = linear_int8_reference(x, quantized)
    assert y.dtype == dtype and y.shape == (2, 3, 40)
    exact = x.double() @ dequantized(quantized).T
    torch.testing.assert_close(y.double(), exact, rtol=ULP[dtype], atol=1e-6)


# ------------------------------------------------------------------------------------------- the Triton kernel


SHAPES = [(1, 200, 328), (3, 1025, 512), (15, 96, 200), (16, 130, 1000)]  # (rows, N, K); N, K not block multiples
CONFIGS = [GemvConfig(64, 128, 1), GemvConfig(32, 64, 2), INT8_CONFIG]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k", SHAPES)
def test_int8_gemv_matches_reference_under_the_interpreter(rows, n, k, dtype, interpreter):
    weight = random_weight(n, k, seed=rows * n + k)
    quantized = quantize_rows(weight)
    x = random_x(rows, k, dtype, seed=rows + k)
    reference = linear_int8_reference(x, quantized)
    exact = x.double() @ dequantized(quantized).T
    configs = CONFIGS + ([GemvConfig(32, 128, 1, dot=False), GemvConfig(16, 64, 2, dot=False)] if rows <= 4 else [])
    for config in configs:
        y = gemv(x, quantized.weight, None, config, scale=quantized.scale)
        assert y.shape == (rows, n) and y.dtype == dtype, config
        assert_within_bound(y, reference, x, quantized)
        assert_within_bound(y, exact, x, quantized)
    # the scale matters: the same kernel on the unscaled codes (as float) is another product
    assert not torch.allclose(y.double(), x.double() @ quantized.weight.double().T, rtol=1e-2)


def test_int8_gemv_bias_leading_dims_and_strided_rows(interpreter):
    """x [B, T, K] as a column slice of a wider tensor (a row stride), a bias in x's dtype: [B, T, N]."""
    quantized = quantize_rows(random_weight(70, 136, seed=11))
    x = random_x(6, 136, torch.bfloat16, seed=12)
    wide = torch.cat([x, torch.ones(6, 8, dtype=torch.bfloat16)], dim=1)[:, :136].view(2, 3, 136)
    bias = torch.randn(70, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    for config in (GemvConfig(32, 64, 2), INT8_CONFIG):
        y = gemv(wide, quantized.weight, bias, config, scale=quantized.scale)
        assert y.shape == (2, 3, 70) and y.dtype == torch.bfloat16
        exact = x.double() @ dequantized(quantized).T + bias.double()
        flat = y.reshape(6, 70)
        limit = 2 * ULP[torch.bfloat16] * exact.abs() + 2 * 138 * 2.0**-24 * (magnitude(x, quantized) + bias.double().abs())
        assert bool(((flat.double() - exact).abs() <= limit).all())


@pytest.mark.parametrize("whole_slice", [True, False])
def test_int8_gemv_whole_slice_on_and_off(whole_slice, interpreter, monkeypatch):
    """int8 weights are 1 byte: more slices fit WHOLE_SLICE_BYTES in one tile than for bf16; both ways agree."""
    monkeypatch.setattr(gemv_triton, "WHOLE_SLICE", whole_slice)
    quantized = quantize_rows(random_weight(96, 1024, seed=14))
    x = random_x(5, 1024, torch.float16, seed=15)
    reference = linear_int8_reference(x, quantized)
    for config in (GemvConfig(32, 64, 4), GemvConfig(32, 64, 1)):
        assert_within_bound(gemv(x, quantized.weight, None, config, scale=quantized.scale), reference, x, quantized)


def test_int8_gemv_is_deterministic(interpreter):
    quantized = quantize_rows(random_weight(300, 256, seed=16))
    x = random_x(4, 256, seed=17)
    config = GemvConfig(32, 64, 2)
    first = gemv(x, quantized.weight, None, config, scale=quantized.scale)
    assert torch.equal(first, gemv(x, quantized.weight, None, config, scale=quantized.scale))


def gemv_error_cases():
    n, k = 24, 32
    quantized = quantize_rows(random_weight(n, k, seed=18))
    x = random_x(2, k)
    float_weight = random_weight(n, k, seed=19)
    norm = RowNorm(torch.ones(k), 1e-6)
    return {
        "scale of the wrong length": (x, quantized.weight, quantized.scale[:-1], None),
        "scale [N, 1]": (x, quantized.weight, quantized.scale[:, None], None),
        "float16 scale": (x, quantized.weight, quantized.scale.half(), None),
        "float64 scale": (x, quantized.weight, quantized.scale.double(), None),
        "int8 weight without a scale": (x, quantized.weight, None, None),
        "a scale with a float weight": (x, float_weight, quantized.scale, None),
        "a scale with a norm": (x, quantized.weight, quantized.scale, norm),
        "int8 x": (x.to(torch.int8), quantized.weight, quantized.scale, None),
        "K mismatch": (random_x(2, k + 1), quantized.weight, quantized.scale, None),
    }


@pytest.mark.parametrize("case", list(gemv_error_cases()))
def test_gemv_rejects_bad_int8_combinations(case):
    x, weight, scale, norm = gemv_error_cases()[case]
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, weight, None, GemvConfig(32, 32, 1), norm=norm, scale=scale)


def test_gemv_valid_int8_call_of_the_error_cases_runs(interpreter):
    """The error cases' valid neighbour runs, so those raise for their one bad argument."""
    quantized = quantize_rows(random_weight(24, 32, seed=18))
    x = random_x(2, 32)
    y = gemv(x, quantized.weight, None, GemvConfig(32, 32, 1), scale=quantized.scale)
    assert_within_bound(y, linear_int8_reference(x, quantized), x, quantized)


# ---------------------------------------------------------------------------------------------- linear_int8


@pytest.fixture
def gemv_calls(monkeypatch):
    """Each gemv launch linear_int8 makes: (rows, config, scale given)."""
    calls = []
    launch = gemv_triton.gemv

    def counted(x, weight, bias, config, norm=None, scale=None):
        calls.append((x.numel() // x.shape[-1], config, scale is not None))
        return launch(x, weight, bias, config, norm, scale)

    monkeypatch.setattr(gemv_triton, "gemv", counted)
    return calls


def test_linear_int8_runs_the_kernel_up_to_max_rows_and_the_reference_past_it(interpreter, gemv_calls):
    quantized = quantize_rows(random_weight(200, 96, seed=20))
    x = random_x(MAX_ROWS + 1, 96, seed=21)
    with torch.no_grad():
        past = linear_int8(x, quantized)  # 17 rows: the reference, bit for bit
        assert gemv_calls == []
        assert torch.equal(past, linear_int8_reference(x, quantized))
        at = linear_int8(x[:MAX_ROWS].view(2, 8, 96), quantized)  # 16 rows in [B, T, K]: the kernel
    assert gemv_calls == [(MAX_ROWS, int8_config(200, 96), True)]
    assert at.shape == (2, 8, 200)
    assert_within_bound(at.reshape(MAX_ROWS, 200), linear_int8_reference(x[:MAX_ROWS], quantized), x[:MAX_ROWS], quantized)


def test_linear_int8_with_gradients_enabled_runs_the_reference(interpreter, gemv_calls):
    quantized = quantize_rows(random_weight(64, 48, seed=22))
    x = random_x(3, 48, seed=23)
    with torch.enable_grad():
        y = linear_int8(x, quantized)
    assert gemv_calls == [] and torch.equal(y, linear_int8_reference(x, quantized))


def test_linear_int8_on_cpu_without_the_interpreter_is_the_reference(no_interpreter, gemv_calls):
    quantized = quantize_rows(random_weight(64, 48, seed=24))
    for dtype in (torch.float32, torch.bfloat16):
        x = random_x(4, 48, dtype, seed=25)
        with torch.no_grad():
            y = linear_int8(x, quantized)
        assert y.dtype == dtype and torch.equal(y, linear_int8_reference(x, quantized))
    assert gemv_calls == []


def test_linear_int8_rejects_a_feature_mismatch():
    quantized = quantize_rows(random_weight(16, 32, seed=26))
    with pytest.raises(ValueError, match="linear_int8"):
        linear_int8(random_x(2, 31), quantized)


# ------------------------------------------------------------------------------------------------ DFlashConfig


def test_config_accepts_none_and_int8_only():
    assert QUANTIZATIONS == (None, "int8")
    assert DFlashConfig().head_quantization is None
    assert DFlashConfig(head_quantization="int8").head_quantization == "int8"
    for bad in ("int4", "INT8", "fp8", 8):
        with pytest.raises(ValueError, match="head_quantization"):
            DFlashConfig(head_quantization=bad)


@pytest.mark.parametrize("value", ["int8", None])
def test_config_round_trips_head_quantization(value, tmp_path):
    config = DFlashConfig(head_quantization=value, block_size=8)
    config.save_pretrained(tmp_path)
    loaded = DFlashConfig.from_pretrained(tmp_path)
    assert loaded.head_quantization == value and loaded.block_size == 8
    assert config.to_dict()["head_quantization"] == value


# ------------------------------------------------------------------------------------ the drafter, tiny pair


@pytest.fixture(scope="module")
def pair():
    """The shipped tiny pair (load_tiny_pair builds fresh models each call: nothing shared with other modules)."""
    return load_tiny_pair()


@pytest.fixture
def drafter_with(pair):
    """Set the drafter's head_quantization for one test; None again and no int8 copy kept afterwards."""
    _, drafter, _ = pair

    def set_to(value):
        drafter.config.head_quantization = value
        return drafter

    yield set_to
    drafter.config.head_quantization = None
    drafter.__dict__.pop("_head_int8", None)


def hidden_states(drafter, batch: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, drafter.config.hidden_size, generator=gen)


def test_int8_head_logits_are_the_quantized_product_and_near_the_plain_heads(pair, drafter_with, no_interpreter):
    target, _, _ = pair
    drafter = drafter_with("int8")
    head = drafter._require_target()[1]
    assert head is target.lm_head
    keys = set(drafter.state_dict())
    h = hidden_states(drafter, 2, 9, seed=30)
    with torch.no_grad():
        logits = drafter.compute_logits(h)
        quantized = drafter.quantized_head()
        plain = F.linear(h, head.weight)
    assert isinstance(quantized, QuantizedRows) and drafter.quantized_head() is quantized  # made once, kept
    assert quantized.weight.shape == head.weight.shape and quantized.weight.dtype == torch.int8
    torch.testing.assert_close(quantized.scale, head.weight.detach().float().abs().amax(dim=1) / 127, rtol=1e-6, atol=0)
    assert logits.shape == (2, 9, head.weight.shape[0]) and logits.dtype == torch.float32
    assert torch.equal(logits, linear_int8_reference(h, quantized))
    assert not torch.equal(logits, plain)
    # |h·W - h·(q·s)| <= Σ|h| · s / 2 per logit, and small against the logits' range
    allowed = h.abs().sum(-1, keepdim=True).double() * quantized.scale.double() / 2 * (1 + 1e-4) + 1e-5
    assert bool(((logits.double() - plain.double()).abs() <= allowed).all())
    assert float((logits - plain).abs().max()) < 2e-2 * float(plain.abs().max())
    assert (logits.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9
    assert set(drafter.state_dict()) == keys  # the copy is not part of the drafter's weights


def test_int8_head_runs_the_triton_kernel_for_a_block_under_the_interpreter(pair, drafter_with, interpreter, gemv_calls):
    """A drafted block (16 positions <= MAX_ROWS): compute_logits reaches the int8 GEMV."""
    drafter = drafter_with("int8")
    h = hidden_states(drafter, 1, drafter.config.block_size, seed=31)
    with torch.no_grad():
        logits = drafter.compute_logits(h)
        quantized = drafter.quantized_head()
    assert gemv_calls == [(drafter.config.block_size, int8_config(*quantized.weight.shape), True)]
    reference = linear_int8_reference(h, quantized)
    assert logits.shape == reference.shape and logits.dtype == torch.float32
    assert_within_bound(logits.view(-1, reference.shape[-1]), reference.view(-1, reference.shape[-1]),
                        h.view(-1, h.shape[-1]), quantized)


def test_no_head_quantization_is_the_plain_head(pair, drafter_with, no_interpreter, monkeypatch):
    drafter = drafter_with(None)
    head = drafter._require_target()[1]
    monkeypatch.setattr(modeling_dflash, "linear_int8", lambda *a: pytest.fail("int8 head used without the option"))
    h = hidden_states(drafter, 1, 5, seed=32)
    with torch.no_grad():
        logits = drafter.compute_logits(h)
        assert drafter.quantized_head() is None
    assert torch.equal(logits, F.linear(h, head.weight))
    assert drafter.__dict__.get("_head_int8") is None


def test_the_int8_copy_stays_until_released_and_is_made_again_after(pair, drafter_with, no_interpreter):
    """With the option off the drafter multiplies by the head again but keeps its copy (a captured draft graph may
    still read it); `release_quantized_head` drops it, and the next use with the option on makes it again."""
    drafter = drafter_with("int8")
    h = hidden_states(drafter, 1, 5, seed=33)
    with torch.no_grad():
        quantized = drafter.compute_logits(h)
        copy = drafter.__dict__["_head_int8"][1]
        drafter.config.head_quantization = None
        plain = drafter.compute_logits(h)
        assert drafter.__dict__["_head_int8"][1] is copy
        drafter.release_quantized_head()
        assert "_head_int8" not in drafter.__dict__
        drafter.config.head_quantization = "int8"
        again = drafter.compute_logits(h)
    assert torch.equal(plain, F.linear(h, drafter._require_target()[1].weight))
    assert torch.equal(again, quantized) and drafter.__dict__["_head_int8"][1] is not copy


def test_int8_head_with_gradients_uses_the_plain_head(pair, drafter_with, no_interpreter):
    drafter = drafter_with("int8")
    head = drafter._require_target()[1]
    h = hidden_states(drafter, 1, 5, seed=33).requires_grad_(True)
    with torch.enable_grad():
        logits = drafter.compute_logits(h)
        assert logits.requires_grad
        logits.logsumexp(-1).sum().backward()
    with torch.no_grad():
        plain = F.linear(h, head.weight)
        drafting = drafter.compute_logits(h)
    assert torch.equal(logits.detach(), plain)
    assert h.grad is not None and bool(h.grad.abs().sum() > 0) and head.weight.grad is None
    assert not torch.equal(drafting, plain)  # without gradients the same call takes the int8 copy


def test_int8_copy_is_remade_when_the_head_weight_changes(pair, drafter_with, no_interpreter):
    drafter = drafter_with("int8")
    head = drafter._require_target()[1]
    h = hidden_states(drafter, 1, 4, seed=34)
    original = head.weight.detach().clone()
    first = drafter.quantized_head()
    first_scale, first_weight = first.scale.clone(), first.weight.clone()
    tensors = (first.weight.data_ptr(), first.scale.data_ptr())  # a captured draft graph reads them by address
    with torch.no_grad():
        before = drafter.compute_logits(h)
    try:
        with torch.no_grad():
            head.weight.mul_(1.5)  # in place: same data_ptr, a new version
        second = drafter.quantized_head()
        assert (second.weight.data_ptr(), second.scale.data_ptr()) == tensors, "made again into other tensors"
        torch.testing.assert_close(second.scale, first_scale * 1.5, rtol=1e-6, atol=0)
        with torch.no_grad():
            after = drafter.compute_logits(h)
        assert torch.equal(after, linear_int8_reference(h, second))
        scaled = F.linear(h.double(), original.double() * 1.5)  # the new head's logits, within half a step a row
        allowed = h.abs().sum(-1, keepdim=True).double() * second.scale.double() / 2 * (1 + 1e-4) + 1e-5
        assert bool(((after.double() - scaled).abs() <= allowed).all())
        assert not torch.allclose(after, before, rtol=0.2, atol=0)

        replacement = torch.nn.Parameter(original.flip(0).clone(), requires_grad=False)  # another tensor
        with torch.no_grad():  # at the same in-place version: only its address tells it apart
            while replacement._version < head.weight._version:
                replacement.add_(0.0)
        assert replacement._version == head.weight._version
        kept = head.weight
        head.weight = replacement
        try:
            third = drafter.quantized_head()
            assert (third.weight.data_ptr(), third.scale.data_ptr()) == tensors
            assert torch.equal(third.scale, first_scale.flip(0)) and torch.equal(third.weight, first_weight.flip(0))
        finally:
            head.weight = kept
    finally:
        with torch.no_grad():
            head.weight.copy_(original)
    restored = drafter.quantized_head()
    assert torch.equal(restored.scale, first_scale) and torch.equal(restored.weight, first_weight)
    with torch.no_grad():
        assert torch.equal(drafter.compute_logits(h), before)


# --------------------------------------------------------------------------------------- generate(), exactness


@pytest.fixture(scope="module")
def prompts(pair):
    _, _, tokenizer = pair
    return [tokenizer(text, return_tensors="pt").input_ids[:, :64] for text in heldout_prompts(2)]


@pytest.fixture(scope="module")
def latency_model(pair):
    """A quick latency calibration of the pair with the int8 head, passed to "hybridspec" directly (no cache)."""
    from hybridspec_hf.generation.calibration import calibrate_latency

    target, drafter, _ = pair
    drafter.config.head_quantization = "int8"
    try:
        return calibrate_latency(target, drafter, context_lens=(64,), repeats=1, progress=False)
    finally:
        drafter.config.head_quantization = None
        drafter.__dict__.pop("_head_int8", None)


@pytest.fixture
def head_calls(monkeypatch):
    """How many times compute_logits multiplied by the int8 copy."""
    calls = []
    launch = modeling_dflash.linear_int8

    def counted(x, quantized):
        calls.append(x.shape)
        return launch(x, quantized)

    monkeypatch.setattr(modeling_dflash, "linear_int8", counted)
    return calls


NEW_TOKENS = 24


@pytest.mark.parametrize("strategy,settings", [
    ("dflash", {}),
    ("dflash", {"cuda_graphs": "on"}),  # on CPU: the GPU-resident rounds' uncaptured twin
    ("hybridspec", {}),
])
def test_greedy_generate_with_the_int8_head_equals_ar(strategy, settings, pair, prompts, drafter_with, head_calls,
                                                      no_interpreter, request):
    target, _, _ = pair
    if strategy == "hybridspec":
        settings = {**settings, "latency_model": request.getfixturevalue("latency_model")}
    drafter = drafter_with("int8")
    accepted = 0
    for ids in prompts:
        with torch.no_grad():
            ar = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, generation_strategy="ar")
        calls_before = len(head_calls)
        out = target.generate(ids, assistant_model=drafter, generation_strategy=strategy, do_sample=False,
                              max_new_tokens=NEW_TOKENS, hybridspec_config=HybridSpecConfig(**settings))
        assert out.shape == ar.shape == (1, ids.shape[1] + NEW_TOKENS)
        assert torch.equal(out, ar), f"{strategy} {settings}: diverged from AR"
        rounds = hybridspec_hf.get_telemetry(target).rounds
        drafted = sum(r.drafted for r in rounds)
        assert len(head_calls) - calls_before >= drafted > 0  # every drafting round drafted through the int8 copy
        accepted += sum(r.accepted for r in rounds)
    assert drafter.__dict__.get("_head_int8") is not None
    assert accepted > 0, "the int8 head's drafts should get some tokens accepted"


def test_resident_rounds_hold_their_copy_and_its_values_follow_the_head(pair, prompts, drafter_with,
                                                                        no_interpreter):
    """The resident rounds (their CPU twin here) take the copy before their capture and hold it: the drafter may drop
    its own reference, a later call with the head changed in place refreshes the held tensors in place (a captured
    draft graph reads them by address), and release_graphs drops the drafter's reference with the rounds'."""
    target, _, _ = pair
    drafter = drafter_with("int8")
    kwargs = dict(do_sample=False, max_new_tokens=8, assistant_model=drafter, generation_strategy="dflash",
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    head = drafter._require_target()[1]
    original = head.weight.detach().clone()
    hybridspec_hf.release_graphs(target)  # rounds of the tests before would be reused, with the copy of their time
    try:
        target.generate(prompts[0], **kwargs)
        rounds = target.__dict__["_hybridspec_resident"]
        held = rounds.head_copy
        assert held is drafter.__dict__["_head_int8"][1]
        drafter.release_quantized_head()
        assert rounds.head_copy is held
        with torch.no_grad():
            head.weight.mul_(0.5)
        target.generate(prompts[0], **kwargs)
        assert target.__dict__["_hybridspec_resident"] is rounds and rounds.head_copy is held
        fresh = quantize_rows(head.weight)
        assert torch.equal(held.weight, fresh.weight) and torch.equal(held.scale, fresh.scale)
        assert drafter.__dict__["_head_int8"][1] is not held  # the drafter's new copy, its values copied in
        hybridspec_hf.release_graphs(target)
        assert "_head_int8" not in drafter.__dict__ and rounds.head_copy is None
    finally:
        hybridspec_hf.release_graphs(target)
        with torch.no_grad():
            head.weight.copy_(original)


def test_int8_config_keeps_the_heads_tile_and_splits_narrow_projections():
    """int8_config: INT8_CONFIG for an LM head (and its 64-row blocks, K split toward 512 programs, for any N of >=
    128 of them: the drafter's gate|up in 2 slices); the drafter layers' narrower projections get 32-row blocks and
    K split so that about 256 programs run, never a slice under 512."""
    assert int8_config(248_320, 2048) == INT8_CONFIG and int8_config(32_768, 2048) == INT8_CONFIG
    gate_up = int8_config(12_288, 2048)
    assert (gate_up.block_n, gate_up.block_k, gate_up.split_k, gate_up.num_warps, gate_up.num_stages) == (
        INT8_CONFIG.block_n, INT8_CONFIG.block_k, 2, INT8_CONFIG.num_warps, INT8_CONFIG.num_stages)
    assert int8_config(8_192, 2048).split_k == 4 and int8_config(8_192, 1024).split_k == 2  # slices of >= 512
    for n, k, split in ((2048, 4096, 4), (2048, 6144, 4), (5120, 2048, 1), (256, 2048, 4), (64, 512, 1)):
        config = int8_config(n, k)
        assert (config.block_n, config.block_k, config.split_k) == (32, 128, split), (n, k, config)
