"""Triton GDN verify/commit and the default verifier against gdn_torch and the float64 recurrence (CPU).

The kernels run under the Triton interpreter: TRITON_INTERPRET=1 is set for this module only (conftest's
`triton_interpreter`; import order in the suite does not matter) and restored afterwards, so other tests' `*_auto`
calls on CPU keep the torch path.

Tolerances (relative Frobenius error, per request): the kernels compute in fp32 with fp32 dots; measured errors
against float64 are 0.3-3e-7, so the bounds below (2e-6 for one verify/commit, 1e-5 after many rounds) are fp32
rounding with headroom, far under a TF32 or bf16 error (3e-4 .. 4e-3).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from hybridspec_hf.kernels import gdn_torch as ref  # noqa: E402
from hybridspec_hf.kernels.default_verifier import (  # noqa: E402
    PendingDefaultLayer,
    allocate_state_buffer,
    commit_default_states,
    default_verify,
    gdn_decode_step,
)
from hybridspec_hf.kernels.gdn_triton import (  # noqa: E402
    commit_gdn_states_auto,
    commit_gdn_states_triton,
    gdn_verify_auto,
    gdn_verify_triton,
    select_backend,
)

ONE_STEP_TOL = 2e-6  # out, Z, S_m after one verify + commit vs float64
BF16_OUT_TOL = 4e-3  # bf16 outputs carry their own rounding (the interpreter truncates: up to 2^-8 relative)
DRIFT_TOL = 1e-5  # state after hundreds of rounds vs the float64 sequential recurrence


pytestmark = pytest.mark.usefixtures("triton_interpreter")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gates(gen: torch.Generator, shape: tuple, kind: str) -> torch.Tensor:
    """Log-decays g <= 0: strong (≈ -20, the state is nearly reset), weak (≈ -1e-3) or log-uniform across both."""
    u = torch.rand(shape, generator=gen)
    if kind == "strong":
        return -(15.0 + 10.0 * u)
    if kind == "weak":
        return -(5e-4 + 1.5e-3 * u)
    return -torch.exp(torch.log(torch.tensor(1e-3)) + u * torch.log(torch.tensor(2e4)))


def make_inputs(seed: int, b: int, t: int, h: int, hv: int, dk: int, dv: int, gate: str = "mixed",
                dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(b, t, h, dk, generator=gen).to(dtype),
        k=torch.randn(b, t, h, dk, generator=gen).to(dtype),
        v=torch.randn(b, t, hv, dv, generator=gen).to(dtype),
        g=gates(gen, (b, t, hv), gate),
        beta=torch.rand(b, t, hv, generator=gen),
        state=torch.randn(b, hv, dk, dv, generator=gen),
    )


def conv_caches(seed: int, b: int, t: int, channels: int = 300, width: int = 4, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, channels, width, generator=gen).to(dtype),
            torch.randn(b, channels, t, generator=gen).to(dtype))


def verify_args(x: dict) -> tuple:
    return x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"]


def oracle(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 outputs [B, T, HV, dv] and states after every token [B, T, HV, dk, dv]."""
    return ref.gdn_recurrence(*verify_args(x))


def expected_state(x: dict, states64: torch.Tensor, b: int, m: int) -> torch.Tensor:
    return x["state"][b].double() if m == 0 else states64[b, m - 1]


# ----------------------------------------------------------------------------------------------------------------
# verify


@pytest.mark.parametrize(
    "seed, b, t, h, hv, dk, dv, gate, dtype",
    [
        (1, 2, 16, 1, 2, 24, 40, "mixed", torch.float32),  # dk, dv not powers of two
        (2, 2, 5, 1, 3, 24, 40, "strong", torch.float32),  # grouped heads, r = 3
        (3, 1, 16, 2, 4, 24, 40, "weak", torch.bfloat16),  # bf16 q/k/v, grouped r = 2
        (4, 1, 9, 1, 1, 128, 128, "mixed", torch.bfloat16),  # the real head sizes (4 dv tiles)
        (5, 2, 1, 1, 2, 16, 16, "mixed", torch.float32),  # w = 1
    ],
)
@pytest.mark.parametrize("kernel", ["block", "recurrent", "auto"])
def test_verify_matches_float64(seed, b, t, h, hv, dk, dv, gate, dtype, kernel):
    x = make_inputs(seed, b, t, h, hv, dk, dv, gate, dtype)
    res = gdn_verify_triton(*verify_args(x), kernel=kernel)
    out64, _ = oracle(x)
    block64 = ref.gdn_verify(*(a.double() for a in verify_args(x)))
    out_tol = ONE_STEP_TOL if dtype == torch.float32 else 4e-3  # bf16 outputs carry bf16 rounding
    assert res.out.dtype == dtype and res.z.dtype == torch.float32 and res.g_cum.dtype == torch.float32
    assert rel(res.out.float(), out64.float()) < out_tol
    assert rel(res.z, block64.z) < ONE_STEP_TOL
    assert rel(res.g_cum, block64.g_cum) < ONE_STEP_TOL
    fp32 = ref.gdn_verify(*verify_args(x))  # the torch path agrees with the kernel at fp32 level too
    assert rel(res.z, fp32.z) < ONE_STEP_TOL


@pytest.mark.parametrize("w", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("b, kernel", [(1, "block"), (3, "block"), (3, "recurrent")])
def test_bf16_every_window(w, b, kernel):
    """The shipped path at the model's dtypes: bf16 q/k/v, grouped heads, dk = 64 in two 32-row slices, dv = 40 (the
    verify's two 32-column tiles and the commit's one 64-column tile, masked). Request 0 commits nothing, request 1
    the whole window, request 2 a random prefix."""
    x = make_inputs(300 + 10 * w + b, b, w, 1, 2, 64, 40, "mixed", torch.bfloat16)
    res = gdn_verify_triton(*verify_args(x), block_k=32, kernel=kernel)
    out64, states64 = oracle(x)
    block64 = ref.gdn_verify(*(a.double() for a in verify_args(x)))
    assert rel(res.out.float(), out64.float()) < BF16_OUT_TOL
    assert rel(res.z, block64.z) < ONE_STEP_TOL and rel(res.g_cum, block64.g_cum) < ONE_STEP_TOL
    m = torch.tensor([0, w, int(torch.randint(1, w + 1, (1,)))][:b] if b > 1 else [w], dtype=torch.int32)
    conv_state, conv_input = conv_caches(w, b, w)
    layer = ref.PendingGDNLayer(x["state"].clone(), conv_state.clone(), conv_input, x["k"], res)
    commit_gdn_states_triton([layer], m)
    for req, n in enumerate(m.tolist()):
        if n == 0:
            assert torch.equal(layer.state[req], x["state"][req])
        else:
            assert rel(layer.state[req], expected_state(x, states64, req, n)) < ONE_STEP_TOL, (req, n)


@pytest.mark.parametrize("options", [dict(precision="tf32x3"), dict(block_v=8, block_k=16, num_warps=1)])
def test_verify_options_match_float64(options):
    """Another precision and other tiles (the interpreter computes every dot in fp32, so this checks their wiring,
    not TF32 rounding)."""
    x = make_inputs(40, 2, 11, 1, 2, 24, 40, "mixed")
    res = gdn_verify_triton(*verify_args(x), **options)
    out64, _ = oracle(x)
    assert rel(res.out, out64) < ONE_STEP_TOL
    assert rel(res.z, ref.gdn_verify(*(a.double() for a in verify_args(x))).z) < ONE_STEP_TOL


def test_precision_options_name_the_problem():
    """Only fp32-grade dot precisions are offered (plain TF32 drifts 2e-5 .. 3e-4); the error lists them."""
    x = make_inputs(41, 1, 4, 1, 1, 16, 16)
    for precision in ("tf32", "bf16x3"):
        with pytest.raises(ValueError, match=f"precision must be one of .*got '{precision}'"):
            gdn_verify_triton(*verify_args(x), precision=precision)
    conv_state, conv_input = conv_caches(41, 1, 4)
    layer = ref.PendingGDNLayer(x["state"], conv_state, conv_input, x["k"], gdn_verify_triton(*verify_args(x)))
    with pytest.raises(ValueError, match="precision must be one of"):
        commit_gdn_states_triton([layer], torch.tensor([1]), precision="tf32")
    with pytest.raises(ValueError, match="kernel must be one of"):
        gdn_verify_triton(*verify_args(x), kernel="fold")


@pytest.mark.parametrize("b, dtype", [(1, torch.bfloat16), (3, torch.float32)])
def test_decode_step_updates_the_state_in_place(b, dtype):
    """w = 1 decoding: one recurrent step reads and writes the state once; output and new state against float64."""
    x = make_inputs(50 + b, b, 1, 2, 4, 32, 40, "mixed", dtype)
    out64, states64 = oracle(x)
    state = x["state"].clone()
    out = gdn_decode_step(x["q"], x["k"], x["v"], x["g"], x["beta"], state)
    assert out.dtype == dtype and out.shape == (b, 1, 4, 40)
    assert rel(out.float(), out64.float()) < (ONE_STEP_TOL if dtype == torch.float32 else BF16_OUT_TOL)
    assert rel(state, states64[:, 0]) < ONE_STEP_TOL
    with pytest.raises(ValueError, match="one token"):
        gdn_decode_step(*verify_args(make_inputs(52, 1, 2, 1, 1, 16, 16)))


def test_aligned_keys_need_a_stable_solve():
    """Nearly parallel keys with β ≈ 1 and no decay make (I + A) far from I (the power series of A grows like
    binomial coefficients); forward substitution keeps Z at fp32 accuracy there."""
    x = make_inputs(6, 1, 16, 1, 2, 32, 32, "weak")
    gen = torch.Generator().manual_seed(6)
    x["k"] = torch.randn(1, 1, 1, 32, generator=gen) + 1e-2 * x["k"]
    x["beta"] = 0.95 + 0.05 * x["beta"]
    res = gdn_verify_triton(*verify_args(x))
    block64 = ref.gdn_verify(*(a.double() for a in verify_args(x)))
    assert rel(res.z, block64.z) < ONE_STEP_TOL
    assert rel(res.out, oracle(x)[0]) < ONE_STEP_TOL


# ----------------------------------------------------------------------------------------------------------------
# commit


@pytest.mark.parametrize("w", [1, 2, 3, 4, 7, 8, 13, 16])
def test_commit_every_prefix(w):
    """Request b commits m = b tokens, so one launch checks S_m for every m in 0..w (two layers at once)."""
    b = w + 1
    layers, inputs = [], []
    for layer in range(2):
        x = make_inputs(100 * w + layer, b, w, 1, 1, 24, 40, "mixed")
        conv_state, conv_input = conv_caches(layer, b, w)
        # layer 0 from the Triton verify; layer 1's Z from the torch one (same contract, spares interpreter time)
        res = gdn_verify_triton(*verify_args(x)) if layer == 0 else ref.gdn_verify(*verify_args(x))
        res.z = res.z.contiguous()  # torch's triangular solve returns a column-major Z; one launch needs one layout
        layers.append(ref.PendingGDNLayer(x["state"].clone(), conv_state.clone(), conv_input, x["k"], res))
        inputs.append((x, conv_state))
    m = torch.arange(b, dtype=torch.int32)
    commit_gdn_states_triton(layers, m, block_k=16)  # dk = 24: two 16-row slices
    for layer, (x, conv_state) in zip(layers, inputs):
        _, states64 = oracle(x)
        assert torch.equal(layer.state[0], x["state"][0])  # m = 0: untouched
        for req in range(1, b):
            assert rel(layer.state[req], expected_state(x, states64, req, req)) < ONE_STEP_TOL, (w, req)
        conv_ref = conv_state.clone()
        ref.commit_conv_state(conv_ref, layer.conv_input, m)
        assert torch.equal(layer.conv_state, conv_ref)


def test_commit_matches_torch_commit_grouped_heads():
    x = make_inputs(7, 3, 12, 2, 6, 24, 40, "mixed")
    conv_state, conv_input = conv_caches(7, 3, 12, channels=600, dtype=torch.float32)
    m = torch.tensor([12, 0, 5])
    pending = ref.PendingGDNLayer(x["state"].clone(), conv_state.clone(), conv_input, x["k"],
                                  gdn_verify_triton(*verify_args(x)))
    torch_pending = ref.PendingGDNLayer(x["state"].clone(), conv_state.clone(), conv_input, x["k"],
                                        ref.gdn_verify(*verify_args(x)))
    commit_gdn_states_triton([pending], m)
    ref.commit_gdn_states([torch_pending], m)
    assert rel(pending.state, torch_pending.state) < ONE_STEP_TOL
    assert torch.equal(pending.conv_state, torch_pending.conv_state)


@pytest.mark.parametrize("kernel", ["block", "recurrent", "auto"])  # auto: n = 16 block, n = 6 and 1 recurrent
def test_valid_len_ignores_trailing_tokens(kernel):
    """A max-shape verification with valid_len equals the verification of the valid prefix alone."""
    x = make_inputs(8, 3, 16, 1, 2, 24, 40, "mixed")
    valid = torch.tensor([16, 6, 1], dtype=torch.int32)
    x["q"][1, 6:] = float("nan")  # whatever sits past valid_len must not leak in
    res = gdn_verify_triton(*verify_args(x), valid_len=valid, kernel=kernel)
    torch_res = gdn_verify_auto(*verify_args(x), valid_len=valid, kernel_backend="torch")
    for req, n in enumerate(valid.tolist()):
        prefix = {name: a[req: req + 1, :n] for name, a in x.items() if name != "state"}
        prefix["state"] = x["state"][req: req + 1]
        out64, _ = oracle(prefix)
        assert rel(res.out[req, :n], out64[0]) < ONE_STEP_TOL
        assert not res.out[req, n:].any() and not res.z[req, :, n:].any()
        assert rel(torch_res.z[req, :, :n], res.z[req, :, :n]) < ONE_STEP_TOL
    assert rel(res.g_cum, torch_res.g_cum) < ONE_STEP_TOL  # G stays at G_n past the valid tokens
    conv_state, conv_input = conv_caches(8, 3, 16)
    m = torch.tensor([16, 4, 1], dtype=torch.int32)
    pending = ref.PendingGDNLayer(x["state"].clone(), conv_state, conv_input, x["k"], res)
    commit_gdn_states_triton([pending], m)
    x["q"][1, 6:] = 0.0
    _, states64 = oracle(x)
    for req, n in enumerate(m.tolist()):
        assert rel(pending.state[req], states64[req, n - 1]) < ONE_STEP_TOL


# ----------------------------------------------------------------------------------------------------------------
# the kernel choice


def test_auto_verifies_token_by_token_only_while_every_program_has_an_sm(monkeypatch):
    """"auto"'s rule: up to RECURRENT_UPTO valid tokens token by token while the block kernel's programs fit the SMs
    (batch 1 at the 35B-A3B shape: 128 programs on an H200's 132), the block form alone beyond (batch 8: its programs
    share SMs and the merged kernel cost them occupancy, run 9); off with the switch."""
    from hybridspec_hf.kernels import gdn_triton

    monkeypatch.setattr(gdn_triton, "_processors", lambda device: 132)  # the H200
    cuda = torch.device("cuda", 0)
    assert gdn_triton._recurrent_upto(128, cuda) == gdn_triton.RECURRENT_UPTO == 8
    assert gdn_triton._recurrent_upto(1024, cuda) == 0
    assert gdn_triton._recurrent_upto(1024, torch.device("cpu")) == 8  # the interpreter exercises the branch
    monkeypatch.setattr(gdn_triton, "RECURRENT_SHORT", False)
    assert gdn_triton._recurrent_upto(128, cuda) == 0


# ----------------------------------------------------------------------------------------------------------------
# many rounds


def run_rounds(rounds: int, backend: str, seed: int, b: int = 2, h: int = 1, hv: int = 2, d: int = 24) -> list[float]:
    """verify -> commit rounds with random w and random m per request; the state's error against a float64
    sequential recurrence of exactly the committed tokens, after every round."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(b, hv, d, d, generator=gen)
    state64 = state.double()
    conv_state = torch.randn(b, 8, 4, generator=gen)
    errors = []
    for r in range(rounds):
        w = int(torch.randint(1, 17, (1,), generator=gen))
        x = make_inputs(seed * 10_000 + r, b, w, h, hv, d, d, ("mixed", "weak", "strong")[r % 3])
        x["state"] = state
        m = torch.randint(1, w + 1, (b,), generator=gen)
        res = gdn_verify_auto(*verify_args(x), kernel_backend=backend)
        layer = ref.PendingGDNLayer(state, conv_state, torch.randn(b, 8, w, generator=gen), x["k"], res)
        commit_gdn_states_auto([layer], m, kernel_backend=backend)
        x["state"] = state64
        _, states64 = ref.gdn_recurrence(*verify_args(x))
        state64 = states64[torch.arange(b), m - 1]
        errors.append(rel(state, state64))
    return errors


def test_500_rounds_no_drift_torch_fp32():
    """500 rounds of the fp32 block path (the torch implementation of the same math) vs float64."""
    errors = run_rounds(500, "torch", seed=11)
    assert max(errors) < DRIFT_TOL
    assert max(errors[-50:]) < 3 * max(errors[:50]) + 1e-7  # no growth with generation length


def test_rounds_no_drift_triton():
    """The Triton kernels for 200 rounds (~25 s in the interpreter; 500 take a minute, measured max 8.5e-7). The
    500-round run is the torch path above; `benchmarks/gdn_kernels.py --check` runs the compiled kernels on a GPU."""
    errors = run_rounds(200, "triton", seed=12, b=1)
    assert max(errors) < DRIFT_TOL
    assert max(errors[-50:]) < 3 * max(errors[:50]) + 1e-7


# ----------------------------------------------------------------------------------------------------------------
# default verifier


@pytest.mark.parametrize("seed, b, t, h, hv, dk, dv", [(20, 3, 6, 1, 2, 24, 40), (21, 1, 16, 1, 2, 16, 16)])
def test_default_verifier_matches_float64(seed, b, t, h, hv, dk, dv):
    x = make_inputs(seed, b, t, h, hv, dk, dv)
    buffer = allocate_state_buffer(2, x["state"], 16)
    res = default_verify(*verify_args(x), buffer[1], kernel_backend="triton")
    out64, states64 = oracle(x)
    assert rel(res.out, out64) < ONE_STEP_TOL
    assert rel(res.states, states64) < ONE_STEP_TOL
    conv_state, conv_input = conv_caches(seed, b, t)
    m = torch.arange(b, dtype=torch.int32) * (t // max(b - 1, 1)) if b > 1 else torch.tensor([t])
    layer = PendingDefaultLayer(x["state"].clone(), conv_state.clone(), conv_input, res)
    torch_layer = PendingDefaultLayer(x["state"].clone(), conv_state.clone(), conv_input, res)
    commit_default_states([layer], m, kernel_backend="triton")
    commit_default_states([torch_layer], m, kernel_backend="torch")
    for req, n in enumerate(m.tolist()):
        if n == 0:
            assert torch.equal(layer.state[req], x["state"][req])
        else:
            assert torch.equal(layer.state[req], res.states[req, n - 1])  # a copy, bit for bit
    assert torch.equal(layer.state, torch_layer.state)
    assert torch.equal(layer.conv_state, torch_layer.conv_state)


def test_default_verifier_valid_len_and_torch_path():
    x = make_inputs(22, 2, 8, 1, 2, 24, 40)
    valid = torch.tensor([8, 3], dtype=torch.int32)
    buffer = allocate_state_buffer(1, x["state"], 8)[0]
    res = default_verify(*verify_args(x), buffer, valid_len=valid, kernel_backend="triton")
    stored = res.states.clone()
    torch_buffer = buffer.clone()
    torch_res = default_verify(*verify_args(x), torch_buffer, valid_len=valid, kernel_backend="torch")
    out64, states64 = oracle(x)
    assert rel(res.out[0], out64[0]) < ONE_STEP_TOL and rel(res.out[1, :3], out64[1, :3]) < ONE_STEP_TOL
    assert not res.out[1, 3:].any()
    assert rel(stored[1, :3], states64[1, :3]) < ONE_STEP_TOL
    assert rel(torch_res.out, res.out) < ONE_STEP_TOL and rel(torch_res.states[1, :3], stored[1, :3]) < ONE_STEP_TOL


# ----------------------------------------------------------------------------------------------------------------
# dispatch and packaging


def test_backend_selection(monkeypatch):
    cpu = torch.zeros(1)
    assert select_backend("auto", cpu) == "triton"  # TRITON_INTERPRET=1 in this module
    monkeypatch.delenv("TRITON_INTERPRET")
    assert select_backend("auto", cpu) == "torch"
    assert select_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="kernel_backend"):
        select_backend("cuda", cpu)


def test_auto_torch_path_equals_gdn_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    x = make_inputs(30, 2, 5, 1, 2, 24, 40)
    res = gdn_verify_auto(*verify_args(x))
    expected = ref.gdn_verify(*verify_args(x))
    assert torch.equal(res.z, expected.z) and torch.equal(res.out, expected.out)


def test_errors_name_the_problem():
    x = make_inputs(31, 1, 17, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="T=17"):
        gdn_verify_triton(*verify_args(x))
    y = make_inputs(32, 1, 4, 1, 1, 16, 16)
    res = gdn_verify_triton(*verify_args(y))
    conv_state, conv_input = conv_caches(32, 1, 4)
    layers = [ref.PendingGDNLayer(y["state"], conv_state, conv_input, y["k"], res),
              ref.PendingGDNLayer(y["state"].double(), conv_state, conv_input, y["k"], res)]
    with pytest.raises((ValueError, TypeError), match="layer 1's state"):
        commit_gdn_states_triton(layers, torch.tensor([1]))


def test_package_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None; "
            "import hybridspec_hf.kernels.gdn_triton as t, hybridspec_hf.kernels.default_verifier as d; "
            "assert not t.HAS_TRITON and t.select_backend('auto', __import__('torch').zeros(1)) == 'torch'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("cuda_graphs", ["off", "on"])
def test_round_loop_with_triton_kernels_matches_the_torch_path(cuda_graphs):
    """The GPU path of the loop (Triton verify + one-launch commit), run here by its CPU twin under the interpreter:
    same tokens and same committed caches as kernel_backend="torch". cuda_graphs="on": the resident rounds' twin,
    whose forwards then also take the fused GDN route the interpreter opens to CPU tensors (conv + gates kernels,
    and one GEMM over the projection copies made at set-up; the "torch" run uses that GEMM too) until
    release_graphs."""
    from _tiny import VOCAB, cache_tensors, make_drafter, make_target, output_cache

    import hybridspec_hf
    from hybridspec_hf import HybridSpecConfig, patches

    target = make_target("qwen3_5_moe_odd", seed=1, dtype=torch.float32)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    drafter = make_drafter(target, 8, target.generate(prompt, do_sample=False, max_new_tokens=24), 0.25).float()
    outs = {}
    for backend in ("torch", "triton"):
        outs[backend] = target.generate(
            prompt, do_sample=False, max_new_tokens=16, assistant_model=drafter, generation_strategy="confidence",
            return_dict_in_generate=True,
            hybridspec_config=HybridSpecConfig(kernel_backend=backend, cuda_graphs=cuda_graphs),
        )
        assert hybridspec_hf.get_telemetry(target).path == ("static_eager" if cuda_graphs == "on" else "eager")
    assert torch.equal(outs["torch"].sequences, outs["triton"].sequences)
    for mine, theirs in zip(cache_tensors(output_cache(outs["triton"])), cache_tensors(output_cache(outs["torch"])),
                            strict=True):
        assert rel(mine, theirs) < 1e-5
    concatenated = ["_hybridspec_in_proj" in layer.__dict__ for layer in patches.gdn_layers(target)]
    assert all(concatenated) == (cuda_graphs == "on") and any(concatenated) == all(concatenated)
    hybridspec_hf.release_graphs(target)
    assert not any("_hybridspec_in_proj" in m.__dict__ for m in target.modules())


def test_batched_round_loop_with_triton_kernels_matches_the_torch_path():
    """Batched rounds (left padding, a different m per row, rows leaving the batch) through the Triton verify and
    the one-launch commit under the interpreter: same tokens and same returned caches as kernel_backend="torch"."""
    from _tiny import VOCAB, cache_tensors, make_drafter, make_target, output_cache

    from hybridspec_hf import HybridSpecConfig

    target = make_target("qwen3_5_moe_odd", seed=2, dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    lengths = (2, 9, 5)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(1, VOCAB, (n,), generator=generator)
        mask[row, -n:] = 1
    own = [target.generate(ids[row:row + 1, -n:], do_sample=False, max_new_tokens=16)[0]
           for row, n in enumerate(lengths)]
    drafter = make_drafter(target, 8, own, 0.3).float()
    eos = int(own[0][lengths[0] + 4])  # row 0 stops early and leaves the batch
    outs = {}
    for backend in ("torch", "triton"):
        outs[backend] = target.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=12, assistant_model=drafter,
            generation_strategy="confidence", return_dict_in_generate=True, eos_token_id=eos, pad_token_id=0,
            hybridspec_config=HybridSpecConfig(kernel_backend=backend),
        )
        assert target.hybridspec_telemetry.rounds[-1].rows < len(lengths)  # a row left the batch
    assert torch.equal(outs["torch"].sequences, outs["triton"].sequences)
    for mine, theirs in zip(cache_tensors(output_cache(outs["triton"])), cache_tensors(output_cache(outs["torch"])),
                            strict=True):
        assert rel(mine, theirs) < 1e-5
