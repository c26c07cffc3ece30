"""The `hybridspec` command: complete help, exit statuses, and a calibration that never silently replaces a good
cache by an implausible one; plus the hint after transformers' refusal of assistant_model= alone."""
import argparse
import json

import pytest
import torch

from hybridspec_hf import cli
from hybridspec_hf.selector import LatencyModel
from hybridspec_hf.tiny_pair import ASSETS_DIR


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_and_option_is_described():
    for name, parser in subparsers().items():
        assert parser.description and len(parser.description) > 80, name
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"
        assert "(default: " in parser.format_help(), name


def latency_model(scale: float = 1.0) -> LatencyModel:
    cost = torch.tensor([[1.0, 1.1, 1.2, 1.3]]) * scale
    return LatencyModel(cost=cost, cost_ar=torch.tensor([0.9 * scale]), context_lens=torch.tensor([64]))


def test_median_of_passes_ignores_one_stalled_pass():
    passes = [latency_model(1.0), latency_model(6.0), latency_model(1.02)]  # the machine stalled during pass 2
    model = cli.median_of_passes(passes)
    torch.testing.assert_close(model.cost, latency_model(1.02).cost)
    assert cli.relative_spread(passes, model) > 4.0  # and the disagreement is reported


def calibrate(tmp_path, *extra) -> int:
    return cli.main(["calibrate", "--random", "--threads", "1", "--context", "32", "--repeats", "1", "--passes", "1",
                     "--output", str(tmp_path / "latency.json"), *extra])


def test_calibrate_keeps_a_cached_calibration_that_the_new_one_contradicts(tmp_path, capsys):
    assert calibrate(tmp_path, "--force") == 0  # a first calibration (forced: this machine may be busy)
    path = tmp_path / "latency.json"
    data = json.loads(path.read_text())
    data["cost"]["data"] = [[c * 10 for c in row] for row in data["cost"]["data"]]  # 10× slower than now
    path.write_text(json.dumps(data))
    before = path.read_text()
    assert calibrate(tmp_path) == cli.EXIT_REFUSED
    assert path.read_text() == before and (tmp_path / "latency.rejected.json").exists()
    assert "--force" in capsys.readouterr().err
    assert calibrate(tmp_path, "--force", "--batch-sizes", "1", "2") == 0 and path.read_text() != before
    assert json.loads(path.read_text())["batch_sizes"]["data"] == [1, 2]  # C_2(w) timed too
    assert "batch 2, context 32" in capsys.readouterr().out


def test_calibrate_needs_both_target_and_drafter():
    with pytest.raises(SystemExit, match="--drafter"):
        cli.main(["calibrate", "--target", "some/model"])


def test_train_drafter_exits_zero_after_saving(tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(2)))
    status = cli.main(["train-drafter", "--target", str(ASSETS_DIR / "target"), "--tokenizer",
                       str(ASSETS_DIR / "tokenizer"), "--prompts", str(tmp_path / "prompts.jsonl"), "--output-dir",
                       str(tmp_path / "out"), "--steps", "1", "--batch-size", "2", "--num-anchors", "2",
                       "--block-size", "4", "--max-new-tokens", "6"])
    assert status == 0 and (tmp_path / "out" / "model.safetensors").exists()
    assert "Drafter saved" in capsys.readouterr().out


def test_the_shipped_drafter_without_generation_strategy_is_refused_with_what_to_pass():
    from hybridspec_hf.tiny_pair import load_tiny_pair

    target, drafter, _ = load_tiny_pair()
    with pytest.raises(ValueError, match="generation_strategy='hybridspec'"):
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=drafter, max_new_tokens=2)
