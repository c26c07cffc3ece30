"""Shared by the benchmark scripts: environment facts and result writing (JSON + markdown)."""
from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import transformers

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_results(name: str, payload: dict, table: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    env = payload["environment"]
    header = "\n".join(f"- {k}: {v}" for k, v in env.items())
    (RESULTS / f"{name}.md").write_text(f"# {payload['title']}\n\n{header}\n\n{payload.get('notes', '')}\n\n{table}\n")
