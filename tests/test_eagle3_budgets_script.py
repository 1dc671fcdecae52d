"""``bench/eagle3_budgets.py``: the EAGLE-3 head at small budgets, every round drafted and
under the controller, with each turn's rounds recorded; bad settings are refused before
anything loads."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import load_bench_script, refusal


@pytest.fixture(scope="module")
def script():
    return load_bench_script("eagle3_budgets")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--per-category", "-1"], "--per-category"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--budgets", "0,2"], "--budgets"),
        (["--budgets", "2,2"], "--budgets"),
        (["--budgets", "two"], "--budgets"),
        (["--policies", "drafter"], "--policies"),
        (["--policies", "auto,auto"], "--policies"),
        (["--drafter", "greedy"], "--drafter"),
        (["--drafter", "nope"], "--drafter"),
        (["--drafter", "ngram,block"], "--drafter"),
        (["--disturbed-start", "0"], "--disturbed-start"),
    ],
)
def test_bad_settings_are_refused(script, tmp_path, capsys, argv, needle):
    assert needle in refusal(script, argv, tmp_path, capsys)


def test_correction_twins_get_their_own_settings(script):
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.methods.registry import make_method

    greedy = make_method("greedy", SpecConfig(budget=1, depth=2))
    ngram = make_method("ngram", SpecConfig(budget=4, depth=2))
    assert script.correction_twins([greedy, ngram], absent_fade=False, old_correction=False) == []
    twins = script.correction_twins([greedy, ngram], absent_fade=True, old_correction=True)
    assert [t.name for t in twins] == ["ngram absent-fade", "ngram old-correction"]
    absent, old = (t.correction for t in twins)
    assert (absent.rare_share, absent.surprise) == (0.0, ngram.correction.surprise)
    assert (old.rare_share, old.surprise) == (0.0, None)
    assert absent is not ngram.correction and old is not ngram.correction


def test_old_controller_twin_has_both_old_settings(script):
    from eaglepangu_jax.draft_control import ControlConfig
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.methods.registry import make_method

    spec = SpecConfig(budget=3, depth=2, policy="auto")
    new = make_method("ngram", spec, default_depth=True)
    average = dataclasses.replace(spec, control=ControlConfig(single_node_gate=False))
    average_gate = make_method("ngram", average, default_depth=True)
    twin = script.old_controller_twin(average_gate, "ngram b=3 auto")
    assert twin.name == "ngram b=3 auto old-controller"
    assert new.spec.control.single_node_gate and not twin.spec.control.single_node_gate
    assert (twin.correction.rare_share, twin.correction.surprise) == (0.0, None)
    assert new.correction.surprise is not None and twin.correction is not new.correction
    assert twin.correction is not average_gate.correction
    assert dataclasses.replace(twin.spec, control=spec.control) == new.spec


def test_round_summary_pools_the_turns(script):
    turns = [
        {"methods": {"m": {"accepted_per_round": [0, 2, 0], "nodes_per_round": [0, 3, 1]}}},
        {"methods": {"m": {"accepted_per_round": [1], "nodes_per_round": [3]}}},
    ]
    summary = script.round_summary(turns, "m")
    assert summary["rounds"] == 4
    assert summary["verifying_share"] == 0.75
    assert summary["accepted_per_verifying_round"] == 1.0  # (2 + 0 + 1) / 3
    assert summary["rounds_by_nodes"] == [1, 1, 0, 2]


@pytest.mark.slow  # the real teacher, greedy and the shipped head under both policies
def test_one_turn_at_one_budget_stays_identical(script, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--suite", "humaneval", "--per-category", "1", "--max-new-tokens", "12"]
    assert script.main([*argv, "--budgets", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {"greedy", "eagle3 b=1 best_first", "eagle3 b=1 auto"}
    assert all(s["identical_fraction"] == 1.0 for s in summary.values())
    assert report["eagle3_budgets"]["drafter"] == "eagle3"
    every = report["eagle3_budgets"]["rounds"]["eagle3 b=1 best_first"]
    assert every["verifying_share"] == 1.0 and set(every["rounds_by_nodes"][:1]) == {0}
    assert len(every["rounds_by_nodes"]) == 2  # one node at most
    turn = report["turns"][0]["methods"]["eagle3 b=1 auto"]
    assert len(turn["accepted_per_round"]) == turn["rounds"]
