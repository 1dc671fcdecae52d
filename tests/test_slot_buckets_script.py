"""``bench/slot_buckets.py``: each drafter at the default verify sizes and at others, side by
side with greedy; bad settings are refused before anything loads."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script, refusal


@pytest.fixture(scope="module")
def script():
    return load_bench_script("slot_buckets")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--methods", "greedy"], "no drafter"),
        (["--methods", "nonsense"], "unknown method"),
        (["--methods", "transformers-pld"], "does not run in the engine"),
        (["--per-category", "-1"], "--per-category"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--sizes", "1,x"], "--sizes"),
        (["--sizes", "2,4"], "slot_buckets"),
        (["--sizes", "1,4,4"], "slot_buckets"),
    ],
)
def test_bad_settings_are_refused(script, tmp_path, capsys, argv, needle):
    assert needle in refusal(script, argv, tmp_path, capsys)


@pytest.mark.slow  # the real teacher, greedy and two n-gram variants on one turn
def test_both_ladders_run_beside_greedy_and_stay_identical(script, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--suite", "humaneval", "--per-category", "1", "--max-new-tokens", "12"]
    assert script.main([*argv, "--methods", "ngram", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {"greedy", "ngram", "ngram/1-4"}
    assert all(s["identical_fraction"] == 1.0 for s in summary.values())
    methods = report["methods"]
    assert methods["ngram"]["spec"]["slot_buckets"] is None
    assert methods["ngram/1-4"]["spec"]["slot_buckets"] == [1, 4]
    assert report["slot_buckets"]["compared"] == ["ngram/1-4"]
    # The tree settings of `eaglepangu bench` with none given.
    assert methods["ngram"]["spec"]["budget"] == 8
