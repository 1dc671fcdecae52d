"""``bench/teacher_layout.py``: each drafter with and without the teacher's ``[out, in]``
weight copies, side by side with greedy; bad settings are refused before anything loads."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script

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
    ],
)
def test_bad_settings_are_refused(script, tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        script.main([*argv, "--json", str(tmp_path / "r.json")])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


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
