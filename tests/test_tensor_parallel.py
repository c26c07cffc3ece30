"""HybridSpec on transformers' tensor parallelism (tp_plan="auto"), two ranks: over gloo on the CPU (always) and
over NCCL on two GPUs (skipped without them). Every strategy, in the eager loop and in GPU-resident rounds
(captured on CUDA), must return single-process generate()'s output for a prompt given on the CPU, as stock
generate() takes it. The stock plan gathers the GDN projections' outputs, so the recurrence runs replicated and each
rank commits its own replica; calibrated strategies share one rank-averaged latency model so that the ranks decide
alike. The drafter is steered towards the reference, so that rounds accept drafts (tests/tp_worker.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiny import _ATTN_LAST, _COMMON, _MOE
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

STRATEGIES = ["ar", "dflash", "static", "confidence", "nominal", "hybridspec", "ratio"]
ROOT = Path(__file__).resolve().parents[1]
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not TWO_GPUS, reason="needs 2 CUDA devices (NCCL)"))])
def test_tensor_parallel_matches_single_process_generate(tmp_path, device):
    config = Qwen3_5MoeTextConfig(**{**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2}, **_MOE,
                                  layer_types=_ATTN_LAST)
    torch.manual_seed(0)
    Qwen3_5MoeForCausalLM(config).save_pretrained(tmp_path / "model")
    env = {**os.environ, "HYBRIDSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),  # this checkout's package
           "NCCL_NVLS_ENABLE": "0"}  # no NVLink multicast (NVLS) on lent machines
    if device == "cpu":  # transformers' tensor parallelism takes the accelerator when it sees one
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "tp_worker.py"), str(tmp_path / "model"), str(tmp_path), device, *STRATEGIES]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)
               if (tmp_path / f"rank{rank}.json").exists()]
    failed = [dict(c, rank=r["rank"]) for r in reports for c in r["cases"] if not c["match"]]
    assert run.returncode == 0 and len(reports) == 2 and all(r.get("done") for r in reports), \
        (failed, run.stderr[-3000:])
    assert not failed, failed
    for report in reports:
        cases = [c for c in report["cases"] if c.get("cuda_graphs")]
        assert len(cases) == 2 * 2 * len(STRATEGIES)
        resident = "cuda_graphs" if device == "cuda" else "static_eager"
        assert all(c["path"] == (resident if c["cuda_graphs"] == "on" else "eager") for c in cases), cases
        assert all(c["output_device"] == "cpu" for c in cases)  # where the prompt was
        # the drafter's tokens were taken (the calibrated strategies may find plain decoding pays on a CPU)
        assert all(c["accepted"] > 0 for c in cases if c["strategy"] in ("dflash", "static", "confidence"))
