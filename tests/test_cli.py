"""The ``eaglepangu`` command line: flag checks before any model load, end-to-end runs on a
tiny teacher, and one slow run on the real model."""

import dataclasses
import json

import jax
import pytest
from test_bench import ToyRenderer

from eaglepangu_jax import runtime
from eaglepangu_jax.cli import app as cli_main
from eaglepangu_jax.cli import bench as cli_bench
from eaglepangu_jax.drafters import registry as drafter_registry
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import trace
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)


@pytest.fixture(autouse=True)
def no_compile_cache(monkeypatch):
    """In-process runs must not switch on the persistent compilation cache for the session."""
    seen = []
    monkeypatch.setattr(runtime, "enable_compile_cache", seen.append)
    return seen


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything tries to load the real model or tokenizer."""

    def refuse():
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(runtime, "load_teacher", refuse)
    monkeypatch.setattr(runtime, "load_renderer", refuse)


@pytest.fixture(scope="module")
def teacher():
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return gen.Teacher(CFG, params)


def _fails(argv, capsys, match):
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err, err


def test_help_reads_like_a_guide(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in (
        "examples:",
        "eaglepangu generate",
        "eaglepangu bench",
        "eaglepangu demo",
        "trace summarize",
    ):
        assert text in out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["generate", "hi", "--budget", "0"], "budget must be >= 1"),
        (["generate", "hi", "--budget", "many"], "expected 'auto' or a whole number"),
        (["generate", "hi", "--depth", "0"], "must be >= 1"),
        (["generate", "hi", "--temperature", "-0.5"], "temperature must be >= 0"),
        (["generate", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--drafter", "medusa"], "invalid choice: 'medusa'"),
        (["generate", "hi", "--policy", "widest"], "invalid choice: 'widest'"),
        (["generate", "hi", "--max-new-tokens", "0"], "must be >= 1"),
        (["generate", "hi", "--json", "/no/such/folder/out.json"], "folder does not exist"),
        (
            ["bench", "--suite", "humaneval", "--json", "o.json", "--methods", "greedy,beam"],
            "unknown method 'beam'",
        ),
        (["bench", "--suite", "nope", "--json", "o.json"], "invalid choice: 'nope'"),
        (["bench", "--json", "o.json"], "one of the arguments --prompts --suite is required"),
        (["bench", "--suite", "humaneval"], "the following arguments are required: --json"),
        (["bench", "--suite", "humaneval", "--json", "o.json", "--limit", "0"], "must be >= 1"),
        (["trace", "summarize", "/no/such/trace.jsonl"], "No such file"),
    ],
)
def test_bad_flags_fail_before_loading(argv, match, capsys, no_model):
    _fails(argv, capsys, match)


def test_bad_prompt_files_fail_before_loading(tmp_path, capsys, no_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _fails(
        ["bench", "--prompts", str(empty), "--json", str(tmp_path / "o.json")],
        capsys,
        "no conversations",
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "turns": ["ok"]}\n{"id": 2, "turns": [}\n')
    _fails(
        ["bench", "--prompts", str(bad), "--json", str(tmp_path / "o.json")],
        capsys,
        "bad.jsonl, line 2: invalid JSON",
    )
    _fails(
        ["bench", "--prompts", str(tmp_path / "missing.jsonl"), "--json", str(tmp_path / "o.json")],
        capsys,
        "missing.jsonl",
    )


def test_eagle3_unavailable_or_too_deep_fails_before_loading(monkeypatch, capsys, no_model):
    def missing():
        raise drafter_registry.DrafterUnavailableError(
            "the eagle3 drafter is not part of this installation"
        )

    monkeypatch.setattr(methods_lib, "load_eagle3", missing)
    _fails(["generate", "hi", "--drafter", "eagle3"], capsys, "eagle3 drafter is not part")
    _fails(
        ["bench", "--suite", "humaneval", "--methods", "eagle3", "--json", "o.json"],
        capsys,
        "eagle3 drafter is not part",
    )

    @dataclasses.dataclass(frozen=True)
    class FiveDeep:
        name: str = "eagle3"
        feature_layers: tuple = ()

        @property
        def max_depth(self):
            return 5

    monkeypatch.setattr(methods_lib, "load_eagle3", lambda: (FiveDeep(), None))
    _fails(
        ["generate", "hi", "--drafter", "eagle3", "--depth", "9"],
        capsys,
        "depth 9 is above the eagle3 drafter's maximum 5",
    )


def test_generate_on_a_tiny_teacher(teacher, tmp_path, capsys):
    out, trace_path = tmp_path / "g.json", tmp_path / "t.jsonl"
    status = cli_main.main(
        [
            "generate",
            "abcabcabc",
            "--drafter",
            "ngram",
            "--max-new-tokens",
            "10",
            "--budget",
            "4",
            "--depth",
            "3",
            "--json",
            str(out),
            "--trace",
            str(trace_path),
        ],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert status == 0
    captured = capsys.readouterr()
    assert "tokens/s, accepted length" in captured.out
    record = json.loads(out.read_text())
    for key in (
        "prompt_ids",
        "tokens",
        "text",
        "new_tokens",
        "seconds",
        "tokens_per_s",
        "rounds",
        "accepted_length",
    ):
        assert key in record
    assert record["prompt_ids"] == ToyRenderer().encode([{"role": "user", "content": "abcabcabc"}])
    assert record["text"] == ToyRenderer().decode(record["tokens"])
    assert record["new_tokens"] == len(record["tokens"])
    assert record["accepted_length"] == pytest.approx(record["new_tokens"] / record["rounds"])
    assert len(trace.read_trace(trace_path)) == record["rounds"]

    summary_path = tmp_path / "summary.json"
    assert cli_main.main(["trace", "summarize", str(trace_path), "--json", str(summary_path)]) == 0
    summary = capsys.readouterr().out
    assert "verify" in summary and "accepted" in summary
    totals = json.loads(summary_path.read_text())
    assert totals["rounds"] == record["rounds"] and totals["new_tokens"] == record["new_tokens"]
    assert sum(totals["accepted_histogram"].values()) == record["rounds"]


def test_generate_raw_and_default_drafter(teacher, capsys, monkeypatch):
    def missing():
        raise drafter_registry.DrafterUnavailableError("not here")

    monkeypatch.setattr(methods_lib, "load_eagle3", missing)
    status = cli_main.main(
        ["generate", "abc", "--raw", "--max-new-tokens", "4", "--budget", "4", "--depth", "3"],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert status == 0
    captured = capsys.readouterr()
    assert "drafter: ngram (eagle3 unavailable: not here)" in captured.err
    assert captured.out.splitlines()[-1].startswith("[ngram] 4 tokens")


def test_bench_command_on_a_tiny_teacher(teacher, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"id": "one", "turns": ["abcabc", "more"]}\n'
        '{"question_id": 2, "turns": ["xyz xyz"]}\n'
        '{"id": "three", "turns": ["never run"]}\n'
    )
    out = tmp_path / "bench.json"
    status = cli_main.main(
        [
            "bench",
            "--prompts",
            str(prompts),
            "--limit",
            "2",
            "--methods",
            "ngram",
            "--max-new-tokens",
            "8",
            "--budget",
            "4",
            "--depth",
            "3",
            "--json",
            str(out),
            "--no-progress",
            "--plot-dir",
            str(tmp_path / "fig"),
        ],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert status == 0
    report = json.loads(out.read_text())
    assert (tmp_path / "fig" / "speedup_by_category.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [t["conversation_id"] for t in report["turns"]] == ["one", "one", "2"]
    assert set(report["summary"]) == {"greedy", "ngram"}
    for key in (
        "mean_tokens_per_s",
        "mean_speedup",
        "p50_speedup",
        "p99_speedup",
        "mean_accepted_length",
        "identical_fraction",
    ):
        assert key in report["summary"]["ngram"]
    assert report["summary"]["ngram"]["identical_fraction"] == 1.0
    table = capsys.readouterr().out
    assert "ngram" in table and "speed-up" in table


def test_demo_turns_are_short_and_shipped():
    conversations = cli_bench.demo_conversations()
    assert len(conversations) == 3
    assert all(len(c.turns) == 1 for c in conversations)
    assert [c.category for c in conversations][-1] == "humaneval"


def test_demo_runs_each_drafter_at_its_default_budget():
    """``make run`` shows what a user gets by default: a drafter with a budget of its own
    (methods.DRAFTER_BUDGETS) runs at it, the others at the run's default budget (the block
    drafter ran at 8 nodes here until session 41, though its default was one)."""
    methods = {m.name: m for m in cli_bench.demo_methods()}
    assert list(methods) == ["greedy", "eagle3", "ngram", "ngram-corpus", "block", "ngram-eagle3"]
    for name, method in methods.items():
        if name == "greedy":
            continue
        expected = methods_lib.DRAFTER_BUDGETS.get(name, methods_lib.DEFAULT_BUDGET)
        assert method.spec.budget == expected, name
        assert method.drafter.max_depth >= method.spec.depth, name
        if name in methods_lib.DRAFTER_BUDGETS:  # and no deeper than that budget
            assert method.spec.depth == method.drafter.depth == expected, name


def test_demo_turns_fit_one_attention_window():
    """Every demo turn, its answer and a full tree fit the smallest window (one compiled loop
    per method: what keeps ``make run``'s compile time down on a fresh machine)."""
    renderer = runtime.load_renderer()
    budget = methods_lib.DEFAULT_BUDGET
    for c in cli_bench.demo_conversations():
        prompt = renderer.encode([{"role": "user", "content": c.turns[0]}])
        needed = len(prompt) + cli_bench.DEMO_MAX_NEW_TOKENS + budget + 1
        assert needed <= gen.MIN_WINDOW, (c.id, len(prompt))


@pytest.mark.slow
def test_generate_on_the_real_model(capsys):
    status = cli_main.main(
        [
            "generate",
            "What is the capital of France?",
            "--drafter",
            "ngram",
            "--max-new-tokens",
            "16",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "Paris" in out


@pytest.mark.parametrize(
    "flags,expected",
    [([], None), (["--no-compile-cache"], ""), (["--compile-cache", "/somewhere"], "/somewhere")],
)
def test_compile_cache_flag(flags, expected, no_compile_cache, capsys, no_model):
    _fails(flags + ["generate", "hi", "--temperature", "-1"], capsys, "temperature")
    assert no_compile_cache == [expected]


def test_train_draft_is_wired_and_validates_before_work():
    # The sub-command hands every option to the training entry point; a bad kind exits 2
    # (argparse) before any model or data is touched.
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["train-draft", "--kind", "medusa", "--out", "unused"])
    assert exc.value.code == 2


def test_global_options_may_precede_train_draft(no_compile_cache, capsys):
    # Like every other command, train-draft takes the global options before it; its own
    # parser then sees only what follows (here --help, which exits 0 with its usage).
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["--compile-cache", "/somewhere", "train-draft", "--help"])
    assert exc.value.code == 0
    assert "usage: eaglepangu train-draft" in capsys.readouterr().out
    assert no_compile_cache == []  # --help exits before anything is enabled
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["--no-compile-cache", "train-draft", "--kind", "medusa", "--out", "x"])
    assert exc.value.code == 2 and "medusa" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--time-limit", "--wall-limit"])
@pytest.mark.parametrize("limit", ["0", "-5"])
def test_train_draft_refuses_a_time_limit_that_is_not_positive(option, limit, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["train-draft", "--out", str(tmp_path / "x"), option, limit])
    assert exc.value.code == 2 and f"{option} must be > 0" in capsys.readouterr().err


def test_train_draft_refuses_to_fit_a_schedule_without_a_limit(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["train-draft", "--out", str(tmp_path / "x"), "--fit-schedule"])
    assert exc.value.code == 2 and "--fit-schedule fits the schedule to a limit" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "time_limit, wall_limit, elapsed, expected",
    [
        (None, None, 5.0, None),  # no limit: the whole schedule
        (100.0, None, 50.0, 100.0),  # --time-limit counts from the first step only
        (None, 300.0, 100.0, 200.0),  # --wall-limit: what the set-up left
        (100.0, 300.0, 250.0, 50.0),  # both: the earlier one
        (100.0, 300.0, 150.0, 100.0),
        (None, 300.0, 400.0, 1e-3),  # set-up ran past it: one step, then the export
        (100.0, 300.0, 300.0, 1e-3),  # exactly used up: still one step
    ],
)
def test_steps_time_limit_takes_the_earlier_of_the_two_limits(
    time_limit, wall_limit, elapsed, expected
):
    from eaglepangu_jax.cli.train import steps_time_limit

    got = steps_time_limit(time_limit, wall_limit, elapsed)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kind", "eagle3", "--all-roots-weight", "1"], "needs --kind block"),
        (["--kind", "block", "--all-roots-weight", "-1"], "--all-roots-weight must be >= 0"),
        (["--kind", "block", "--all-roots-weight", "nan"], "--all-roots-weight must be >= 0"),
    ],
)
def test_train_draft_refuses_a_bad_all_roots_weight_before_work(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["train-draft", "--out", str(tmp_path / "x"), *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err
