"""benchmarks/stock_assisted.py: transformers' own prompt-lookup decoding against its greedy AR, run through on one
short prompt (transformers >= 5.25: older versions refuse assisted decoding for these targets, and the script says
so), with the extra-state switch restored afterwards."""
import json

import pytest
from transformers import Qwen3_5MoeForCausalLM, cache_utils


@pytest.fixture
def stock_assisted(benchmarks):
    import stock_assisted

    return stock_assisted


def test_runs_through_and_restores_the_cache_class(stock_assisted, tmp_path):
    stem = tmp_path / "stock"
    argv = ["--prompts", "1", "--tokens", "6", "--keep-extra", "1", "--threads", "1", "--allow-imported",
            "--name", str(stem)]
    if getattr(Qwen3_5MoeForCausalLM, "_is_stateful", False):
        with pytest.raises(SystemExit, match="refuses assisted decoding"):
            stock_assisted.main(argv)
        return
    before = cache_utils.LinearAttentionCacheLayerMixin.activate_past_recording
    stock_assisted.main(argv)
    assert cache_utils.LinearAttentionCacheLayerMixin.activate_past_recording is before
    runs = json.loads(stem.with_suffix(".json").read_text())["runs"]
    assert list(runs) == ["as transformers runs it", "1 more state(s) kept"]
    assert all(len(rows) == 1 and isinstance(rows[0]["identical"], bool) for rows in runs.values())
    assert runs["1 more state(s) kept"][0]["identical"]  # one state more: exact
    assert "prompts identical to AR" in stem.with_suffix(".md").read_text()
