"""The shipped tiny pair (sizes, offline loading, a target that writes code) and the drafter-training pipeline."""
from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from hybridspec_hf.drafter import DFlashDrafter
from hybridspec_hf.drafter.training import (
    Sample,
    SoftTargets,
    acceptance_lengths,
    add_train_drafter_arguments,
    block_labels,
    dflash_loss,
    distinct_ngram_ratio,
    load_prompts,
    novel_continuations,
    pad_samples,
    precompute_features,
    run_train_drafter,
    sample_anchors,
    target_features,
    train_drafter,
)
from hybridspec_hf.tiny_pair import (
    ASSETS_DIR,
    StdlibFile,
    code_prompts,
    heldout_prompts,
    load_stdlib_split,
    load_tiny_pair,
    load_tiny_tokenizer,
    spliced_prompts,
    stdlib_files,
)

MiB = 2**20


def shipped_files():
    return [p for p in ASSETS_DIR.rglob("*") if p.is_file()]


def test_assets_fit_the_size_budget():
    files = shipped_files()
    names = {p.relative_to(ASSETS_DIR).as_posix() for p in files}
    for needed in ("target/config.json", "drafter/model.safetensors", "drafter/config.json",
                   "tokenizer/tokenizer.json", "stdlib_split.json"):
        assert needed in names
    if "target/model.safetensors" not in names:  # sharded: the index names every shard, and every shard is there
        index = json.loads((ASSETS_DIR / "target" / "model.safetensors.index.json").read_text())
        shards = {f"target/{name}" for name in index["weight_map"].values()}
        assert shards and shards <= names, shards - names
    too_big = {p.name: p.stat().st_size for p in files if p.stat().st_size > 15 * MiB}
    assert not too_big, f"files over 15 MiB: {too_big}"
    assert sum(p.stat().st_size for p in files) <= 30 * MiB


def test_split_is_pinned_and_heldout_is_disjoint():
    split = load_stdlib_split()
    by_split = {}
    for entry in split["files"]:
        by_split.setdefault(entry["split"], set()).add(entry["path"])
        assert len(entry["sha256"]) == 64
    assert not by_split["train"] & by_split["heldout"]
    assert 0.01 < len(by_split["heldout"]) / (len(by_split["train"]) + len(by_split["heldout"])) < 0.06
    assert not any(p.startswith(("site-packages/", "dist-packages/")) for p in by_split["train"])


@pytest.fixture(scope="module")
def pair():
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield load_tiny_pair()
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE")
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def test_pair_loads_offline_in_float32_and_the_drafter_is_bound(pair):
    target, drafter, tokenizer = pair
    assert isinstance(target, Qwen3_5MoeForCausalLM) and isinstance(drafter, DFlashDrafter)
    assert target.dtype == torch.float32 and drafter.dtype == torch.float32
    assert "full_attention" in target.config.layer_types and "linear_attention" in target.config.layer_types
    assert target.config.linear_num_value_heads == 2 * target.config.linear_num_key_heads
    drafter.validate_target(target)  # raises if not bound to this target
    assert drafter.config.mask_token_id == tokenizer.mask_token_id
    assert tokenizer.eos_token_id == target.config.eos_token_id
    fitted = json.loads((ASSETS_DIR / "acceptance_estimator.json").read_text())["weight"]  # carried by the drafter
    assert drafter.acceptance_estimator.weight.tolist() == fitted
    assert drafter.acceptance_estimator.block_size == drafter.config.block_size


# A held-out file's opening, fixed here so the test does not depend on this interpreter's stdlib.
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"


def test_target_writes_deterministic_non_degenerate_code(pair):
    target, _, tokenizer = pair
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    runs = [target.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist() for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) >= 8, tokenizer.decode(runs[0])
    text = tokenizer.decode(runs[0])
    assert any(word in text for word in ("    ", "(", "=")), text  # looks like Python, not noise


def test_the_tokenizer_pads_a_batch_on_the_left_for_generate(pair):
    """tokenizer(texts, padding=True) gives what batched generate() needs (left padding): each row's HybridSpec
    continuation is its own prompt's greedy generate()."""
    target, drafter, tokenizer = pair
    texts = [PROMPT, "def add(a, b):\n"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert tokenizer.padding_side == "left" and (batch.attention_mask[:, -1] == 1).all()
    out = target.generate(**batch, assistant_model=drafter, generation_strategy="dflash", do_sample=False,
                          max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    for row, text in enumerate(texts):
        ids = tokenizer(text, return_tensors="pt").input_ids
        own = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
        assert out[row, -12:].tolist() == own[0, ids.shape[1]:].tolist()


def test_text_generation_pipeline_passes_the_strategy_through(pair):
    """transformers' text-generation pipeline forwards generate() kwargs: HybridSpec gives the stock pipeline's
    texts, with its stop_sequence and with batched inputs (the tokenizer pads on the left)."""
    from transformers import pipeline

    target, drafter, tokenizer = pair
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer, device="cpu")
    spec = dict(assistant_model=drafter, generation_strategy="dflash")
    common = dict(max_new_tokens=40, do_sample=False, stop_sequence="\n\n")
    stock = pipe(PROMPT, **common)
    assert pipe(PROMPT, **common, **spec) == stock
    assert stock[0]["generated_text"].endswith("\n\n") or len(tokenizer(stock[0]["generated_text"]).input_ids) >= 40
    texts = [PROMPT, "def add(a, b):\n"]
    common = dict(max_new_tokens=12, do_sample=False, batch_size=2, return_full_text=False)
    assert pipe(texts, **common, **spec) == pipe(texts, **common)


def test_drafter_drafts_the_targets_continuation(pair):
    """One real draft round through the inference API: the block must get some tokens right."""
    target, drafter, tokenizer = pair
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    greedy = target.generate(ids, max_new_tokens=16, do_sample=False)[0]
    prefix = greedy[: ids.shape[1] + 1]  # prompt + the first generated token (the anchor)
    features = target_features(target, prefix[None, :-1], drafter.config.target_layer_ids)
    draft = drafter.draft(prefix[None, -1:], features, drafter.new_context_cache()).argmax(-1)[0]
    expected = greedy[ids.shape[1] + 1: ids.shape[1] + drafter.config.block_size]
    assert draft.shape[0] == drafter.config.block_size - 1
    assert (draft[: len(expected)] == expected).sum() >= 1


def test_code_prompts_are_deterministic_line_windows():
    files = [StdlibFile("a.py", "".join(f"x{i} = {i}  # line {i}\n" for i in range(200)))]
    a, b = code_prompts(files, 5, seed=3), code_prompts(files, 5, seed=3)
    assert a == b and len(a) == 5
    assert all(p.endswith("\n") and p.startswith("x") and 120 <= len(p) <= 320 for p in a)


def test_spliced_prompts_join_two_windows_at_a_line():
    """Each spliced prompt: its own first half of lines, then another prompt's second half; seeded; every prompt's
    tail used once; a one-line prompt kept whole and never a partner; too few prompts refused."""
    prompts = [f"a{i} = 1\nb{i} = 2\nc{i} = 3\nd{i} = 4\n" for i in range(6)] + ["single line\n"]
    spliced = spliced_prompts(prompts, seed=1)
    assert spliced == spliced_prompts(prompts, seed=1) and spliced != spliced_prompts(prompts, seed=2)
    tails = []
    for i, text in enumerate(spliced[:6]):
        head = f"a{i} = 1\nb{i} = 2\n"
        tail = text[len(head):]
        assert text.startswith(head) and tail.startswith("c") and not tail.startswith(f"c{i} ")
        tails.append(tail)
    assert sorted(tails) == sorted(f"c{i} = 3\nd{i} = 4\n" for i in range(6))
    assert spliced[6] == "single line\n"
    with pytest.raises(ValueError, match="at least two prompts of two lines"):
        spliced_prompts(["x\ny\n", "single\n"])


def test_heldout_prompts_come_from_pinned_heldout_files():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # another Python version: files with another hash are skipped with a warning
        files = stdlib_files("heldout")
    if not files:
        pytest.skip("no held-out file of the pinned stdlib version on this interpreter")
    prompts = heldout_prompts(4)
    assert len(prompts) == 4 and all(any(p in f.text for f in files) for p in prompts)


def test_anchor_labels_and_novelty():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 0, 0]])
    starts, lengths = torch.tensor([2]), torch.tensor([6])
    anchors, valid = sample_anchors(starts, lengths, 8, 16, torch.Generator().manual_seed(0))
    assert anchors[valid].tolist() == [2, 3, 4]  # inside the response, one label at least
    labels, exists = block_labels(ids, lengths, torch.tensor([[2, 4]]), torch.tensor([[True, True]]), block_size=4)
    assert labels[0, 0].tolist() == [8, 9, 10] and exists[0, 0].tolist() == [True, True, True]
    assert exists[0, 1].tolist() == [True, False, False]  # past the sequence end: no label
    # the 2 tokens after p: (2,1) new, (1,2) seen, (2,1) seen, (1,2) seen, (2,3) new; the last two have no 2 after
    assert novel_continuations([1, 2, 1, 2, 1, 2, 3], 2).tolist() == [True, False, False, False, True, False, False]
    assert distinct_ngram_ratio([[1, 1, 1, 1]], 2) == pytest.approx(1 / 3)


def test_soft_targets_sit_on_the_labels_and_the_loss_mixes_them():
    """SoftTargets.at_blocks gives block position k of anchor p the target's distribution at p+k-1, the one whose
    argmax a greedy response put at p+k (so its top id is block_labels' label); dflash_loss with α = 0 is the plain
    weighted CE, with α = 1 and one-hot soft targets on the labels the same, and with α = 0.5 the mean of the two."""
    torch.manual_seed(0)
    vocab, width = 11, 9
    ids = torch.randint(0, vocab, (2, width))
    lengths = torch.tensor([9, 7])
    logits = torch.randn(2, width, vocab)
    logits[:, :-1].scatter_(-1, ids[:, 1:, None], 6.0)  # greedy-consistent: position t's argmax is x_{t+1}
    soft = SoftTargets.from_logits(logits, 4)
    assert soft.probs.shape == (2, width, 4) and torch.allclose(soft.probs.sum(-1), torch.ones(2, width))
    anchors, valid = torch.tensor([[1, 3], [2, 5]]), torch.ones(2, 2, dtype=torch.bool)
    labels, exists = block_labels(ids, lengths, anchors, valid, block_size=4)
    at = SoftTargets.pad([soft.row(0, 9), soft.row(1, 7)]).at_blocks(anchors, 4)
    assert at.probs.shape == (2, 2, 3, 4)
    assert torch.equal(at.ids[..., 0][exists], labels[exists])
    assert 0.5 < at.probs[..., 0][exists].min() and at.probs[..., 0][exists].max() < 0.999
    drafter_logits = torch.randn(2, 2, 3, vocab)
    plain, _ = dflash_loss(drafter_logits, labels, exists, gamma=2.0)
    weights = torch.exp(-torch.arange(3.0) / 2.0).expand_as(labels) * exists
    ce = torch.nn.functional.cross_entropy(drafter_logits.flatten(0, 2), labels.flatten(), reduction="none")
    torch.testing.assert_close(plain, (ce.view_as(labels) * weights).sum() / weights.sum())
    one_hot = SoftTargets(torch.ones(2, 2, 3, 1), labels[..., None])
    torch.testing.assert_close(dflash_loss(drafter_logits, labels, exists, 2.0, one_hot, 1.0)[0], plain)
    full, _ = dflash_loss(drafter_logits, labels, exists, 2.0, at, 1.0)
    half, _ = dflash_loss(drafter_logits, labels, exists, 2.0, at, 0.5)
    torch.testing.assert_close(half, (plain + full) / 2)
    assert not torch.isclose(full, plain)  # the soft targets carry more than the label
    with pytest.raises(ValueError, match="needs `soft`"):
        dflash_loss(drafter_logits, labels, exists, 2.0, None, 0.5)
    with pytest.raises(ValueError, match="distill_topk must be in 1..11"):
        SoftTargets.from_logits(logits, 12)


def tiny_random_target(tokenizer) -> Qwen3_5MoeForCausalLM:
    config = Qwen3_5MoeTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, head_dim=16, num_attention_heads=2,
        num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, max_position_embeddings=256, tie_word_embeddings=True,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return Qwen3_5MoeForCausalLM(config).eval()


def test_training_pipeline_regenerates_trains_saves_reloads_and_reports_tau(tmp_path):
    tokenizer = load_tiny_tokenizer()
    target = tiny_random_target(tokenizer)
    prompts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(6)]
    drafter = train_drafter(target, prompts, tmp_path, tokenizer=tokenizer, num_layers=1, block_size=4, steps=3,
                            batch_size=2, num_anchors=4, max_new_tokens=8, regen_batch_size=4,
                            eval_prompts=prompts[:2], eval_block_sizes=(4, 2), log_every=1)
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert len(log["loss_curve"]) == 3 and log["recipe"]["block_size"] == 4
    result = json.loads((tmp_path / "eval.json").read_text())
    for b in ("4", "2"):
        assert 1.0 <= result["block_sizes"][b]["tau"] <= int(b)
    assert "calibration" in result and "distinct_ngram_ratio" in result
    reloaded = DFlashDrafter.from_pretrained(str(tmp_path)).bind_target(target)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor.cpu())  # trained on the GPU where one is
    # resumable: the response shards are reused, not regenerated
    shards = sorted((tmp_path / "regen").glob("shard-*.jsonl"))
    mtimes = [p.stat().st_mtime_ns for p in shards]
    args = add_train_drafter_arguments(argparse.ArgumentParser()).parse_args([
        "--target", str(tmp_path / "t"), "--prompts", str(tmp_path / "p.jsonl"), "--output-dir", str(tmp_path),
        "--num-layers", "1", "--block-size", "4", "--steps", "1", "--batch-size", "2", "--num-anchors", "4",
        "--max-new-tokens", "8", "--regen-batch-size", "4", "--tokenizer", str(ASSETS_DIR / "tokenizer")])
    target.save_pretrained(str(tmp_path / "t"))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert load_prompts(tmp_path / "p.jsonl") == prompts
    run_train_drafter(args)
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    # continued with one more layer (grow_drafter): the saved drafter has two
    grown = add_train_drafter_arguments(argparse.ArgumentParser()).parse_args([
        "--target", str(tmp_path / "t"), "--prompts", str(tmp_path / "p.jsonl"), "--output-dir",
        str(tmp_path / "grown"), "--init-drafter", str(tmp_path), "--num-layers", "2", "--steps", "1",
        "--batch-size", "2", "--num-anchors", "4", "--max-new-tokens", "8", "--regen-batch-size", "4",
        "--tokenizer", str(ASSETS_DIR / "tokenizer")])
    assert run_train_drafter(grown).config.num_hidden_layers == 2
    assert json.loads((tmp_path / "grown" / "config.json").read_text())["num_hidden_layers"] == 2
    # distilled (part of the loss on the target's top-k distributions), from cached features and without, widened
    # to read one more target layer; a weight outside [0, 1] is refused before anything runs
    assert drafter.config.target_layer_ids == [2]  # z-lab's rule for one draft layer of a 4-layer target
    for cache in (True, False):
        out = tmp_path / f"distilled_{cache}"
        distilled = train_drafter(target, prompts, out, tokenizer=tokenizer, block_size=4, steps=2, batch_size=2,
                                  num_anchors=4, max_new_tokens=8, regen_batch_size=4, init_drafter=str(tmp_path),
                                  target_layer_ids=[2, 3] if cache else None,
                                  cache_features=cache, distill_weight=0.5, distill_topk=8, log_every=1)
        log = json.loads((out / "training_log.json").read_text())
        assert log["recipe"]["distill_weight"] == 0.5 and log["recipe"]["distill_topk"] == 8
        assert log["feature_cache"] is cache and all(torch.isfinite(torch.tensor(e["loss"])) for e in log["loss_curve"])
        if cache:
            assert distilled.config.target_layer_ids == [2, 3] and distilled.fc.in_features == 2 * 32
    with pytest.raises(ValueError, match="distill_weight must be in"):
        train_drafter(target, prompts, tmp_path / "bad", tokenizer=tokenizer, distill_weight=1.5)


def test_precomputed_soft_targets_equal_the_targets_logits():
    tokenizer = load_tiny_tokenizer()
    target = tiny_random_target(tokenizer)
    samples = [Sample([5, 6, 7], [8, 9]), Sample([4, 5], [6, 7, 8, 9, 10])]
    features, soft = precompute_features(target, samples, [1, 2], pad_id=tokenizer.pad_token_id, device="cpu",
                                         dtype=torch.float32, batch_size=2, distill_topk=5)
    for sample, f, s in zip(samples, features, soft):
        ids = torch.tensor([sample.ids])
        feats, logits = target_features(target, ids, [1, 2], return_logits=True)
        torch.testing.assert_close(f, feats[0])
        top = logits[0].float().topk(5, dim=-1)
        assert torch.equal(s.ids, top.indices.int())
        torch.testing.assert_close(s.probs, top.values.softmax(-1))
    ids, starts, lengths = pad_samples(samples, tokenizer.pad_token_id, "cpu")
    assert lengths.tolist() == [5, 7] and starts.tolist() == [3, 2]


def test_offline_tau_counts_every_full_block_and_skips_short_responses():
    tokenizer = load_tiny_tokenizer()
    target = tiny_random_target(tokenizer)
    drafter = DFlashDrafter.from_target(target, num_layers=1, block_size=4, mask_token_id=tokenizer.mask_token_id)
    prompt = [5, 6, 7]
    response = target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 3:].tolist()
    short = Sample(prompt, response[:2])  # shorter than a block: no anchor
    result = acceptance_lengths(target, drafter, [Sample(prompt, response), short], block_sizes=(4,))
    block = result["block_sizes"]["4"]
    assert block["num_anchors"] == len(response) - 3  # anchors p with p + 3 inside the response
    assert 1.0 <= block["tau"] <= 4.0 and sum(block["tau_histogram"]) == block["num_anchors"]


def test_build_corpus_prompt_files_count_what_they_write(tmp_path, capsys):
    """scripts/tiny_pair/build_corpus.py --prompts-only: --train-skip drops that many windows, and the count it
    prints is the count it wrote; a splice needs two prompts left, and says so; on a stdlib other than the pinned one
    (the GPU machine's Python) it refuses instead of writing other prompts or failing on a missing file."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "tiny_pair" / "build_corpus.py"
    spec = importlib.util.spec_from_file_location("build_corpus", path)
    build_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_corpus)
    with pytest.raises(SystemExit, match="--prompts-only needs the pinned split's files unchanged: .* missing"):
        with pytest.MonkeyPatch.context() as patch:  # another interpreter's stdlib: refused, nothing written
            patch.setattr(build_corpus, "stdlib_root", lambda: tmp_path / "no_stdlib")
            build_corpus.main(["--prompts-only", "--data-dir", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    try:
        stdlib_files("train", strict=True)
    except RuntimeError:
        pytest.skip("the pinned stdlib split is not this interpreter's (prompt files are built on the pinned one)")
    build_corpus.main(["--prompts-only", "--train-prompts", "30", "--train-skip", "12", "--heldout-prompts", "4",
                       "--data-dir", str(tmp_path)])
    written = (tmp_path / "train_prompts.jsonl").read_text().splitlines()
    assert len(written) == 18 and capsys.readouterr().out.startswith("18 training prompts (after 12)")
    with pytest.raises(SystemExit, match="leaves 1 training prompts \\(2 needed\\)"):
        build_corpus.main(["--prompts-only", "--train-prompts", "30", "--train-skip", "29", "--splice",
                           "--heldout-prompts", "4", "--data-dir", str(tmp_path / "b")])
