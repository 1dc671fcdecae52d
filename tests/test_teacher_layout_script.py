"""``bench/teacher_layout.py``: each drafter with and without the teacher's ``[out, in]``
weight copies, side by side with greedy; bad settings are refused before anything loads."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script, refusal

from eaglepangu_jax.models import llama


@pytest.fixture(scope="module")
def script():
    return load_bench_script("teacher_layout")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--methods", "greedy"], "no drafter"),
        (["--methods", "nonsense"], "unknown method"),
        (["--methods", "transformers-pld"], "does not run in the engine"),
        (["--per-category", "-1"], "--per-category"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--verify-slots", "1,x"], "--verify-slots"),
        (["--verify-slots", "0,4"], "--verify-slots"),
        (["--verify-slots", "4", "--repeats", "0"], "--repeats"),
    ],
)
def test_bad_settings_are_refused(script, tmp_path, capsys, argv, needle):
    assert needle in refusal(script, argv, tmp_path, capsys)


@pytest.mark.slow  # the real teacher, greedy and two n-gram variants on one turn
def test_both_layouts_run_beside_greedy_and_stay_identical(script, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--suite", "humaneval", "--per-category", "1", "--max-new-tokens", "12"]
    assert script.main([*argv, "--methods", "ngram", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {"greedy", "ngram", "ngram/in-out"}
    assert all(s["identical_fraction"] == 1.0 for s in summary.values())
    runner = report["methods"]["ngram/in-out"]["runner"]
    assert runner["teacher_layout"] == "prepared, [in, out] weights only"
    assert report["teacher_layout"]["without_copies"] == ["ngram/in-out"]
    # The tree settings of `eaglepangu bench` with none given.
    assert report["methods"]["ngram"]["spec"]["budget"] == 8


def test_the_copy_free_teacher_shares_the_weights():
    """The runner's teacher is built from the library teacher's params: same arrays, copies
    left out (no second set of [in, out] weights)."""
    import jax

    from eaglepangu_jax.engine.decode import Teacher
    from eaglepangu_jax.models.config import LlamaConfig
    from eaglepangu_jax.models.init import random_params

    cfg = LlamaConfig.tiny()
    with_copies = Teacher(cfg, random_params(cfg, jax.random.key(0)))
    plain = Teacher(cfg, with_copies.params, transposed_copy=False)
    assert llama.has_transposed_copy(with_copies.params)
    assert not llama.has_transposed_copy(plain.params)
    assert plain.params["layers"][0]["wq"] is with_copies.params["layers"][0]["wq"]


def test_verify_timing_reports_both_layouts_per_slot_count(script, tmp_path, capsys):
    """On a tiny random teacher (injected): every slot count timed for both teachers, with
    positive medians and their ratio; nothing generated."""
    import jax

    from eaglepangu_jax.engine.decode import Teacher
    from eaglepangu_jax.models.config import LlamaConfig
    from eaglepangu_jax.models.init import random_params

    cfg = LlamaConfig.tiny(max_position=512)
    teacher = Teacher(cfg, random_params(cfg, jax.random.key(1)))
    out = tmp_path / "v.json"
    argv = ["--verify-slots", "1,5", "--context", "8", "--repeats", "2", "--json", str(out)]
    assert script.main(argv, teacher=teacher) == 0
    report = json.loads(out.read_text())
    assert set(report["verify_ms"]) == {"1", "5"}
    for row in report["verify_ms"].values():
        assert row["with_copies"] > 0 and row["in_out_only"] > 0
        assert row["ratio"] == pytest.approx(row["with_copies"] / row["in_out_only"])
    assert report["min_rows_for_copies"] == llama.TRANSPOSED_MIN_ROWS
    assert "with copies" in capsys.readouterr().out
