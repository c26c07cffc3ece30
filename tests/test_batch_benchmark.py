"""benchmarks/batch.py (the batched H200 benchmark) runs through on the tiny model (CPU)."""
import json

import pytest


@pytest.fixture
def batch_benchmark(benchmarks):
    import batch

    return batch


def test_every_method_batch_and_profile_is_measured_and_written(batch_benchmark, tmp_path, cpu_only):
    stem = tmp_path / "batch_tiny"
    batch_benchmark.main(["--model", "tiny", "--batches", "1,3", "--profiles", "high,low", "--tokens", "6",
                          "--context", "8", "--name", str(stem)])
    report = json.loads(stem.with_suffix(".json").read_text())
    assert set(report["batches"]) == {"1", "3"} and report["latency_ms"].keys() == {"1", "3"}
    for batch, profiles in report["batches"].items():
        assert set(profiles) == {"high", "low"}
        for label, entry in profiles.items():
            assert entry["profile"] == batch_benchmark.PROFILES[label]
            methods = entry["methods"]
            assert set(methods) == {"ar", "dflash", "hybridspec"}
            for method, row in methods.items():
                assert row["new_tokens_per_row"] == 6 and row["tokens_per_s"] > 0
                # GPU-resident rounds (their CPU twin here); the profiles replayed per row
                assert row["path"] == "static_eager", row["path_reason"]
            assert methods["dflash"]["mean_w"] > methods["ar"]["mean_w"] == 1.0
    high = report["batches"]["3"]["high"]["methods"]["dflash"]["tau"]
    low = report["batches"]["3"]["low"]["methods"]["dflash"]["tau"]
    assert high > low  # the declared profiles' acceptance, replayed per row
    text = stem.with_suffix(".md").read_text()
    assert "HybridSpec over vanilla DFlash" in text and "| 3 | low" in text
    assert stem.with_suffix(".png").exists()


def test_runs_split_over_calls_merge_into_one_table_and_other_machines_do_not(batch_benchmark, tmp_path, cpu_only):
    stems = [tmp_path / "split_a", tmp_path / "split_b"]
    for stem, batches in zip(stems, ("2", "1")):
        batch_benchmark.main(["--model", "tiny", "--batches", batches, "--profiles", "low", "--methods", "ar,dflash",
                              "--tokens", "4", "--context", "8", "--name", str(stem)])
    merged = tmp_path / "merged"
    sources = ",".join(str(s.with_suffix(".json")) for s in stems)
    batch_benchmark.main(["--merge", sources, "--name", str(merged)])
    report = json.loads(merged.with_suffix(".json").read_text())
    assert list(report["batches"]) == ["1", "2"] and list(report["latency_ms"]) == ["1", "2"]
    for batch, stem in (("2", stems[0]), ("1", stems[1])):
        source = json.loads(stem.with_suffix(".json").read_text())
        assert report["batches"][batch] == source["batches"][batch]
    assert [m["batches"] for m in report["merged_from"]] == [["2"], ["1"]]
    assert [m["file"] for m in report["merged_from"]] == sources.split(",")
    assert report["environment"]["command"].count(";") == 1  # both sources' commands (with their dates)
    text = merged.with_suffix(".md").read_text()
    assert "| 1 | low" in text and "| 2 | low" in text and merged.with_suffix(".png").exists()
    other = json.loads(stems[1].with_suffix(".json").read_text())
    other["environment"]["torch"] = "0.0"
    stems[1].with_suffix(".json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="ran elsewhere"):
        batch_benchmark.main(["--merge", sources, "--name", str(tmp_path / "refused")])
    with pytest.raises(SystemExit, match="needs --name"):
        batch_benchmark.main(["--merge", sources])


def test_results_names_land_where_the_commands_say(batch_benchmark, tmp_path):
    """A bare stem and a path under benchmarks/results (as earlier commands wrote it, from the repository root or
    elsewhere) land under benchmarks/results, once (run 89 lost its results to benchmarks/results joined twice);
    another path lands where it says."""
    from common import RESULTS, results_path

    assert results_path("batch_b1") == RESULTS / "batch_b1"
    assert results_path("benchmarks/results/batch_b1") == RESULTS / "batch_b1"
    assert results_path("benchmarks/results/batch_b1.json") == RESULTS / "batch_b1"
    assert results_path(str(tmp_path / "x" / "run.md")) == tmp_path / "x" / "run"


def test_results_read_plain_or_compressed_and_by_their_old_name(batch_benchmark, tmp_path):
    """Results over 100 KB are committed as .json.gz; a command naming "x.json" (as it ran) still reads "x.json.gz",
    a plain file is read as it is, and a name that is neither is an error naming it."""
    import gzip

    from common import read_json

    payload = {"rows": [{"us": 1.5, "kernel": "gate_up"}], "title": "t"}
    (tmp_path / "plain.json").write_text(json.dumps(payload))
    with gzip.open(tmp_path / "packed.json.gz", "wt") as handle:
        json.dump({**payload, "title": "packed"}, handle)
    assert read_json(tmp_path / "plain.json") == payload
    assert read_json(tmp_path / "packed.json.gz")["title"] == "packed"
    assert read_json(str(tmp_path / "packed.json"))["title"] == "packed"
    with pytest.raises(FileNotFoundError, match="missing.json"):
        read_json(tmp_path / "missing.json")


def test_round_kernels_prices_plain_steps_as_ar_steps_and_keeps_the_rest(benchmarks):
    """benchmarks/round_kernels.py: a drafted round's kernels are the call's less its plain steps at AR's per-step
    kernels, over the drafted rounds; names only the plain steps launch cancel out."""
    import round_kernels

    ar_step = {"gemv": {"count": 4.0, "us": 8.0}, "tail": {"count": 1.0, "us": 2.0}}
    call = {"gemv": {"count": 4 * 10 + 6 * 3, "us": 8.0 * 10 + 30.0 * 3},  # 10 plain steps, 3 drafted rounds
            "tail": {"count": 10.0, "us": 20.0}, "decide": {"count": 6.0, "us": 9.0}}
    rounds = round_kernels.per_round(call, ar_step, plain=10, drafted=3)
    assert rounds == {"gemv": {"count": 6.0, "us": 30.0}, "decide": {"count": 2.0, "us": 3.0}}


def test_large_results_are_written_compressed_and_replace_the_other_form(batch_benchmark, tmp_path, monkeypatch):
    """A payload past COMPRESS_OVER characters lands as .json.gz (no stale .json beside it), a small one as .json (no
    stale .json.gz); read_json reads either back equal to the payload."""
    import common
    from common import read_json, write_results

    monkeypatch.setattr(common, "COMPRESS_OVER", 2_000)
    stem = tmp_path / "run"
    env = {"date": "2026-12-06", "gpu": "none"}
    small = {"title": "t", "environment": env, "rows": [1.5, 2.5]}
    large = {"title": "t", "environment": env, "rows": [float(i) / 7 for i in range(400)]}
    write_results(str(stem), large, "| a |")
    assert stem.with_suffix(".json.gz").exists() and not stem.with_suffix(".json").exists()
    assert read_json(stem.with_suffix(".json")) == large and stem.with_suffix(".md").read_text().startswith("# t")
    write_results(str(stem), small, "| a |")
    assert stem.with_suffix(".json").exists() and not stem.with_suffix(".json.gz").exists()
    assert read_json(stem.with_suffix(".json")) == small
