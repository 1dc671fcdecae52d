"""``bench/ngram_corpus_variants.py``: ngram-corpus settings side by side with greedy and
n-gram; bad settings are refused before anything loads."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script, refusal


@pytest.fixture(scope="module")
def script():
    return load_bench_script("ngram_corpus_variants")


@pytest.mark.parametrize(
    "flag,value",
    [("--weights", "1,-2"), ("--min-counts", "0"), ("--max-orders", "0"), ("--max-orders", "3,6")],
)
def test_bad_settings_are_refused(script, tmp_path, capsys, flag, value):
    assert flag in refusal(script, [flag, value], tmp_path, capsys)


def test_an_extra_corpus_that_is_not_one_is_refused(script, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    message = refusal(script, ["--extra-corpus", str(tmp_path / "empty")], tmp_path, capsys)
    assert "--extra-corpus" in message and "no manifest.json" in message


@pytest.mark.slow  # the real teacher, three methods on one turn
def test_variants_run_beside_greedy_and_stay_identical(script, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--suite", "humaneval", "--per-category", "1", "--max-new-tokens", "12"]
    assert script.main([*argv, "--weights", "0,1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {"greedy", "ngram", "ngram-corpus:w=0", "ngram-corpus:w=1"}
    assert all(s["identical_fraction"] == 1.0 for s in summary.values())
    assert report["ngram_corpus_variants"]["weights"] == [0.0, 1.0]
