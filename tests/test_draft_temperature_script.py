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


def _report(path, checkpoints, pooled):
    summary = {"greedy": {"overall_accepted_length": 1.0}}
    for t, value in pooled.items():
        summary[f"eagle3#0@T{t:g}"] = {"overall_accepted_length": value}
    info = {"suite": "dev", "per_category": 1, "temperatures": list(pooled)}
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
