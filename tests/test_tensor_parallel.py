"""HybridSpec on transformers' tensor parallelism (tp_plan="auto"): 2 CPU processes over gloo, every strategy's
output equal to single-process generate(). GDN layers stay replicated under the stock plan; each rank commits its
own replica, and calibrated strategies share one averaged latency model so that the ranks decide alike."""
import os
import subprocess
import sys

import pytest
import torch
from _tiny import _ATTN_LAST, _COMMON, _MOE
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def test_tensor_parallel_matches_single_process_generate(tmp_path):
    config = Qwen3_5MoeTextConfig(**{**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2}, **_MOE,
                                  layer_types=_ATTN_LAST)
    torch.manual_seed(0)
    Qwen3_5MoeForCausalLM(config).save_pretrained(tmp_path / "model")
    env = {**os.environ, "HYBRIDSPEC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(os.path.dirname(__file__), "tp_worker.py"), str(tmp_path / "model"), str(tmp_path),
               "dflash", "static", "confidence", "nominal", "hybridspec"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    verdicts = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert all(v.startswith("MATCH") for v in verdicts), verdicts
