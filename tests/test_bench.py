"""The side-by-side benchmark on a tiny random teacher: records, summary math, divergences."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglepangu_jax.calibration import curve
from eaglepangu_jax.drafters import registry as drafter_registry
from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation import report as bench_report
from eaglepangu_jax.evaluation import run as bench_run
from eaglepangu_jax.evaluation.suites import Conversation
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
SPEC = SpecConfig(budget=4, depth=3, max_new_tokens=12, eos_id=-7)


@dataclasses.dataclass(frozen=True)
class ToyRenderer:
    """Characters to ids of the tiny vocabulary, and back; a message ends with id 1."""

    vocab: int = CFG.vocab_size

    def encode(self, messages):
        ids = []
        for m in messages:
            ids += [3 + ord(c) % (self.vocab - 3) for c in m["content"]] + [1]
        return ids

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)

    def encode_text(self, text):
        return self.encode([{"role": "user", "content": text}])[:-1]


@pytest.fixture(scope="module")
def teacher():
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return gen.Teacher(CFG, params)


CONVERSATIONS = [
    Conversation(id="a", category="writing", turns=("abcabcabc", "again abc")),
    Conversation(id="b", category="code", turns=("def f(x): return x",)),
]


def _methods(greedy_spec=SPEC, ngram_spec=SPEC):
    return [
        methods_lib.make_method("greedy", greedy_spec),
        methods_lib.make_method("ngram", ngram_spec),
    ]


def test_run_bench_records_and_follows_greedy_answers(teacher):
    renderer = ToyRenderer()
    report = bench_run.run_bench(teacher, CONVERSATIONS, _methods(), renderer, progress=False)
    json.dumps(report, allow_nan=False)  # JSON-ready, no NaN / inf
    turns = report["turns"]
    assert [(t["conversation_id"], t["turn_index"]) for t in turns] == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
    ]
    assert set(report["warmup_seconds"]) == {"greedy", "ngram"}
    assert set(report["warmup_compile_seconds"]) == {"greedy", "ngram"}
    assert all(v >= 0.0 for v in report["warmup_compile_seconds"].values())
    for t in turns:
        assert list(t["methods"]) == ["greedy", "ngram"]
        g, n = t["methods"]["greedy"], t["methods"]["ngram"]
        for r in (g, n):
            assert {
                "new_tokens",
                "seconds",
                "tokens_per_s",
                "rounds",
                "accepted_length",
                "identical_to_greedy",
                "divergence_index",
                "near_tie_gap",
                "compile_seconds",
                "speedup",
            } <= set(r)
            assert r["accepted_length"] == pytest.approx(r["new_tokens"] / r["rounds"])
        assert g["identical_to_greedy"] and g["speedup"] == 1.0 and g["rounds"] == 12
        # The controller's cost scales after each turn, for the controlled method only.
        assert "cost_correction" not in g
        assert set(n["cost_correction"]) == {"plain_scale", "spec_scale", "segments", "windows"}
        # Greedy acceptance is lossless: the n-gram method reproduces greedy exactly.
        assert n["identical_to_greedy"] and n["divergence_index"] is None
        assert n["speedup"] == pytest.approx(n["tokens_per_s"] / g["tokens_per_s"])
    # The second turn continues after the *greedy* answer to the first.
    first = renderer.encode([{"role": "user", "content": "abcabcabc"}])
    answer = gen.generate(teacher, None, first, SPEC).tokens
    history = [
        {"role": "user", "content": "abcabcabc"},
        {"role": "assistant", "content": renderer.decode(answer)},
        {"role": "user", "content": "again abc"},
    ]
    assert turns[1]["prompt_tokens"] == len(renderer.encode(history))
    assert report["summary"]["ngram"]["identical_fraction"] == 1.0
    table = bench_report.format_summary(report)
    assert "ngram" in table and "greedy" in table
    assert "a#2" in bench_report.format_turns(report)


@pytest.mark.parametrize("pressure, clears", [(0.9, [0, 1, 2]), (0.1, []), (None, [])])
def test_run_bench_drops_compiled_programs_near_the_mapping_limit(
    teacher, monkeypatch, pressure, clears
):
    calls, clear = [], jax.clear_caches
    monkeypatch.setattr(bench_run, "mapping_pressure", lambda: pressure)
    monkeypatch.setattr(bench_run.jax, "clear_caches", lambda: calls.append(clear()))
    report = bench_run.run_bench(teacher, CONVERSATIONS, _methods(), ToyRenderer(), progress=False)
    assert report["cache_clears"] == clears and len(calls) == len(clears)
    # Programs dropped before a turn are rebuilt; the outputs do not change.
    assert report["summary"]["ngram"]["identical_fraction"] == 1.0


def test_run_bench_records_rounds_when_asked(teacher):
    plain = bench_run.run_bench(
        teacher, CONVERSATIONS[:1], _methods(), ToyRenderer(), progress=False
    )
    assert "nodes_per_round" not in plain["turns"][0]["methods"]["ngram"]
    report = bench_run.run_bench(
        teacher, CONVERSATIONS[:1], _methods(), ToyRenderer(), progress=False, per_round=True
    )
    for record in report["turns"][0]["methods"].values():
        accepted, nodes = record["accepted_per_round"], record["nodes_per_round"]
        assert len(accepted) == len(nodes) == record["rounds"]
        # Emitted tokens are accepted ones plus one bonus per round (eos or the token cap
        # can cut the last round short).
        assert record["new_tokens"] <= sum(accepted) + len(accepted)
        assert record["speculated_rounds"] == sum(1 for n in nodes if n > 0)
        assert all(0 <= a <= n for a, n in zip(accepted, nodes))


def test_mapping_pressure_reads_this_process():
    pressure = bench_run.mapping_pressure()
    if pressure is None:
        pytest.skip("no /proc mapping counts on this platform")
    assert 0.0 < pressure < bench_run.MAPPING_SHARE


def _naive_gap(teacher, sequence):
    """Top-1 minus top-2 logit after ``sequence``: one uncached forward, nothing shared."""
    logits, _ = llama.forward_sequence(teacher.params, jnp.asarray(sequence, jnp.int32), config=CFG)
    top = np.sort(np.asarray(logits[-1]))
    return float(top[-1] - top[-2])


def test_divergence_index_and_near_tie_gap(teacher):
    # Sampling at temperature 1 departs from greedy: a divergence to report.
    sampled = dataclasses.replace(SPEC, acceptance="sample", temperature=1.0, seed=5)
    conversations = [Conversation(id="d", category="x", turns=("hello world",))]
    report = bench_run.run_bench(
        teacher, conversations, _methods(ngram_spec=sampled), ToyRenderer(), progress=False
    )
    record = report["turns"][0]["methods"]["ngram"]
    prompt = ToyRenderer().encode([{"role": "user", "content": "hello world"}])
    greedy = gen.generate(teacher, None, prompt, SPEC).tokens
    other = gen.generate(teacher, NGramDrafter(depth=3, budget=4), prompt, sampled).tokens
    index = bench_run.first_divergence(greedy, other)
    assert index is not None, "temperature 1 should leave greedy's path here"
    assert record["identical_to_greedy"] is False
    assert record["divergence_index"] == index
    want = _naive_gap(teacher, prompt + greedy[:index])
    assert record["near_tie_gap"] == pytest.approx(want, abs=1e-4)
    assert report["summary"]["ngram"]["identical_fraction"] == 0.0


def test_first_divergence():
    assert bench_run.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench_run.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench_run.first_divergence([1, 2, 3], [1, 2]) == 2
    assert bench_run.first_divergence([], []) is None


def _row(tps, speedup, tokens, rounds, identical):
    return {
        "tokens_per_s": tps,
        "speedup": speedup,
        "new_tokens": tokens,
        "rounds": rounds,
        "accepted_length": tokens / rounds,
        "identical_to_greedy": identical,
        "compile_seconds": 0.5,
    }


def test_summary_math_by_hand():
    turns = [
        {
            "methods": {
                "greedy": _row(10.0, 1.0, 10, 10, True),
                "ngram": _row(15.0, 1.5, 10, 5, True),
            }
        },
        {
            "methods": {
                "greedy": _row(20.0, 1.0, 10, 10, True),
                "ngram": _row(20.0, 1.0, 10, 10, False),
            }
        },
        {
            "methods": {
                "greedy": _row(40.0, 1.0, 40, 40, True),
                "ngram": _row(100.0, 2.5, 40, 10, True),
            }
        },
    ]
    s = bench_report.summarize_turns(turns, ["greedy", "ngram"])
    n = s["ngram"]
    assert n["turns"] == 3
    assert n["mean_tokens_per_s"] == pytest.approx(45.0)
    assert n["mean_speedup"] == pytest.approx(5.0 / 3.0)
    assert n["p50_speedup"] == pytest.approx(1.5)
    # Linear interpolation: sorted [1.0, 1.5, 2.5], rank 0.99 * 2 = 1.98.
    assert n["p99_speedup"] == pytest.approx(1.5 + 0.98 * 1.0)
    assert n["mean_accepted_length"] == pytest.approx((2.0 + 1.0 + 4.0) / 3.0)
    assert n["overall_accepted_length"] == pytest.approx(60 / 25)
    assert n["identical_fraction"] == pytest.approx(2 / 3)
    assert n["compile_seconds"] == pytest.approx(1.5)
    g = s["greedy"]
    assert g["mean_speedup"] == g["p50_speedup"] == g["p99_speedup"] == 1.0
    assert g["mean_accepted_length"] == 1.0 and g["identical_fraction"] == 1.0


def test_summary_table_adds_warmup_compile_work_to_discarded_runs():
    turns = [{"methods": {"greedy": _row(10.0, 1.0, 10, 10, True)}}]
    report = {
        "summary": bench_report.summarize_turns(turns, ["greedy"]),
        "warmup_seconds": {"greedy": 9.0},
        "warmup_compile_seconds": {"greedy": 2.25},
    }
    row = bench_report.format_summary(report).splitlines()[-1].split()
    # warm-up wall 9.0; compile = 2.25 (warm-up compile work) + 0.5 (discarded turn run).
    assert row[-2:] == ["9.0", "2.8"]
    del report["warmup_compile_seconds"]  # a report from before the field existed
    assert bench_report.format_summary(report).splitlines()[-1].split()[-1] == "0.5"


def test_summary_skips_missing_speedups():
    rows = [{"methods": {"m": _row(None, None, 4, 2, True)}}]
    s = bench_report.summarize_turns(rows, ["m"])["m"]
    assert s["mean_speedup"] is None and s["mean_tokens_per_s"] is None
    assert s["mean_accepted_length"] == 2.0


@pytest.mark.parametrize(
    "text,expected",
    [
        ("greedy,ngram", ("greedy", "ngram")),
        ("ngram", ("greedy", "ngram")),
        ("ngram, greedy", ("greedy", "ngram")),
        (["eagle3", "greedy"], ("greedy", "eagle3")),
        ("eagle3:4,eagle3:6,eagle3", ("greedy", "eagle3:4", "eagle3:6", "eagle3")),
    ],
)
def test_parse_methods(text, expected):
    assert methods_lib.parse_methods(text) == expected


@pytest.mark.parametrize(
    "text,match",
    [
        ("greedy,beam", "unknown method"),
        ("ngram,ngram", "more than once"),
        (" , ", "no methods"),
        ("eagle3:4,eagle3:4", "more than once"),
        ("beam:4", "unknown method"),
        ("eagle3:0", "positive integer"),
        ("eagle3:x", "positive integer"),
        ("eagle3:", "positive integer"),
        ("greedy:4", "no tree depth"),
        ("mtp:2", "no tree depth"),
        ("transformers-pld:3", "no tree depth"),
    ],
)
def test_parse_methods_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        methods_lib.parse_methods(text)


def test_engine_drafters_leave_greedy_out_and_keep_depth_entries():
    assert methods_lib.engine_drafters("greedy,ngram,eagle3:4") == ("ngram", "eagle3:4")


@pytest.mark.parametrize(
    "text,match",
    [
        ("greedy", "no drafter"),
        ("ngram,transformers-pld", "transformers-pld does not run in the engine"),
        ("ngram,beam", "unknown method"),
    ],
)
def test_engine_drafters_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        methods_lib.engine_drafters(text)


@dataclasses.dataclass(frozen=True)
class Capped:
    """A drafter stand-in whose trees go at most 4 deep."""

    name: str = "capped"
    feature_layers: tuple = ()

    @property
    def max_depth(self):
        return 4


def test_make_method_depth_against_drafter_maximum():
    def loader():
        return NGramDrafter(depth=4, budget=16, max_ngram=2), None

    spec = SpecConfig(budget=6, depth=3)
    method = methods_lib.make_method("eagle3", spec, eagle3_loader=loader)
    assert method.drafter.depth == 3 and method.drafter.budget == 6  # configured by the spec

    deep = SpecConfig(budget=6, depth=8)
    with pytest.raises(ValueError, match="depth 8 is above the eagle3 drafter's maximum 4"):
        methods_lib.make_method("eagle3", deep, eagle3_loader=lambda: (Capped(), None))
    default = methods_lib.make_method(
        "eagle3", deep, default_depth=True, eagle3_loader=lambda: (Capped(), None)
    )
    assert default.spec.depth == 4
    # A shipped drafter keeps its own depth when the user chose none.
    own = methods_lib.make_method("eagle3", deep, default_depth=True, eagle3_loader=loader)
    assert own.spec.depth == 4 and own.drafter.depth == 4 and own.drafter.budget == 6


def test_a_default_budget_becomes_the_drafters_own():
    def loader():
        return NGramDrafter(depth=6, budget=16, max_ngram=2), None

    spec = SpecConfig(budget=8, depth=6)
    own = methods_lib.DRAFTER_BUDGETS["eagle3"]
    assert own != spec.budget  # otherwise the checks below would not tell the two apart
    eagle3 = methods_lib.make_method("eagle3", spec, default_budget=True, eagle3_loader=loader)
    assert eagle3.spec.budget == own and eagle3.drafter.budget == own
    # A budget the user chose is kept, and the drafters without a budget of their own keep
    # the run's.
    chosen = methods_lib.make_method("eagle3", spec, eagle3_loader=loader)
    assert chosen.spec.budget == 8 and chosen.drafter.budget == 8
    ngram = methods_lib.make_method("ngram", spec, default_budget=True)
    assert "ngram" not in methods_lib.DRAFTER_BUDGETS and ngram.spec.budget == 8
    # A NAME:D entry sets the depth only.
    shallow = methods_lib.make_method("eagle3:3", spec, default_budget=True, eagle3_loader=loader)
    assert shallow.spec.budget == own and shallow.spec.depth == 3
    # Its drafting cost is its own calibration entry.
    assert curve.draft_cost_key(eagle3) == f"eagle3:budget={own},depth=6"
    # With the depth left at its default too, the tree is no deeper than the budget (a tree
    # of N nodes cannot be): the same trees, cheaper rounds.
    both = methods_lib.make_method(
        "eagle3", spec, default_budget=True, default_depth=True, eagle3_loader=loader
    )
    assert both.spec.budget == both.spec.depth == own == both.drafter.depth
    assert both.drafter.budget == own
    # A depth the user chose is kept.
    assert shallow.drafter.depth == 3


def test_the_cli_budget_option_says_whether_it_is_a_default():
    import argparse

    from eaglepangu_jax.cli import args as args_lib

    assert args_lib.budget_is_default(argparse.Namespace(budget="auto"))
    assert not args_lib.budget_is_default(argparse.Namespace(budget=8))


def test_a_method_entry_sets_its_depth_and_keeps_its_name():
    def loader():
        return NGramDrafter(depth=6, budget=16, max_ngram=2), None

    spec = SpecConfig(budget=6, depth=6)
    # The entry's depth wins over the run's, and over a shipped drafter's own default.
    for default in (False, True):
        shallow = methods_lib.make_method(
            "eagle3:3", spec, default_depth=default, eagle3_loader=loader
        )
        assert shallow.name == "eagle3:3"
        assert shallow.spec.depth == 3 and shallow.drafter.depth == 3
    plain = methods_lib.make_method("eagle3", spec, eagle3_loader=loader)
    assert plain.name == "eagle3" and plain.spec.depth == 6
    # Both depths keep their own drafting-cost key.
    keys = {curve.draft_cost_key(m) for m in (shallow, plain)}
    assert keys == {"eagle3:3:budget=6,depth=3", "eagle3:budget=6,depth=6"}

    # A depth the user wrote is refused above the maximum, not lowered like a default.
    with pytest.raises(ValueError, match="depth 9 is above the eagle3 drafter's maximum 4"):
        methods_lib.make_method(
            "eagle3:9", spec, default_depth=True, eagle3_loader=lambda: (Capped(), None)
        )


def test_eagle3_absence_is_a_clear_error(monkeypatch):
    import sys

    from eaglepangu_jax import drafters

    monkeypatch.delattr(drafters, "eagle3", raising=False)
    monkeypatch.setitem(sys.modules, "eaglepangu_jax.drafters.eagle3", None)  # import fails
    with pytest.raises(drafter_registry.DrafterUnavailableError, match="eagle3"):
        methods_lib.load_eagle3()


def test_first_prompt_too_long_fails_before_work(teacher):
    long = Conversation(id="L", category="x", turns=("y" * 600,))
    with pytest.raises(ValueError, match="conversation 'L'.*exceeds the teacher's context"):
        bench_run.run_bench(teacher, [long], _methods(), ToyRenderer(), progress=False)


def test_reference_must_come_first(teacher):
    with pytest.raises(ValueError, match="first method must be 'greedy'"):
        bench_run.run_bench(teacher, CONVERSATIONS, _methods()[::-1], ToyRenderer(), progress=False)


def test_write_report_is_atomic_json(tmp_path):
    path = tmp_path / "r.json"
    bench_report.write_report(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert list(tmp_path.iterdir()) == [path]
    with pytest.raises(ValueError):
        bench_report.write_report(path, {"a": float("nan")})
    assert json.loads(path.read_text()) == {"a": [1, 2]}  # the old file survives
    assert list(tmp_path.iterdir()) == [path]


# ----------------------------------------------------------------------------- peer runners


@dataclasses.dataclass
class FakePeer:
    """A peer runner returning fixed ids with a fixed round count; records its calls."""

    tokens: list
    rounds: int
    calls: list = dataclasses.field(default_factory=list)

    def __call__(self, prompt_ids, spec, *, eos_id):
        self.calls.append((list(prompt_ids), spec.max_new_tokens, eos_id))
        n = len(self.tokens)
        stats = gen.GenerationStats(
            new_tokens=n,
            rounds=self.rounds,
            accepted_length=n / self.rounds,
            seconds=0.5,
            prefill_seconds=0.1,
            tokens_per_s=20.0,
            accepted_per_round=(),
            nodes_per_round=(),
        )
        return gen.GenerationResult(tokens=list(self.tokens), stats=stats)

    def describe(self):
        return {"rounds": self.rounds}


def test_peer_runner_is_counted_like_our_methods(teacher):
    conversations = [Conversation(id="p", category="x", turns=("hello peers",))]
    prompt = ToyRenderer().encode([{"role": "user", "content": "hello peers"}])
    greedy = gen.generate(teacher, None, prompt, SPEC).tokens
    assert len(greedy) == 12
    changed = list(greedy)
    changed[3] = (changed[3] + 1) % CFG.vocab_size
    same, other = FakePeer(list(greedy), rounds=5), FakePeer(changed[:9], rounds=3)
    methods = _methods() + [
        methods_lib.Method(name="peer-same", spec=SPEC, runner=same),
        methods_lib.Method(name="peer-other", spec=SPEC, runner=other),
    ]
    report = bench_run.run_bench(teacher, conversations, methods, ToyRenderer(), progress=False)
    rows = report["turns"][0]["methods"]
    # Tokens are counted from the ids, accepted length = tokens / rounds for every kind.
    for name, tokens, rounds in (("greedy", 12, 12), ("peer-same", 12, 5), ("peer-other", 9, 3)):
        assert rows[name]["new_tokens"] == tokens and rows[name]["rounds"] == rounds
        assert rows[name]["accepted_length"] == pytest.approx(tokens / rounds)
    assert rows["greedy"]["accepted_length"] == 1.0
    assert rows["ngram"]["accepted_length"] == pytest.approx(
        rows["ngram"]["new_tokens"] / rows["ngram"]["rounds"]
    )
    assert rows["peer-same"]["identical_to_greedy"]
    assert rows["peer-same"]["speedup"] == pytest.approx(20.0 / rows["greedy"]["tokens_per_s"])
    assert rows["peer-other"]["divergence_index"] == 3
    assert rows["peer-other"]["near_tie_gap"] == pytest.approx(
        _naive_gap(teacher, prompt + greedy[:3]), abs=1e-4
    )
    # Warm-up + one turn; the peer gets the prompt ids, the budget and the spec's eos.
    assert same.calls == [(prompt, 12, -7)] * 2
    assert report["methods"]["peer-same"]["runner"] == {"rounds": 5}
    assert report["summary"]["peer-other"]["overall_accepted_length"] == 3.0
    assert "peer-other" in bench_report.format_summary(report)
    assert "peer-same" in bench_report.format_turns(report)


def test_peer_gets_the_teachers_eos_by_default(teacher):
    peer = FakePeer([5, 6], rounds=1)
    spec = dataclasses.replace(SPEC, eos_id=None)
    bench_run.generate_with(teacher, methods_lib.Method(name="p", spec=spec, runner=peer), [3, 4])
    assert peer.calls == [([3, 4], 12, CFG.eos_id)]


def test_make_peer_methods():
    assert methods_lib.parse_methods("transformers-pld,transformers-greedy") == (
        "greedy",
        "transformers-pld",
        "transformers-greedy",
    )
    plain = methods_lib.make_method("transformers-greedy", SPEC)
    pld = methods_lib.make_method("transformers-pld", SPEC, torch_threads=1)
    assert plain.drafter is None and plain.runner.prompt_lookup is None
    assert pld.runner.prompt_lookup == 10 and pld.runner.torch_threads == 1
    assert plain.runner.torch_threads is None  # torch's own default
    assert pld.spec == SPEC
    sampled = dataclasses.replace(SPEC, acceptance="sample", temperature=1.0)
    with pytest.raises(ValueError, match="decodes greedily"):
        methods_lib.make_method("transformers-pld", sampled)


@pytest.mark.parametrize("package", ["torch", "transformers", "accelerate"])
def test_missing_reference_package_names_the_extra(monkeypatch, package):
    import sys

    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(
        drafter_registry.DrafterUnavailableError,
        match=rf"not installed: {package}\. Install them with: "
        r"pip install 'eaglepangu\[reference\]'",
    ):
        methods_lib.make_method("transformers-greedy", SPEC)


# ----------------------------------------------------------------------------- block


@dataclasses.dataclass(frozen=True, kw_only=True)
class FakeBlock:
    """Marginals-only drafter shape: ``depth`` marginals, at most ``block_size``."""

    name: str = "block"
    block_size: int = 5
    depth: int = 5
    feature_layers: tuple = ()

    def __post_init__(self):
        if not 1 <= self.depth <= self.block_size:
            raise ValueError(
                f"depth must lie in [1, block_size = {self.block_size}], got {self.depth}"
            )

    @property
    def max_depth(self):
        return self.depth


@pytest.mark.parametrize(
    "policy,expected", [("drafter", "auto"), ("auto", "auto"), ("best_first", "best_first")]
)
def test_block_method_runs_best_first(monkeypatch, policy, expected):
    budgets = []

    def loader(*, budget):
        budgets.append(budget)
        return FakeBlock(), {"w": 1}

    monkeypatch.setattr(methods_lib, "load_block", loader)
    spec = SpecConfig(policy=policy, budget=6, depth=3)
    method = methods_lib.make_method("block", spec)
    assert method.spec.policy == expected and method.spec.budget == 6
    assert method.spec.depth == 3 and method.drafter.depth == 3  # the user's depth
    assert method.draft_params == {"w": 1} and budgets == [6]
    # A default depth: the drafter keeps its trained one.
    default = methods_lib.make_method(
        "block", dataclasses.replace(spec, depth=8), default_depth=True
    )
    assert default.spec.depth == 5 and default.drafter.depth == 5
    with pytest.raises(ValueError, match=r"block_size = 5\], got 8"):
        methods_lib.make_method("block", dataclasses.replace(spec, depth=8))


def test_block_absence_is_a_clear_error(monkeypatch):
    import sys

    from eaglepangu_jax import drafters

    monkeypatch.delattr(drafters, "block", raising=False)
    monkeypatch.setitem(sys.modules, "eaglepangu_jax.drafters.block", None)  # import fails
    with pytest.raises(
        drafter_registry.DrafterUnavailableError,
        match="the block drafter is not part of this installation",
    ):
        methods_lib.make_method("block", SPEC)


def test_shipped_loader_errors_are_shared(monkeypatch):
    import sys
    import types

    module = types.ModuleType("eaglepangu_jax.drafters.fake")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(
        drafter_registry.DrafterUnavailableError, match=r"has no load_shipped_fake\(\)"
    ):
        drafter_registry.load_shipped("fake")

    def unreadable(**kwargs):
        raise OSError(f"no weights file ({kwargs})")

    module.load_shipped_fake = unreadable
    with pytest.raises(
        drafter_registry.DrafterUnavailableError,
        match=r"fake shipped weights could not be loaded: no weights file "
        r"\({'budget': 3}\)",
    ):
        drafter_registry.load_shipped("fake", budget=3)
    module.load_shipped_fake = lambda **kwargs: ("drafter", kwargs)
    assert drafter_registry.load_shipped("fake", depth=2) == ("drafter", {"depth": 2})
