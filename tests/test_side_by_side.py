"""``cli.side_by_side``: the suite options and the run every side-by-side bench script shares,
on the tiny teacher of tests/test_bench.py (the suite and the calibration replaced)."""

import argparse
import dataclasses
import json

import pytest
from test_bench import CONVERSATIONS, SPEC, ToyRenderer, _methods, teacher  # noqa: F401

from eaglepangu_jax.calibration import auto
from eaglepangu_jax.cli import side_by_side
from eaglepangu_jax.evaluation.suites import Conversation
from eaglepangu_jax.methods import registry as methods_lib


def _parser(**defaults) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="script")
    side_by_side.add_suite_arguments(parser, **defaults)
    return parser


def test_suite_arguments_take_the_scripts_defaults():
    args = _parser(per_category=2).parse_args(["--json", "r.json"])
    assert (args.suite, args.per_category, args.max_new_tokens, args.json) == (
        "dev",
        2,
        64,
        "r.json",
    )
    parser = _parser(per_category=1, suite="mtbench-humaneval", max_new_tokens=128)
    args = parser.parse_args(["--json", "r.json", "--per-category", "0"])
    assert (args.suite, args.per_category, args.max_new_tokens) == ("mtbench-humaneval", 0, 128)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--json", "r.json", "--per-category", "-1"], "--per-category must be >= 0"),
        (["--json", "r.json", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        ([], "the following arguments are required: --json"),
    ],
)
def test_bad_suite_arguments_exit_naming_the_option(argv, message, capsys):
    parser = _parser(per_category=2)
    with pytest.raises(SystemExit):
        side_by_side.check_suite_arguments(parser, parser.parse_args(argv))
    assert message in capsys.readouterr().err


def test_a_given_teacher_is_used_as_it_is(teacher):  # noqa: F811
    assert side_by_side.real_teacher(teacher) is teacher


def test_the_run_reads_the_suite_calibrates_the_controlled_methods_and_writes_the_entry(
    teacher,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    # A second "writing" conversation: --per-category 1 must leave it out.
    suite = [*CONVERSATIONS, Conversation(id="c", category="writing", turns=("abab",))]
    read, calibrated = [], []
    monkeypatch.setattr(side_by_side, "load_suite", lambda name: read.append(name) or suite)
    monkeypatch.setattr(
        auto,
        "ensure_calibration",
        lambda t, methods, path, progress: calibrated.append((t, sorted(methods), progress)),
    )
    assert SPEC.policy == "auto"  # greedy, then n-gram under the controller
    fixed = methods_lib.make_method("ngram", dataclasses.replace(SPEC, policy="best_first"))
    methods = [*_methods(), dataclasses.replace(fixed, name="ngram every round")]
    out = tmp_path / "r.json"
    args = _parser(per_category=2).parse_args(
        ["--suite", "toy", "--per-category", "1", "--json", str(out)]
    )
    report = side_by_side.run_and_report(
        teacher,
        methods,
        args,
        "mine",
        lambda report: {"turns_seen": len(report["turns"])},
        renderer=ToyRenderer(),
        progress=False,
    )
    assert read == ["toy"]
    # Only the controlled method's drafting cost is asked for, under its cost key.
    assert calibrated == [(teacher, sorted(auto.controlled_methods(methods[:2])), False)]
    assert len(calibrated[0][1]) == 1
    assert [(t["conversation_id"], t["turn_index"]) for t in report["turns"]] == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
    ]
    assert report["mine"] == {"suite": "toy", "per_category": 1, "turns_seen": 3}
    assert json.loads(out.read_text())["mine"] == report["mine"]
    assert "ngram every round" in capsys.readouterr().out  # the summary table
