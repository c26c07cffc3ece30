"""What a new user runs first: the README's quickstart, the examples, the exploration notebook and the cloud-GPU
notebook (its cells against the shipped tiny pair, model ids swapped), all on the CPU as they are."""
import ast
import importlib.util
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from hybridspec_hf.generation.calibration import cache_key, cache_path, calibrate_latency
from hybridspec_hf.tiny_pair import ASSETS_DIR, load_tiny_pair

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def calibrated_tiny_pair():
    """The tiny pair with a quick latency calibration in the cache generate() reads (the tests' HYBRIDSPEC_CACHE),
    so that the first calibrated generate() does not calibrate at full length inside every test."""
    target, drafter, tokenizer = load_tiny_pair()
    key = cache_key(target, drafter, "auto")
    path = cache_path(key)
    if not path.exists():
        model = calibrate_latency(target, drafter, context_lens=(64,), repeats=1, progress=False)
        model.key = key
        model.save(path)
    return target, drafter, tokenizer


def readme_quickstart() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## Quickstart\n.*?^```python\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no ```python block under '## Quickstart'"
    return match.group(1)


def test_readme_starts_with_the_two_setup_commands_and_stays_inside_the_repository():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.startswith("```bash\nbash scripts/demo.sh") and "bash scripts/test.sh" in text.split("```")[1]
    assert "../" not in text and "DESIGN.md" not in text


def test_readme_quickstart_runs_as_pasted(calibrated_tiny_pair, capsys):
    exec(compile(readme_quickstart(), "README.md quickstart", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "identical to AR: True" in out and "tokens/round" in out


EXAMPLES = {
    "generate_streaming.py": ["--max-new-tokens", "24"],
    "calibrate_and_cache.py": ["--context", "64", "--repeats", "1"],  # the fixture's cache exists: reads it
    "benchmark.py": ["--num-prompts", "1", "--max-new-tokens", "24"],
    "train_drafter.py": ["--steps", "2", "--num-prompts", "4", "--max-new-tokens", "12", "--batch-size", "2"],
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_on_the_tiny_pair(script, calibrated_tiny_pair, tmp_path, monkeypatch, capsys):
    argv = [script, "--threads", "1", *EXAMPLES[script]]
    if script == "train_drafter.py":
        argv += ["--output-dir", str(tmp_path / "drafter")]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    out = capsys.readouterr().out
    assert "tokens/round" in out or "tokens/s" in out
    if script == "generate_streaming.py":
        assert "identical to autoregressive decoding: True" in out
    if script == "train_drafter.py":
        assert (tmp_path / "drafter" / "model.safetensors").exists()


def test_exploration_notebook_is_committed_without_outputs_and_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = ROOT / "notebooks" / "explore_hybridspec.ipynb"
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), "clear the outputs before committing"
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors
    text = "".join(o.get("text", "") for cell in code for o in cell.outputs if o.output_type == "stream")
    assert text.count("identical to AR: True") == 3


COLAB = ROOT / "examples" / "colab_qwen35_35b_a3b.ipynb"


def colab_cells() -> list[dict]:
    return [c for c in json.loads(COLAB.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]


def test_colab_notebook_parses_and_its_imports_exist():
    TransformerManager = pytest.importorskip(  # the dev extra has IPython; the GPU image has not
        "IPython.core.inputtransformer2").TransformerManager

    modules = set()
    for cell in colab_cells():
        tree = ast.parse(TransformerManager().transform_cell("".join(cell["source"])))  # `!pip` lines included
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                modules.add(node.module)
    assert {"torch", "transformers", "hybridspec_hf"} <= {m.split(".")[0] for m in modules}
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module


def test_colab_notebook_cells_run_on_the_tiny_pair(calibrated_tiny_pair, capsys):
    import matplotlib

    matplotlib.use("Agg")
    tiny = {"TARGET": str(ASSETS_DIR / "target"), "DRAFTER": str(ASSETS_DIR / "drafter"),
            "TOKENIZER": str(ASSETS_DIR / "tokenizer"), "DEVICE": "cpu", "DTYPE": torch.float32,
            "CALIBRATION_CONTEXTS": (64,), "CALIBRATION_REPEATS": 1, "MAX_NEW_TOKENS": 24,
            "PROMPT": "def read_file(path):\n"}
    namespace = {"__name__": "__main__"}
    for cell in colab_cells():
        tags = cell.get("metadata", {}).get("tags", [])
        if "install" in tags:
            continue
        exec(compile("".join(cell["source"]), "colab notebook cell", "exec"), namespace)
        if "parameters" in tags:
            assert set(tiny) <= set(namespace), "the parameters cell names changed"
            namespace.update(tiny)
    out = capsys.readouterr().out
    assert out.count("identical to AR: True") == 3
