"""Programmatic dependent launch (kernels/pdl.py) on a Hopper GPU: launches that may overlap must not change a bit.
Skipped without CUDA capability ≥ 9; the CPU tests run every kernel with PDL=False (the same code otherwise)."""
import pytest
import torch
from _tiny import VOCAB

from hybridspec_hf import HybridSpecConfig
from hybridspec_hf.generation import resident
from hybridspec_hf.kernels import gemv_triton, norm_triton, pdl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA device of compute capability >= 9 (Hopper)")


@pytest.fixture
def pdl_switch(monkeypatch):
    def set_to(on: bool):
        monkeypatch.setattr(pdl, "ENABLED", on)
        assert pdl.active(False) == on
    return set_to


def _chain(x, weights, norm_weight):
    """A chain of dependent launches, as a forward's: norm → gemv → gemv (split-K) → add-norm, several times."""
    h = x
    for w_in, w_out in weights:
        y = norm_triton.rms_norm(h, norm_weight, 1e-6)
        y = gemv_triton.gemv(y, w_in, None, gemv_triton.GemvConfig(64, 128, 1, 4, 4, True))
        y = gemv_triton.gemv(y, w_out, None, gemv_triton.GemvConfig(32, 128, 8, 4, 4, True))
        h = h + y
    return h


def chain_inputs(hidden: int, inter: int, pairs: int, rows: int):
    """(weight pairs, norm weight, x [rows, hidden]) of `_chain`, random bf16 on CUDA (seeded)."""
    torch.manual_seed(0)
    weights = [(torch.randn(inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5,
                torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5) for _ in range(pairs)]
    norm_weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    return weights, norm_weight, torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)


def test_a_captured_chain_of_overlapping_launches_gives_the_same_bits(pdl_switch):
    weights, norm_weight, x = chain_inputs(2048, 4096, 6, 1)
    outputs = {}
    for on in (False, True):
        pdl_switch(on)
        _chain(x, weights, norm_weight)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, weights, norm_weight)
        results = []
        for _ in range(20):
            graph.replay()
            results.append(out.clone())
        eager = _chain(x, weights, norm_weight)
        assert all(torch.equal(r, results[0]) for r in results), "replays differ"
        assert torch.equal(eager, results[0])
        outputs[on] = results[0]
    assert torch.equal(outputs[True], outputs[False])
    assert outputs[True].abs().sum() > 0


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("strategy", ["ar", "hybridspec"])
def test_resident_calls_with_pdl_equal_those_without(strategy, rows, pdl_switch):
    """A whole bf16 call through the resident graphs (our kernels throughout) gives the same tokens with PDL as
    without, at batch 1 and in a bucket of 4."""
    from _tiny import make_drafter, make_target

    target = make_target("qwen3_5_moe", dtype=torch.bfloat16)
    if hasattr(target, "set_experts_implementation"):
        target.set_experts_implementation("batched_mm")
    target.cuda()
    drafter = make_drafter(target, 8, None, error_rate=0.25, seed=0).to(torch.bfloat16).cuda()
    drafter.bind_target(target)
    prompt = torch.randint(1, VOCAB, (rows, 11), generator=torch.Generator().manual_seed(rows)).cuda()
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=40, pad_token_id=0,
                  assistant_model=drafter if strategy != "ar" else None, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    outputs = {}
    for on in (False, True):
        pdl_switch(on)
        resident.release_resident_rounds(target)  # graphs captured under this setting
        target.generate(prompt, **kwargs)
        outputs[on] = target.generate(prompt, **kwargs)
    resident.release_resident_rounds(target)
    assert torch.equal(outputs[True], outputs[False])


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("switch", ["early_reads", "fold_norm", "loads_first", "conv_gates"])
def test_early_reads_and_the_folded_norm_keep_the_tokens(switch, rows, monkeypatch):
    """Reads before the PDL wait (pdl.EARLY_READS: the MoE decode down kernel's routing and first weight tile, the
    GDN step's state), the GDN step's norm by the head's last program (gdn_step_triton.FOLD_NORM) and a
    verification's conv and gates in one launch (gdn_prologue_triton.CONV_GATES) give the same tokens as without,
    in whole bf16 resident calls with PDL on: AR at batch 1 (the GDN step, T = 1 decode MoE) and HybridSpec in a
    bucket of 4."""
    from _tiny import make_drafter, make_target

    from hybridspec_hf.kernels import gdn_prologue_triton, gdn_step_triton

    owner, attribute = {"early_reads": (pdl, "EARLY_READS"), "fold_norm": (gdn_step_triton, "FOLD_NORM"),
                        "loads_first": (gdn_step_triton, "LOADS_FIRST"),
                        "conv_gates": (gdn_prologue_triton, "CONV_GATES")}[switch]
    assert pdl.active(False)
    target = make_target("qwen3_5_moe", dtype=torch.bfloat16)
    if hasattr(target, "set_experts_implementation"):
        target.set_experts_implementation("batched_mm")
    target.cuda()
    strategy = "ar" if rows == 1 else "hybridspec"
    drafter = make_drafter(target, 8, None, error_rate=0.25, seed=0).to(torch.bfloat16).cuda()
    drafter.bind_target(target)
    prompt = torch.randint(1, VOCAB, (rows, 11), generator=torch.Generator().manual_seed(7 + rows)).cuda()
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=40, pad_token_id=0,
                  assistant_model=drafter if strategy != "ar" else None, generation_strategy=strategy,
                  hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    outputs = {}
    for on in (False, True):
        monkeypatch.setattr(owner, attribute, on)
        resident.release_resident_rounds(target)  # graphs captured under this setting
        target.generate(prompt, **kwargs)
        outputs[on] = target.generate(prompt, **kwargs)
    resident.release_resident_rounds(target)
    assert torch.equal(outputs[True], outputs[False])


def _step_chain(h, layers, early: bool, fold: bool, monkeypatch, loads_first: bool = True):
    """Per layer: the input projection (gemv, the kernel right before the step) → the GDN step (state and window in
    place) → out projection, as a resident plain step runs them."""
    from hybridspec_hf.kernels import gdn_step_triton

    monkeypatch.setattr(pdl, "EARLY_READS", early)
    monkeypatch.setattr(gdn_step_triton, "FOLD_NORM", fold)
    monkeypatch.setattr(gdn_step_triton, "LOADS_FIRST", loads_first)
    out = h
    for p in layers:
        mixed = gemv_triton.gemv(out, p["w_in"], None, gemv_triton.GemvConfig(64, 128, 1, 4, 4, True))  # [1, 1, W]
        x, z, b, a = mixed.split(p["widths"], dim=-1)
        y = gdn_step_triton.gdn_step(x, p["conv_state"], p["conv_weight"], None, a, b, p["A_log"], p["dt_bias"],
                                     p["state"], z.reshape(1, 1, 32, 128), p["norm_weight"], 1e-6, 16)
        out = out + gemv_triton.gemv(y.reshape(1, 1, -1), p["w_out"], None,
                                     gemv_triton.GemvConfig(32, 128, 8, 4, 4, True))
    return out


def test_the_gdn_step_reads_early_and_folds_its_norm_without_changing_bits(monkeypatch):
    """At the 35B-A3B layer shape (16 key / 32 value heads of 128, BV = 16: 256 programs) in a captured chain with
    PDL: the state read before the wait gives the same bits as after it, over 6 replays that each update the states
    in place, and so do the gates' inputs loaded before the window counter (LOADS_FIRST); the folded norm equals the
    norm's own launch to one bf16 rounding."""
    torch.manual_seed(0)
    hidden, dk, heads, v_heads = 2048, 128, 16, 32
    channels = 2 * heads * dk + v_heads * dk
    widths = [channels, v_heads * dk, v_heads, v_heads]
    def make_layers():
        gen = torch.Generator(device="cuda").manual_seed(1)
        rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
        return [dict(w_in=(rand(sum(widths), hidden) * hidden ** -0.5).bfloat16(),
                     w_out=(rand(hidden, v_heads * dk) * (v_heads * dk) ** -0.5).bfloat16(), widths=widths,
                     conv_state=rand(1, channels, 4).bfloat16(), conv_weight=(rand(channels, 4) * 0.5).bfloat16(),
                     A_log=torch.linspace(-3.0, 2.7, v_heads, device="cuda"), dt_bias=rand(v_heads).bfloat16(),
                     state=rand(1, v_heads, dk, dk) * 0.3, norm_weight=(1.0 + 0.3 * rand(dk)).bfloat16())
                for _ in range(4)]
    h = torch.randn(1, 1, hidden, device="cuda").bfloat16()
    runs = {}
    for early, fold, first in ((False, False, True), (True, False, True), (True, True, True), (True, True, False)):
        layers = make_layers()
        _step_chain(h, make_layers(), early, fold, monkeypatch, first)  # compiles outside the capture (other caches)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _step_chain(h, layers, early, fold, monkeypatch, first)
        outs = []
        for _ in range(6):
            graph.replay()
            outs.append(out.clone())
        runs[early, fold, first] = (torch.stack(outs), torch.stack([p["state"] for p in layers]))
    assert torch.equal(runs[True, False, True][0], runs[False, False, True][0])
    assert torch.equal(runs[True, False, True][1], runs[False, False, True][1])
    # the gates' inputs loaded first (the window counter read after the math): the same bits as after the counter
    assert torch.equal(runs[True, True, True][0], runs[True, True, False][0])
    assert torch.equal(runs[True, True, True][1], runs[True, True, False][1])
    folded, separate = runs[True, True, True][0].float(), runs[True, False, True][0].float()
    assert runs[True, False, True][0].abs().sum() > 0
    torch.testing.assert_close(folded, separate, rtol=2 ** -7, atol=2 ** -7 * separate.abs().max().item())
