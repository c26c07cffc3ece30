"""One rank of the tensor-parallel test (run by tests/test_tensor_parallel.py through torch.distributed.run)."""
import os
import sys

import torch
from transformers import Qwen3_5MoeForCausalLM

import hybridspec_hf
from hybridspec_hf import DFlashDrafter


def main(path: str, out_dir: str, strategies: list[str]) -> None:
    """Writes out_dir/rank{R}.txt: MATCH or DIFFER (files, since the ranks share stdout)."""
    torch.set_num_threads(1)
    sharded = Qwen3_5MoeForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    single = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32)  # this process alone, no collectives
    torch.manual_seed(1)
    drafter = DFlashDrafter.from_target(sharded, num_layers=1, block_size=8, target_layer_ids=[0, 2]).float()
    results = []
    for seed in range(2):
        prompt = torch.randint(0, 96, (1, 5 + 9 * seed), generator=torch.Generator().manual_seed(seed))
        reference = single.generate(prompt, do_sample=False, max_new_tokens=16)
        results.append(torch.equal(sharded.generate(prompt, do_sample=False, max_new_tokens=16), reference))
        for strategy in strategies:
            out = sharded.generate(prompt, do_sample=False, max_new_tokens=16, assistant_model=drafter,
                                   generation_strategy=strategy)
            results.append(torch.equal(out, reference))
    rounds = len(hybridspec_hf.get_telemetry(sharded).rounds)
    verdict = f"{'MATCH' if all(results) else 'DIFFER'} {results} rounds={rounds}"
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.txt"), "w") as handle:
        handle.write(verdict)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
