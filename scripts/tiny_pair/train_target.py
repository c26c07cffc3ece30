"""Train the tiny Qwen3.5-MoE target on the stdlib token stream (`build_corpus.py` output).

    python scripts/tiny_pair/train_target.py --out runs/tiny_pair/target --time-budget-s 240      # H200
    python scripts/tiny_pair/train_target.py --out /tmp/t --steps 3 --batch-size 2 --seq-len 64  # CPU smoke test

Recipe: random 512-token windows of the training stream, AdamW (β 0.9/0.95, weight decay 0.1 on matrices), linear
warm-up then cosine decay to 10 %, grad clip 1.0, bf16 autocast on CUDA, router load-balancing loss (coef 0.001).
With `--time-budget-s` the step count is set from the measured speed of the first steps, so the cosine schedule ends
inside the budget. GDN runs transformers' pure-torch path (fla's backward refuses this GPU image's Triton).
Writes `<out>/` (bf16 safetensors + config, loadable by `from_pretrained`) and `<out>/../target_log.json`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hybridspec_hf.drafter.training import warmup_cosine_lr  # noqa: E402


def tiny_target_config(vocab_size: int = 4096, eos_token_id: int = 0, pad_token_id: int = 1, *,
                       hidden_size: int = 320, moe_intermediate_size: int = 40,
                       shared_expert_intermediate_size: int = 160, num_layers: int = 8):
    """8 layers (GDN ×3 then gated full attention), hidden 320, 16 experts top-4 (width 40) + shared expert (160).

    10.2 M parameters, tied embeddings: 19.4 MiB in bf16, saved in shards under the 15 MiB per-file budget. (The
    first shipped target, 2026-11-29, was hidden 256 with experts of width 32 and a shared expert of 128: 7.1 M.)
    """
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        max_position_embeddings=2048, tie_word_embeddings=True, router_aux_loss_coef=1e-3,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None,
    )


def random_windows(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, batch_size: int, device, autocast,
                 max_windows: int | None = None) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of the held-out stream, and tokens scored."""
    model.eval()
    n = stream.numel() // seq_len
    if max_windows:
        n = min(n, max_windows)
    windows = stream[: n * seq_len].view(n, seq_len).long()
    total, count = 0.0, 0
    for i in range(0, n, batch_size):
        x = windows[i:i + batch_size].to(device)
        with autocast():
            logits = model(input_ids=x).logits
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += ce.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count, count


def choose_experts_implementation(model, x: torch.Tensor, autocast, preferred: list[str]) -> str:
    """The first experts implementation whose forward and backward run here (grouped_mm's backward may not exist)."""
    errors = {}
    for name in preferred:
        try:
            model.set_experts_implementation(name)
            with autocast():
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return name
        except Exception as e:  # noqa: BLE001 - any failure means: try the next implementation
            errors[name] = repr(e)[:300]
            model.zero_grad(set_to_none=True)
    raise RuntimeError(f"no experts implementation trains here: {errors}")


# ------------------------------------------------------------------------------------ unlikelihood fine-tuning
def repeated_ngram_mask(tokens: torch.Tensor, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: position t completes an n-gram tokens[t-n+1 : t+1] that already ended at an earlier position.

    Welleck et al. 2019 (sequence-level unlikelihood): these are the tokens of a repetition. Positions where
    `valid` is False (after an eos) neither count as repeats nor seed them.
    """
    batch, length = tokens.shape
    mask = torch.zeros(batch, length, dtype=torch.bool)
    rows = tokens.tolist()
    ok = valid.tolist() if valid is not None else [[True] * length] * batch
    for b, row in enumerate(rows):
        seen = set()
        for t in range(n - 1, length):
            if not ok[b][t]:
                break
            gram = tuple(row[t - n + 1:t + 1])
            if gram in seen:
                mask[b, t] = True
            else:
                seen.add(gram)
    return mask


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, eos_id: int, autocast) -> torch.Tensor:
    """Greedy continuations (B, new_tokens) of equal-length prompts; positions after the first eos hold eos."""
    was_training = model.training
    model.eval()
    with autocast():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                             pad_token_id=eos_id)
    model.train(was_training)
    return out[:, prompts.shape[1]:]


def after_eos(continuations: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) bool: True up to and including the first eos, False after it."""
    hit = (continuations == eos_id).int().cumsum(1)
    return (hit == 0) | ((hit == 1) & (continuations == eos_id))


def unlikelihood_loss(model, prompts: torch.Tensor, continuations: torch.Tensor, n: int, eos_id: int,
                      autocast) -> tuple[torch.Tensor, float]:
    """Sequence-level unlikelihood: −Σ log(1 − p(x_t)) over the continuation's repeated-n-gram tokens / their count."""
    valid = after_eos(continuations, eos_id).cpu()
    mask = repeated_ngram_mask(continuations.cpu(), n, valid).to(continuations.device)
    ids = torch.cat([prompts, continuations], 1)
    with autocast():
        logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1:-1]
    prob = torch.softmax(logits.float(), -1).gather(-1, continuations.unsqueeze(-1)).squeeze(-1)
    penalty = -torch.log((1 - prob).clamp(min=1e-5))
    count = mask.sum()
    return (penalty * mask).sum() / count.clamp(min=1), count.item() / max(1, valid.sum().item())


def unlikelihood_finetune(model, optimizer, train_stream: torch.Tensor, heldout_stream: torch.Tensor, args, device,
                          autocast, generator: torch.Generator) -> list[dict]:
    """Fine-tune against greedy repetition loops for `args.ul_budget_s` seconds (Welleck et al. 2019, sequence level).

    Each round: `args.ul_prompts` training windows of `args.ul_prompt_len` tokens are continued greedily for
    `args.ul_new_tokens` tokens by the current model; then `args.ul_steps_per_round` updates, each on a slice of those
    continuations, minimise the language-model loss of a fresh training batch plus `args.ul_alpha` × the unlikelihood
    of the slice's repeated 4-grams. The rate (by the clock) warms up over the first 10 % of the budget to `args.ul_lr`
    and decays linearly to zero at its end.
    A round whose continuations already reach distinct-4 ≥ `args.ul_distinct_goal` takes language-model updates only.
    Logged per round: the repeated share and distinct-4 of the continuations, distinct-4 of greedy continuations of
    held-out windows and the held-out loss (never trained on; monitors, not training signals).
    """
    from hybridspec_hf.drafter.training import distinct_ngram_ratio

    eos_id = model.config.eos_token_id
    monitor = random_windows(heldout_stream, args.ul_monitor_prompts, args.ul_prompt_len,
                             torch.Generator().manual_seed(1)).to(device)
    log, start, update = [], time.perf_counter(), 0
    while time.perf_counter() - start < args.ul_budget_s:
        prompts = random_windows(train_stream, args.ul_prompts, args.ul_prompt_len, generator).to(device)
        continuations = greedy_continuations(model, prompts, args.ul_new_tokens, eos_id, autocast)
        held = greedy_continuations(model, monitor, args.ul_new_tokens, eos_id, autocast)
        entry = {"update": update, "elapsed_s": time.perf_counter() - start,
                 "distinct4_train": distinct_ngram_ratio(continuations.tolist(), 4),
                 "distinct4_heldout": distinct_ngram_ratio(held.tolist(), 4)}
        # a round whose continuations already reach the goal trains the language model alone (heals what the
        # unlikelihood updates cost it); the held-out loss is logged to show that trade
        alpha = args.ul_alpha if entry["distinct4_train"] < args.ul_distinct_goal else 0.0
        entry["alpha"] = alpha
        entry["heldout_loss"] = heldout_loss(model, heldout_stream, args.seq_len, args.batch_size, device, autocast,
                                             args.eval_windows)[0]
        per = max(1, args.ul_prompts // args.ul_steps_per_round)
        shares, lm_losses = [], []
        for s in range(0, args.ul_prompts, per):
            fraction = min(1.0, (time.perf_counter() - start) / args.ul_budget_s)
            for group in optimizer.param_groups:
                group["lr"] = args.ul_lr * min(1.0, fraction / 0.1) * (1 - fraction)
            ul, share = unlikelihood_loss(model, prompts[s:s + per], continuations[s:s + per], 4, eos_id, autocast)
            x = random_windows(train_stream, args.batch_size, args.seq_len, generator).to(device, non_blocking=True)
            with autocast():
                lm = model(input_ids=x, labels=x, output_router_logits=True).loss
            (lm + alpha * ul).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            shares.append(share)
            lm_losses.append(lm.item())
            update += 1
        entry.update(repeated_share=sum(shares) / len(shares), lm_loss=sum(lm_losses) / len(lm_losses))
        log.append(entry)
        print(json.dumps(entry), flush=True)
    return log


def train_target(args) -> dict:
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    use_bf16 = device.type == "cuda"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    corpus = load_file(args.data)
    train_stream, heldout_stream = corpus["train"], corpus["heldout"]
    if args.init_from:
        model = Qwen3_5MoeForCausalLM.from_pretrained(args.init_from, dtype=torch.float32).to(device)
    else:
        config = tiny_target_config(args.vocab_size, hidden_size=args.hidden_size,
                                    moe_intermediate_size=args.moe_intermediate_size,
                                    shared_expert_intermediate_size=args.shared_expert_intermediate_size,
                                    num_layers=args.num_layers)
        model = Qwen3_5MoeForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(args.seed)
    probe = random_windows(train_stream, min(args.batch_size, 4), args.seq_len, generator).to(device)
    experts_impl = choose_experts_implementation(model, probe, autocast, args.experts_implementation.split(","))
    print(f"target: {n_params / 1e6:.2f} M parameters, experts implementation {experts_impl}, device {device}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    total_steps = 0 if args.skip_pretraining else (args.steps or 10**9)
    log, evals = [], []
    tokens_seen, start = 0, time.perf_counter()
    step = 0
    while step < total_steps:
        lr = args.lr * warmup_cosine_lr(step, total_steps, args.warmup_steps, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x = random_windows(train_stream, args.batch_size, args.seq_len, generator).to(device, non_blocking=True)
        with autocast():
            out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_seen += x.numel()
        step += 1
        if step == args.calibration_steps and args.time_budget_s and not args.steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - start) / step
            total_steps = max(step + 1, int(args.time_budget_s / per_step))
            print(f"{per_step * 1e3:.1f} ms/step -> {total_steps} steps in the {args.time_budget_s:.0f} s budget")
        if step % args.log_every == 0 or step == total_steps:
            ce = (out.loss - model.config.router_aux_loss_coef * out.aux_loss).item()
            entry = {"step": step, "tokens": tokens_seen, "loss": ce, "aux_loss": out.aux_loss.item(), "lr": lr,
                     "grad_norm": grad_norm.item(), "elapsed_s": time.perf_counter() - start}
            log.append(entry)
            print(json.dumps(entry))
        if args.eval_every and step % args.eval_every == 0:
            loss, _ = heldout_loss(model, heldout_stream, args.seq_len, args.batch_size, device, autocast,
                                   args.eval_windows)
            evals.append({"step": step, "tokens": tokens_seen, "heldout_loss": loss})
        if args.time_budget_s and time.perf_counter() - start > 1.2 * args.time_budget_s:
            print(f"stopping at step {step}: past 1.2 × the time budget")
            break
    train_seconds = time.perf_counter() - start
    ul_log, ul_seconds, loss_before_ul = [], 0.0, None
    if args.ul_budget_s > 0:
        loss_before_ul, _ = heldout_loss(model, heldout_stream, args.seq_len, args.batch_size, device, autocast,
                                         args.heldout_max_windows or None)
        print(f"held-out loss before unlikelihood fine-tuning {loss_before_ul:.4f} nats", flush=True)
        ul_start = time.perf_counter()
        ul_log = unlikelihood_finetune(model, optimizer, train_stream, heldout_stream, args, device, autocast,
                                       generator)
        ul_seconds = time.perf_counter() - ul_start
    loss, scored = heldout_loss(model, heldout_stream, args.seq_len, args.batch_size, device, autocast,
                                args.heldout_max_windows or None)
    evals.append({"step": step, "tokens": tokens_seen, "heldout_loss": loss})

    out_dir = Path(args.out)
    model.config.use_cache = True
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.to(torch.bfloat16).save_pretrained(str(out_dir), max_shard_size=args.max_shard_size)
    meta = json.loads((Path(args.data).parent / "meta.json").read_text()) if (Path(args.data).parent / "meta.json").exists() else {}
    bytes_per_token = meta.get("bytes_per_token_train")
    result = {
        "parameters": n_params, "config": model.config.to_dict(), "experts_implementation": experts_impl,
        "recipe": {k: v for k, v in vars(args).items() if k not in ("out", "data")},
        "steps": step, "tokens_seen": tokens_seen, "train_seconds": train_seconds,
        "tokens_per_second": tokens_seen / train_seconds, "epochs": tokens_seen / train_stream.numel(),
        "train_stream_tokens": train_stream.numel(), "heldout_tokens_scored": scored,
        "heldout_loss_nats": loss, "heldout_perplexity": math.exp(loss),
        "heldout_bits_per_byte_approx": (loss / math.log(2) / bytes_per_token) if bytes_per_token else None,
        "loss_curve": log, "heldout_curve": evals,
        "heldout_loss_before_unlikelihood": loss_before_ul, "unlikelihood_seconds": ul_seconds,
        "unlikelihood_log": ul_log,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    log_path = Path(args.log or out_dir.parent / "target_log.json")
    log_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"held-out loss {loss:.4f} nats, perplexity {math.exp(loss):.2f}, {tokens_seen / 1e6:.1f} M tokens "
          f"in {train_seconds:.0f} s")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=str(REPO / ".data" / "tiny_pair" / "corpus.safetensors"))
    parser.add_argument("--out", required=True, help="folder for the trained target (bf16 safetensors + config)")
    parser.add_argument("--log", default=None, help="JSON log path (default: <out>/../target_log.json)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --time-budget-s)")
    parser.add_argument("--time-budget-s", type=float, default=240.0)
    parser.add_argument("--calibration-steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows of the periodic evaluation")
    parser.add_argument("--heldout-max-windows", type=int, default=0, help="0 = the whole held-out stream")
    parser.add_argument("--experts-implementation", default="grouped_mm,eager,batched_mm")
    parser.add_argument("--hidden-size", type=int, default=320)
    parser.add_argument("--moe-intermediate-size", type=int, default=40)
    parser.add_argument("--shared-expert-intermediate-size", type=int, default=160)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--init-from", default=None, help="start from this trained target instead of random weights")
    parser.add_argument("--skip-pretraining", action="store_true", help="only the unlikelihood stage (with --init-from)")
    parser.add_argument("--max-shard-size", default="14MB", help="safetensors shard size (15 MiB per-file budget)")
    ul = parser.add_argument_group("unlikelihood fine-tuning (after pre-training; 0 s = none)")
    ul.add_argument("--ul-budget-s", type=float, default=0.0)
    ul.add_argument("--ul-prompts", type=int, default=256, help="greedy continuations per round")
    ul.add_argument("--ul-prompt-len", type=int, default=64)
    ul.add_argument("--ul-new-tokens", type=int, default=128)
    ul.add_argument("--ul-steps-per-round", type=int, default=4)
    ul.add_argument("--ul-alpha", type=float, default=1.0)
    ul.add_argument("--ul-distinct-goal", type=float, default=0.72,
                    help="rounds whose continuations reach this distinct-4 take language-model updates only")
    ul.add_argument("--ul-lr", type=float, default=3e-4)
    ul.add_argument("--ul-monitor-prompts", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    train_target(p.parse_args())
