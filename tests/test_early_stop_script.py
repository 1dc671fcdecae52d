"""``bench/early_stop.py``: EAGLE-3 with and without its early stop, side by side with
greedy; bad settings are refused before anything loads."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script, refusal


@pytest.fixture(scope="module")
def script():
    return load_bench_script("early_stop")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--per-category", "-1"], "--per-category"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--policy", "drafter"], "--policy"),
    ],
)
def test_bad_settings_are_refused(script, tmp_path, capsys, argv, needle):
    assert needle in refusal(script, argv, tmp_path, capsys)


@pytest.mark.slow  # the real teacher, greedy and the shipped head twice on one turn
def test_both_variants_run_beside_greedy_and_stay_identical(script, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--suite", "humaneval", "--per-category", "1", "--max-new-tokens", "12"]
    assert script.main([*argv, "--policy", "best_first", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {"greedy", "eagle3", "eagle3/every-level"}
    assert all(s["identical_fraction"] == 1.0 for s in summary.values())
    # The same trees: the same rounds and accepted tokens.
    first, second = summary["eagle3"], summary["eagle3/every-level"]
    assert first["overall_accepted_length"] == second["overall_accepted_length"]
    assert report["early_stop"]["policy"] == "best_first"
    assert report["methods"]["eagle3"]["spec"]["budget"] == 8
