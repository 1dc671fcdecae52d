"""``bench/draft_temperature.py --calibrate-from``: the report's best temperature (pooled
accepted length; ties go to the smaller change) lands in the head's export JSON, which is
otherwise kept; reports it cannot use are refused by name."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script


@pytest.fixture(scope="module")
def script():
    return load_bench_script("draft_temperature")


def _report(path, checkpoints, pooled, **tree):
    summary = {"greedy": {"overall_accepted_length": 1.0}}
    for t, value in pooled.items():
        summary[f"eagle3#0@T{t:g}"] = {"overall_accepted_length": value}
    info = {"suite": "dev", "per_category": 1, "temperatures": list(pooled), **tree}
    path.write_text(
        json.dumps({"summary": summary, "draft_temperature": {**info, "checkpoints": checkpoints}})
    )
    return path


def test_the_best_pooled_temperature_is_written_into_the_export(script, tmp_path):
    export = tmp_path / "head"
    export.with_suffix(".json").write_text(json.dumps({"step": 7, "config": {"a": 1}}))
    report = _report(tmp_path / "r.json", [str(export)], {1.0: 1.9, 2.0: 2.05, 3.0: 2.05})
    assert script.main(["--calibrate-from", str(report), "--checkpoint", str(export)]) == 0
    meta = json.loads(export.with_suffix(".json").read_text())
    assert meta["step"] == 7 and meta["config"] == {"a": 1}
    assert meta["calibration"]["depth_temperature"] == [2.0]  # tie with 3: the smaller
    assert meta["calibration"]["pooled_accepted_length"] == {"1": 1.9, "2": 2.05, "3": 2.05}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.json", "r.json"]


def test_a_temperature_for_one_tree_size_lands_beside_the_one_for_every_size(
    script, tmp_path, capsys
):
    export = tmp_path / "head"
    export.with_suffix(".json").write_text(json.dumps({"step": 7}))
    every = _report(tmp_path / "b8.json", [str(export)], {2.0: 2.0, 3.0: 2.1}, budget=8, depth=6)
    small = _report(tmp_path / "b3.json", [str(export)], {2.0: 1.8, 3.0: 1.7}, budget=3, depth=3)
    head = ["--checkpoint", str(export)]
    assert script.main(["--calibrate-from", str(small), "--for-budget", *head]) == 0
    assert script.main(["--calibrate-from", str(every), *head]) == 0  # keeps the size's entry
    calibration = json.loads(export.with_suffix(".json").read_text())["calibration"]
    assert calibration["depth_temperature"] == [3.0] and calibration["budget"] == 8
    entry = calibration["by_budget"]["3"]
    assert entry["depth_temperature"] == [2.0] and (entry["budget"], entry["depth"]) == (3, 3)
    assert entry["pooled_accepted_length"] == {"2": 1.8, "3": 1.7}
    # What the loader makes of it: 3 nodes at 2, larger trees at 3.
    from eaglepangu_jax.drafters import eagle3

    params = eagle3.with_calibration({}, calibration)
    assert [float(eagle3.depth_temperature_for(params, b)[0]) for b in (2, 3, 4)] == [2, 2, 3]
    # A report that does not say which tree it ran cannot give a per-size entry.
    unsized = _report(tmp_path / "old.json", [str(export)], {2.0: 1.8})
    with pytest.raises(SystemExit):
        script.main(["--calibrate-from", str(unsized), "--for-budget", *head])
    assert "does not record the tree" in capsys.readouterr().err


def test_unusable_reports_are_refused(script, tmp_path, capsys):
    two = _report(tmp_path / "two.json", ["a", "b"], {1.0: 1.9})
    other = _report(tmp_path / "other.json", ["runs/x"], {1.0: 1.9})
    (tmp_path / "bad.json").write_text("{}")
    for report, message in (
        (two, "several heads"),
        (other, "name it with --checkpoint"),
        (tmp_path / "bad.json", "not a draft_temperature report"),
    ):
        with pytest.raises(SystemExit):
            script.main(["--calibrate-from", str(report)])
        assert message in capsys.readouterr().err


def test_a_negative_conversation_count_is_refused(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(["--per-category", "-1", "--json", str(tmp_path / "r.json")])
    assert exc.value.code == 2 and "--per-category must be >= 0" in capsys.readouterr().err
