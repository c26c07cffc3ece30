"""One rank of the tensor-parallel test (tests/test_tensor_parallel.py runs two through torch.distributed.run).

    python -m torch.distributed.run --nproc_per_node 2 tests/tp_worker.py MODEL_DIR OUT_DIR {cpu,cuda} STRATEGY...

CPU: gloo; CUDA: NCCL, each rank on its own GPU. The target is loaded twice: sharded (tp_plan="auto") and whole in
this process alone (no collectives), and every call gets the prompt on the CPU, as stock generate() takes it. For
each strategy, both loops (the eager one and GPU-resident rounds: captured in CUDA graphs on CUDA, uncaptured on the
CPU) must return the single-process generate() output. The drafter is steered towards that output (wrong at random
positions, seeded alike on both ranks), so rounds accept drafts. Writes OUT_DIR/rank{R}.json after every case, so a
hang or a crash leaves what ran (the ranks share stdout)."""
import json
import os
import sys
import time
import traceback

import torch
from _tiny import OracleDrafter
from transformers import Qwen3_5MoeForCausalLM

import hybridspec_hf
from hybridspec_hf import HybridSpecConfig

PROMPTS = 2
NEW_TOKENS = 24


def main(path: str, out_dir: str, device: str, strategies: list[str]) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cudnn.allow_tf32 = False  # fp32 comparisons: the GDN conv would otherwise run in TF32
        torch.backends.cuda.matmul.allow_tf32 = False
    sharded = Qwen3_5MoeForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    single = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).to(sharded.device)
    if device == "cuda":  # capturable in fp32 (grouped_mm is not)
        for model in (sharded, single):
            model.set_experts_implementation("batched_mm")
    report = {"rank": rank, "device": str(sharded.device), "backend": torch.distributed.get_backend(), "cases": []}
    out = os.path.join(out_dir, f"rank{rank}.json")

    def record(case: dict | None = None) -> None:
        if case is not None:
            report["cases"].append(case)
        with open(out, "w") as handle:
            json.dump(report, handle, indent=1)

    for seed in range(PROMPTS):
        prompt = torch.randint(0, 96, (1, 5 + 9 * seed), generator=torch.Generator().manual_seed(seed))  # CPU
        reference = single.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)
        stock = sharded.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)
        record({"seed": seed, "strategy": "stock generate()", "match": torch.equal(stock, reference)})
        torch.manual_seed(1)
        drafter = OracleDrafter.from_target(sharded, num_layers=1, block_size=8, target_layer_ids=[0, 2]).float()
        for strategy in strategies:
            for cuda_graphs in ("off", "on"):
                case = {"seed": seed, "strategy": strategy, "cuda_graphs": cuda_graphs}
                start = time.perf_counter()
                try:
                    torch.manual_seed(seed)  # the drafter's steering draws alike on both ranks
                    drafter.steer(reference, error_rate=0.25, seed=seed)
                    result = sharded.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS,
                                              assistant_model=None if strategy == "ar" else drafter,
                                              generation_strategy=strategy,
                                              hybridspec_config=HybridSpecConfig(cuda_graphs=cuda_graphs))
                    telemetry = hybridspec_hf.get_telemetry(sharded)
                    case.update(match=torch.equal(result, reference), output_device=str(result.device),
                                path=telemetry.path, path_reason=telemetry.path_reason, rounds=len(telemetry.rounds),
                                accepted=sum(r.accepted for r in telemetry.rounds))
                except Exception as error:  # noqa: BLE001 - reported in the file; the test fails on it
                    case.update(match=False, error=f"{type(error).__name__}: {error}",
                                traceback=traceback.format_exc()[-3000:])
                case["seconds"] = round(time.perf_counter() - start, 3)
                record(case)
    report["done"] = True
    record()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
