"""The RoPE table of resident forwards (patches/_rope.py) and the mask built on demand (graphs/static_target.py), on
the CPU twin (the tests' switch `_rope._ON_CPU` takes the lookup on CPU tensors).

A lookup equals the rotary embedding's own forward bit for bit, for plain RoPE and mRoPE (rows equal or not, a
text row in front), position ids far past the cache's slots, float32 and bfloat16; it is refused (the forward runs)
for another module, another form of ids or hooks, and no table is built for a dynamic rope type. Whole resident
calls take the lookup in every forward and still equal AR; the head of a one-token forward is then the embedding
and one gather, and the mask is built once per forward only where an attention layer runs transformers' function."""
import pytest
import torch
from _tiny import VOCAB, build_target, make_drafter, make_target, prepare
from test_batched import PAD, assert_rows_equal_own, left_pad, own_generate, random_prompts
from test_exactness import assert_same_as_ar, reference
from test_properties import latency_model
from torch.utils._python_dispatch import TorchDispatchMode

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig, patches
from hybridspec_hf.graphs import static_target
from hybridspec_hf.patches import _rope
from hybridspec_hf.patches._rope import RopeTable, rope_slots, rotary_input

SLOTS = 48


@pytest.fixture
def lookups(monkeypatch):
    """The lookup on CPU tensors; counts the forwards it served."""
    monkeypatch.setattr(_rope, "_ON_CPU", True)
    served = [0]
    original = RopeTable.lookup

    def lookup(self, *args):
        found = original(self, *args)
        served[0] += found is not None
        return found

    monkeypatch.setattr(RopeTable, "lookup", lookup)
    return served


def _rotary(name: str, dtype=torch.float32):
    return patches.text_model(make_target(name, dtype=dtype)).rotary_emb


def _looked_up(table, rotary, x, position_ids, slots):
    with torch.no_grad(), patches.fused_kernels(), rope_slots(table, slots):
        return rotary(x, position_ids)


def _forward(rotary, x, position_ids):
    with torch.no_grad():
        return type(rotary)._hybridspec_original_forward(rotary, x, rotary_input(rotary, position_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, rows", [("qwen3_5_moe", 1), ("qwen3_5_moe", 3), ("qwen3_5_moe_vlm", 4),
                                        ("qwen3_5_dense", 3), ("qwen3_next", 1)])
def test_a_lookup_equals_the_rotary_forward_bit_for_bit(name, rows, dtype, lookups):
    rotary = _rotary(name)
    generator = torch.Generator().manual_seed(rows)
    batch = 3
    # each mRoPE row and batch row its own offset (an image before the text shifts them), up to far past the slots
    offsets = torch.randint(0, 5000, (rows, batch, 1), generator=generator)
    form = (lambda ids: ids[0]) if rows == 1 else (lambda ids: ids)  # the static target's position ids
    table = RopeTable.build(rotary, form(offsets), SLOTS, dtype)
    assert table is not None
    table.fill(form(offsets))
    x = torch.zeros(batch, 1, 8, dtype=dtype)
    for tokens in (1, 5):
        slots = torch.randint(0, SLOTS - tokens + 1, (batch, 1), generator=generator) + torch.arange(tokens)
        position_ids = form(offsets + slots[None])
        got = _looked_up(table, rotary, x, rotary_input(rotary, position_ids), slots)
        want = _forward(rotary, x, position_ids)
        assert got[0].dtype == dtype and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].stride() == got[1].stride() and got[0].is_contiguous()
    assert lookups[0] == 2


@pytest.mark.parametrize("name, rows", [("qwen3_5_moe", 1), ("qwen3_5_moe", 3), ("qwen3_5_moe_vlm", 4),
                                        ("qwen3_next", 1)])
def test_a_model_forward_with_the_lookup_equals_it_without(name, rows, lookups):
    """The ids the text model hands its rotary embedding are the ones the table was filled for (`rotary_input`):
    with distinct mRoPE rows and a text row in front, the logits are the same bits."""
    target = make_target(name, seed=1, dtype=torch.float32)
    rotary = patches.text_model(target).rotary_emb
    batch, tokens = 2, 6
    offsets = torch.randint(0, 300, (rows, batch, 1), generator=torch.Generator().manual_seed(rows))
    form = (lambda ids: ids[0]) if rows == 1 else (lambda ids: ids)
    table = RopeTable.build(rotary, form(offsets), SLOTS, torch.float32)
    table.fill(form(offsets))
    slots = torch.arange(tokens).expand(batch, tokens)  # a fresh forward: the tokens at slots 0 .. T-1
    ids = torch.randint(0, VOCAB, (batch, tokens))
    with torch.no_grad():
        want = target(input_ids=ids, position_ids=form(offsets + slots[None]), use_cache=False).logits
        with patches.fused_kernels(), rope_slots(table, slots):
            got = target(input_ids=ids, position_ids=form(offsets + slots[None]), use_cache=False).logits
    assert lookups[0] == 1
    assert torch.equal(got, want)


def test_a_lookup_is_refused_where_the_table_does_not_apply(lookups):
    rotary = _rotary("qwen3_5_moe")
    offsets = torch.zeros(3, 1, 1, dtype=torch.long)
    table = RopeTable.build(rotary, offsets, SLOTS, torch.float32)
    table.fill(offsets)
    x, slots = torch.zeros(1, 1, 8), torch.tensor([[4]])
    ids = offsets + slots[None]
    assert table.lookup(rotary, x, ids, slots) is not None
    assert table.lookup(_rotary("qwen3_5_moe"), x, ids, slots) is None  # another module
    assert table.lookup(rotary, x.double(), ids, slots) is None  # another dtype
    assert table.lookup(rotary, x, ids[0], slots) is None  # ids of another form
    assert table.lookup(rotary, x, ids.expand(3, 1, 2), slots) is None  # another number of tokens
    handle = rotary.register_forward_hook(lambda module, args, output: output)
    assert table.lookup(rotary, x, ids, slots) is None  # a hook may change what the call returns
    handle.remove()
    with torch.no_grad(), rope_slots(table, slots):  # outside fused_kernels(): the forward
        rotary(x, ids)
    assert lookups[0] == 1


def test_no_table_for_a_dynamic_rope_type_and_the_calls_stay_exact(lookups, fp64_gdn):
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=16,
                  layer_types=["linear_attention", "full_attention"] * 2,
                  rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    target = prepare(build_target("qwen3_next", config))
    rotary = patches.text_model(target).rotary_emb
    assert RopeTable.build(rotary, torch.zeros(1, 1, dtype=torch.long), SLOTS, torch.float64) is None
    prompt = torch.randint(0, VOCAB, (1, 12))
    ar = reference(target, prompt, 12)  # past max_position_embeddings: the dynamic type rescales inv_freq
    out = target.generate(prompt, do_sample=False, max_new_tokens=12, generation_strategy="ar",
                          hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert_same_as_ar(out, ar)
    assert lookups[0] == 0


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_5_moe_vlm", "qwen3_next", "qwen3_5_dense"])
@pytest.mark.parametrize("strategy", ["ar", "hybridspec"])
def test_resident_calls_look_cos_and_sin_up_and_equal_ar(name, strategy, lookups, fp64_gdn):
    target = make_target(name, seed=3)
    prompt = torch.randint(0, VOCAB, (1, 11))
    ar = reference(target, prompt, 24)
    drafter = make_drafter(target, 8, ar.sequences, error_rate=0.3)
    settings = HybridSpecConfig(latency_model=latency_model(8, 0.2), cuda_graphs="on")
    rounds = 0
    for _ in range(2):  # the second call reuses the rounds: its `load` refills the table
        out = target.generate(prompt, do_sample=False, max_new_tokens=24, generation_strategy=strategy,
                              assistant_model=None if strategy == "ar" else drafter, hybridspec_config=settings)
        assert hybridspec_hf.get_telemetry(target).path == "static_eager"
        assert_same_as_ar(out, ar)
        rounds += len(hybridspec_hf.get_telemetry(target).rounds)  # calls may differ: the second carries evidence
    assert lookups[0] >= rounds


def test_batched_rows_look_up_their_own_rows(lookups, fp64_gdn):
    target = make_target("qwen3_next", seed=4)
    prompts = random_prompts((5, 12, 8), seed=4)
    own = own_generate(target, prompts, 10)
    drafter = make_drafter(target, 8, [o.sequences[0] for o in own], error_rate=0.3)
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                          assistant_model=drafter, generation_strategy="hybridspec",
                          hybridspec_config=HybridSpecConfig(cuda_graphs="on", latency_model=latency_model(8, 0.2)))
    assert hybridspec_hf.get_telemetry(target).path == "static_eager"
    assert_rows_equal_own(out, prompts, own)
    assert lookups[0] > 0


class _Kernels(TorchDispatchMode):
    """The non-view aten ops dispatched while on (what launches kernels on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops, self.on = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not func.is_view:
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("on_demand", [True, False])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_a_one_token_forward_starts_with_two_launches_and_builds_the_mask_once(name, on_demand, lookups,
                                                                               monkeypatch):
    """Before the first decoder layer of the resident AR step: the embedding and the gather of cos/sin (no
    positions, slots or mask: ≈ 17 launches fewer at transformers 5.17's mRoPE). The mask is then built once, by
    the first attention layer (the CPU twin runs transformers' attention function in each)."""
    monkeypatch.setattr(static_target, "MASK_ON_DEMAND", on_demand)
    built = [0]
    dense_mask = static_target.StaticTarget._dense_mask

    def counted(self, slots):
        built[0] += 1
        return dense_mask(self, slots)

    monkeypatch.setattr(static_target.StaticTarget, "_dense_mask", counted)
    target = make_target(name, dtype=torch.float32)
    kernels, heads = _Kernels(), []
    patches.text_model(target).layers[0].register_forward_pre_hook(lambda *args: setattr(kernels, "on", False))
    forward = static_target.StaticTarget.forward

    def counted_forward(self, tokens, verify=None, head=True):
        kernels.ops, kernels.on, built[0] = [], True, 0
        with kernels:
            out = forward(self, tokens, verify, head)
        heads.append((kernels.ops, built[0]))
        return out

    monkeypatch.setattr(static_target.StaticTarget, "forward", counted_forward)
    prompt = torch.randint(0, VOCAB, (1, 9))
    ar = reference(target, prompt, 6)
    out = target.generate(prompt, do_sample=False, max_new_tokens=6, generation_strategy="ar",
                          hybridspec_config=HybridSpecConfig(cuda_graphs="on"))
    assert_same_as_ar(out, ar)
    want = ["embedding", "gather"] if on_demand else ["le", "embedding", "gather"]
    assert heads and all(ops == want and count == 1 for ops, count in heads)


@pytest.mark.parametrize("how", ["legacy", "new", "global", "precision"])
def test_no_table_on_cuda_while_tf32_may_round_the_products(how, monkeypatch):
    """The one-term GEMM of transformers 5.17's forward rounds alike in every kernel only without TF32, whichever of
    torch's switches turned it on (reading the legacy one raises after the new one set it)."""
    cuda = torch.device("cuda")
    assert _rope._exact_products(cuda) and _rope._exact_products(torch.device("cpu"))
    matmul, backends = torch.backends.cuda.matmul, torch.backends
    saved = (matmul.fp32_precision, backends.fp32_precision, torch.get_float32_matmul_precision())
    try:
        if how == "legacy":
            matmul.allow_tf32 = True
        elif how == "new":
            matmul.fp32_precision = "tf32"
        elif how == "global":  # what the matmuls inherit unless set themselves
            matmul.fp32_precision, backends.fp32_precision = "none", "tf32"
        else:
            torch.set_float32_matmul_precision("high")
        assert not _rope._exact_products(cuda) and _rope._exact_products(torch.device("cpu"))
    finally:
        torch.set_float32_matmul_precision(saved[2])
        backends.fp32_precision, matmul.fp32_precision = saved[1], saved[0]
    assert _rope._exact_products(cuda)
