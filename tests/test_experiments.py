"""Experiment grids, their summaries (checked by hand), the commands on a tiny teacher, and
the figures."""

import dataclasses
import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest
from test_bench import CFG, ToyRenderer, teacher  # noqa: F401  (teacher is a fixture)

from eaglepangu_jax.cli import args as cli_args
from eaglepangu_jax.cli import experiments as cli_experiments
from eaglepangu_jax.engine.drafter import Proposal, StatelessDrafter
from eaglepangu_jax.evaluation import experiments, grids, plots
from eaglepangu_jax.methods import registry as methods_lib

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCK_MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class EchoMarginalDrafter(StatelessDrafter):
    """A block-style drafter: per-depth log-marginals favouring a repeat of the root token."""

    depth: int
    name: str = "echo-marginals"

    def propose(self, params, state, context, key):
        root = context.tokens[context.num_tokens - 1]
        noise = jax.random.normal(key, (self.depth, CFG.vocab_size))
        favour = jax.nn.one_hot(jnp.full((self.depth,), root), CFG.vocab_size)
        return Proposal(marginals=jax.nn.log_softmax(noise + 3.0 * favour, axis=-1))


@pytest.fixture
def block_drafter(monkeypatch):
    """``make_method("block", ...)`` gives the echo drafter (maximum depth 4)."""
    real = methods_lib.make_method

    def make(name, spec, *, default_depth=False, **kwargs):
        if name != "block":
            return real(name, spec, default_depth=default_depth, **kwargs)
        if spec.depth > BLOCK_MAX_DEPTH:
            if not default_depth:
                raise ValueError(
                    f"depth {spec.depth} is above the block drafter's maximum {BLOCK_MAX_DEPTH}"
                )
            spec = dataclasses.replace(spec, depth=BLOCK_MAX_DEPTH)
        return methods_lib.Method(name="block", spec=spec, drafter=EchoMarginalDrafter(spec.depth))

    monkeypatch.setattr(methods_lib, "make_method", make)


def _prompts(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


# ----------------------------------------------------------------------------- grids


def test_sweep_grid_names_and_settings():
    methods = grids.sweep_methods("ngram", (4, 8), (2, 3), max_new_tokens=12)
    assert [m.name for m in methods] == [
        "ngram n=4 d=2",
        "ngram n=8 d=2",
        "ngram n=4 d=3",
        "ngram n=8 d=3",
    ]
    for m, (n, d) in zip(methods, [(4, 2), (8, 2), (4, 3), (8, 3)]):
        assert (m.spec.budget, m.spec.depth, m.spec.policy) == (n, d, "drafter")
        assert (m.drafter.budget, m.drafter.depth) == (n, d)  # the drafter is configured too
        assert m.spec.max_new_tokens == 12
    assert [c["nodes"] for c in grids.cells_of(methods)] == [4, 8, 4, 8]


def test_window_and_budget_grids(block_drafter):
    windows = grids.window_methods("ngram", (64, None), nodes=4, depth=3, max_new_tokens=8)
    assert [m.name for m in windows] == ["ngram w=64", "ngram w=full"]
    assert [m.spec.draft_window for m in windows] == [64, None]
    assert {(m.spec.budget, m.spec.depth) for m in windows} == {(4, 3)}
    budgets = grids.budget_methods("block", (2, 8), depth=None, max_new_tokens=8)
    assert [m.name for m in budgets] == ["block b=2", "block b=8", "block auto<=8"]
    assert [(m.spec.policy, m.spec.budget) for m in budgets] == [
        ("best_first", 2),
        ("best_first", 8),
        ("auto", 8),
    ]
    # No depth asked for: the bench default, lowered to the drafter's maximum.
    assert {m.spec.depth for m in budgets} == {min(methods_lib.DEFAULT_DEPTH, BLOCK_MAX_DEPTH)}
    assert grids.default_policy("block") == "best_first"


@pytest.mark.parametrize("text,expected", [("16, 4,8", (4, 8, 16)), ("1", (1,)), ("256", (256,))])
def test_parse_counts(text, expected):
    assert cli_args.parse_counts(text, what="nodes", high=256) == expected


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "comma-separated"),
        ("4,,8", "comma-separated"),
        ("4,x", "'x' is not a whole"),
        ("0", "between 1 and 256"),
        ("257", "between 1 and 256"),
        ("4,8,4", "4 given more"),
    ],
)
def test_parse_counts_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        cli_args.parse_counts(text, what="nodes", high=256)


def test_parse_windows():
    assert cli_args.parse_windows("512,128,full") == (128, 512, None)
    assert cli_args.parse_windows("FULL") == (None,)
    for text, match in [
        ("full,full", "given more"),
        ("0", "at least 1"),
        ("128,whole", "neither 'full'"),
        ("", "comma-separated"),
    ]:
        with pytest.raises(ValueError, match=match):
            cli_args.parse_windows(text)


# ----------------------------------------------------------------------------- summaries


def _record(speedup, tokens, rounds, identical=True):
    return {
        "tokens_per_s": 10.0 * speedup,
        "speedup": speedup,
        "new_tokens": tokens,
        "rounds": rounds,
        "accepted_length": tokens / rounds,
        "identical_to_greedy": identical,
        "compile_seconds": 0.0,
    }


def _turn(category, **methods):
    return {"category": category, "methods": {"greedy": _record(1.0, 8, 8), **methods}}


def test_cell_summary_by_hand():
    cells = [{"method": "a", "nodes": 4, "depth": 2}, {"method": "b", "nodes": 8, "depth": 2}]
    turns = [
        _turn("x", a=_record(1.5, 8, 4), b=_record(0.5, 8, 2, identical=False)),
        _turn("y", a=_record(0.9, 6, 6), b=_record(2.5, 9, 3)),
    ]
    a, b = grids.summarize_cells(turns, cells)
    assert (a["nodes"], a["depth"], a["turns"]) == (4, 2, 2)
    assert a["mean_speedup"] == pytest.approx((1.5 + 0.9) / 2)
    assert a["mean_accepted_length"] == pytest.approx((2.0 + 1.0) / 2)
    assert a["overall_accepted_length"] == pytest.approx(14 / 10)
    assert b["mean_speedup"] == pytest.approx(1.5)
    assert b["mean_accepted_length"] == pytest.approx((4.0 + 3.0) / 2)
    assert b["identical_fraction"] == 0.5
    assert grids.sweet_spot([a, b])["method"] == "b"
    assert grids.grid([a, b], "mean_speedup", rows=(2, 3), cols=(4, 8)) == [
        [pytest.approx(1.2), pytest.approx(1.5)],
        [None, None],
    ]


def test_sweet_spot_ties_prefer_the_cheaper_tree():
    cells = [
        {"nodes": 8, "depth": 2, "mean_speedup": 1.3},
        {"nodes": 4, "depth": 6, "mean_speedup": 1.3},
        {"nodes": 4, "depth": 4, "mean_speedup": 1.3},
        {"nodes": 2, "depth": 2, "mean_speedup": None},
        {"nodes": 16, "depth": 2, "mean_speedup": 1.1},
    ]
    assert grids.sweet_spot(cells) == {"nodes": 4, "depth": 4, "mean_speedup": 1.3}
    assert grids.sweet_spot([{"nodes": 1, "depth": 1, "mean_speedup": None}]) is None


def test_budget_gap_by_hand():
    cells = [
        {"method": "b2", "nodes": 2, "policy": "best_first"},
        {"method": "b4", "nodes": 4, "policy": "best_first"},
        {"method": "auto", "nodes": 4, "policy": "auto"},
    ]
    turns = [
        _turn("code", b2=_record(1.0, 8, 8), b4=_record(2.0, 8, 4), auto=_record(1.9, 8, 4)),
        _turn("code", b2=_record(1.0, 8, 8), b4=_record(1.0, 8, 8), auto=_record(1.1, 8, 8)),
        _turn("chat", b2=_record(1.2, 8, 8), b4=_record(1.0, 8, 8), auto=_record(1.2, 8, 8)),
    ]
    result = grids.compare_budgets(turns, cells, target_percent=5.0)
    code, chat, everything = result["categories"]
    # code: b2 1.0, b4 1.5, auto 1.5 -> gap 0.
    assert code["category"] == "code" and code["turns"] == 2
    assert code["best_budget"] == 4 and code["best_fixed_speedup"] == pytest.approx(1.5)
    assert code["auto_speedup"] == pytest.approx(1.5)
    assert code["gap_percent"] == pytest.approx(0.0, abs=1e-9) and code["within_target"]
    assert [f["mean_speedup"] for f in code["fixed"]] == [pytest.approx(1.0), pytest.approx(1.5)]
    # chat: b2 1.2 is best, auto 1.2 -> gap 0.
    assert chat["best_budget"] == 2 and chat["gap_percent"] == pytest.approx(0.0, abs=1e-9)
    # all turns: b2 (1.0 + 1.0 + 1.2) / 3, b4 4 / 3 (best), auto 4.2 / 3 -> gap -5%.
    assert everything["category"] == grids.ALL_TURNS and everything["turns"] == 3
    assert everything["best_budget"] == 4
    assert everything["gap_percent"] == pytest.approx(100 * (4 / 3 - 4.2 / 3) / (4 / 3))
    assert result["all_within_target"]
    slower = [_turn("code", b2=_record(1.0, 8, 8), b4=_record(2.0, 8, 4), auto=_record(1.8, 8, 4))]
    row = grids.compare_budgets(slower, cells)["categories"][0]
    assert row["gap_percent"] == pytest.approx(10.0) and not row["within_target"]
    text = grids.format_budgets(
        {"context": "ctx", "comparison": grids.compare_budgets(slower, cells)}
    )
    assert "NOT met" in text and "10.0%" in text
    with pytest.raises(ValueError, match="one 'auto' cell"):
        grids.compare_budgets(turns, cells[:2])


# ----------------------------------------------------------------------------- bad input


def _fails(capsys, argv, *matches):
    """``argv`` exits with status 2 before any work, its message containing ``matches``."""
    with pytest.raises(SystemExit) as exit_info:
        cli_experiments.main(argv, teacher=object(), renderer=ToyRenderer())
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(m in err for m in matches), err


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--nodes", "0,4"], "argument --nodes: tree nodes must be between 1 and 256, got 0"),
        (["--nodes", "257"], "argument --nodes: tree nodes must be between 1 and 256"),
        (["--nodes", ""], "argument --nodes: expected a comma-separated list"),
        (["--nodes", "4,8,4"], "argument --nodes: value(s) 4 given more than once"),
        (["--depth", "0"], "argument --depth: depth levels must be between 1"),
        (["--suite", "nope"], "argument --suite: invalid choice"),
    ],
)
def test_sweep_rejects_bad_values(capsys, tmp_path, extra, match):
    argv = ["sweep", "--json", str(tmp_path / "r.json")]
    argv += extra if "--suite" in extra else ["--suite", "mtbench"] + extra
    _fails(capsys, argv, match)


def test_bad_input_errors_name_the_option(capsys, tmp_path, block_drafter):
    out = str(tmp_path / "r.json")
    _fails(
        capsys,
        ["ablate-window", "--suite", "mtbench", "--json", out, "--windows", "0,full"],
        "argument --windows: window tokens must be at least 1",
    )
    _fails(
        capsys,
        ["ablate-window", "--suite", "mtbench", "--json", out, "--windows", "128,all"],
        "argument --windows: window 'all' is neither 'full'",
    )
    _fails(
        capsys,
        ["budgets", "--suite", "mtbench", "--json", out, "--budgets", "2,2"],
        "argument --budgets: value(s) 2 given more than once",
    )
    _fails(
        capsys,
        ["budgets", "--suite", "mtbench", "--json", out, "--drafter", "medusa"],
        "argument --drafter: invalid choice",
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _fails(
        capsys,
        ["sweep", "--prompts", str(empty), "--json", out],
        "argument --prompts:",
        "no conversations (the file is empty)",
    )
    _fails(
        capsys,
        ["sweep", "--suite", "mtbench", "--json", str(tmp_path / "no" / "r.json")],
        "argument --json: cannot write",
    )
    if importlib.util.find_spec("matplotlib") is not None:
        _fails(
            capsys,
            ["sweep", "--suite", "mtbench", "--json", out, "--plot-dir", str(empty / "figures")],
            "argument --plot-dir:",
        )
    _fails(
        capsys,
        ["sweep", "--suite", "mtbench", "--json", out, "--drafter", "block", "--depth", "2,6"],
        "argument --drafter block with --nodes 4,8,16,32,64 --depth 2,6: depth 6 is above "
        "the block drafter's maximum 4",
    )


def test_missing_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(plots.PlotsUnavailableError, match="'plots' extra"):
        plots.require_matplotlib()
    _fails(
        capsys,
        [
            "sweep",
            "--suite",
            "mtbench",
            "--json",
            str(tmp_path / "r.json"),
            "--plot-dir",
            str(tmp_path),
        ],
        "argument --plot-dir: plots need matplotlib",
    )


# ----------------------------------------------------------------------------- commands


def _png(path):
    assert path.read_bytes()[:8] == PNG_MAGIC, path


CONVERSATIONS = [
    {"id": "a", "category": "writing", "turns": ["abcabcabc", "again abc"]},
    {"id": "b", "category": "code", "turns": ["def f(x): return x"]},
]


def test_sweep_command_end_to_end(teacher, tmp_path, capsys):  # noqa: F811
    pytest.importorskip("matplotlib")
    out, figures = tmp_path / "sweep.json", tmp_path / "figs"
    rc = cli_experiments.main(
        [
            "sweep",
            "--prompts",
            _prompts(tmp_path, CONVERSATIONS[:1]),
            "--nodes",
            "2,4",
            "--depth",
            "2",
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
            "--plot-dir",
            str(figures),
            "--no-progress",
        ],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["greedy", "ngram n=2 d=2", "ngram n=4 d=2"]
    experiment = report["experiment"]
    assert (experiment["name"], experiment["turns"], experiment["max_new_tokens"]) == (
        "sweep",
        2,
        8,
    )
    assert experiment["nodes"] == [2, 4] and experiment["depths"] == [2]
    for cell in experiment["cells"]:
        rows = [t["methods"][cell["method"]] for t in report["turns"]]
        assert cell["mean_speedup"] == pytest.approx(sum(r["speedup"] for r in rows) / 2)
        assert cell["mean_accepted_length"] == pytest.approx(
            sum(r["accepted_length"] for r in rows) / 2
        )
        assert cell["identical_fraction"] == 1.0  # greedy acceptance is lossless
    best = max(experiment["cells"], key=lambda c: c["mean_speedup"])
    assert experiment["sweet_spot"]["method"] == best["method"]
    printed = capsys.readouterr().out
    assert "sweet spot" in printed and "depth \\ nodes" in printed
    for name in ("sweep_ngram_speedup.png", "sweep_ngram_accepted_length.png"):
        _png(figures / name)
    # The bench figures work on any report, this one included.
    (written,) = plots.write_bench_plots(out, tmp_path / "bench")
    _png(written)


def test_window_command_end_to_end(teacher, tmp_path, capsys):  # noqa: F811
    pytest.importorskip("matplotlib")
    out = tmp_path / "w.json"
    rc = cli_experiments.main(
        [
            "ablate-window",
            "--prompts",
            _prompts(tmp_path, CONVERSATIONS[1:]),
            "--windows",
            "full,6",
            "--nodes",
            "4",
            "--depth",
            "2",
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
            "--plot-dir",
            str(tmp_path),
            "--no-progress",
        ],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert rc == 0
    experiment = json.loads(out.read_text())["experiment"]
    assert [c["window"] for c in experiment["cells"]] == [6, None]
    assert [c["method"] for c in experiment["cells"]] == ["ngram w=6", "ngram w=full"]
    assert "full" in capsys.readouterr().out
    _png(tmp_path / "window_ngram.png")


def test_budgets_command_end_to_end(teacher, tmp_path, capsys, block_drafter):  # noqa: F811
    pytest.importorskip("matplotlib")
    out = tmp_path / "b.json"
    rc = cli_experiments.main(
        [
            "budgets",
            "--prompts",
            _prompts(tmp_path, CONVERSATIONS),
            "--budgets",
            "2,4",
            "--depth",
            "3",
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
            "--plot-dir",
            str(tmp_path),
            "--no-progress",
        ],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert list(report["methods"]) == ["greedy", "block b=2", "block b=4", "block auto<=4"]
    rows = report["experiment"]["comparison"]["categories"]
    assert [r["category"] for r in rows] == ["writing", "code", grids.ALL_TURNS]
    assert [r["turns"] for r in rows] == [2, 1, 3]
    for turn in report["turns"]:
        assert turn["methods"]["block auto<=4"]["identical_to_greedy"]
    code = rows[1]
    speedups = report["turns"][2]["methods"]
    assert code["auto_speedup"] == pytest.approx(speedups["block auto<=4"]["speedup"])
    best = max((2, 4), key=lambda b: speedups[f"block b={b}"]["speedup"])
    assert code["best_budget"] == best
    assert "target (auto within 5%" in capsys.readouterr().out
    _png(tmp_path / "budgets_block.png")


# ----------------------------------------------------------------------------- figures


def test_figures_handle_missing_values(tmp_path):
    pytest.importorskip("matplotlib")
    _png(
        plots.heatmap(
            [[1.2, None], [0.8, 1.0]],
            rows=[2, 4],
            cols=[4, 8],
            path=tmp_path / "h.png",
            title="t",
            xlabel="x",
            ylabel="y",
            colorbar_label="c",
            center=1.0,
            highlight=(0, 0),
        )
    )
    _png(
        plots.grouped_bars(
            ["a", "b"],
            {"s": [1.0, None], "t": [0.5, 2.0]},
            path=tmp_path / "g.png",
            title="t",
            xlabel="x",
            ylabel="y",
            group_notes=["n1", "n2"],
        )
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.png", "h.png"]  # no temp files
    with pytest.raises(ValueError, match="no method besides greedy"):
        plots.speedup_distribution({"methods": {"greedy": {}}, "turns": [{}]}, tmp_path / "d.png")


def test_budget_grid_of_a_tree_drafter():
    """n-gram / EAGLE-3 build their own trees: fixed cells keep policy 'drafter', the
    controller cell prunes the largest tree under 'auto'."""
    methods = grids.budget_methods("ngram", (2, 8), depth=3, max_new_tokens=8)
    assert [m.name for m in methods] == ["ngram b=2", "ngram b=8", "ngram auto<=8"]
    assert [m.spec.policy for m in methods] == ["drafter", "drafter", "auto"]
    assert [m.spec.budget for m in methods] == [2, 8, 8]
    assert [m.drafter.budget for m in methods] == [2, 8, 8]


def test_cells_run_in_groups_each_beside_greedy(teacher, tmp_path, monkeypatch):  # noqa: F811
    """With one cell per group every cell still gets its per-turn records and speed-ups
    (against the greedy run of its own group), and the summary covers every cell."""
    monkeypatch.setattr(experiments, "CELLS_PER_RUN", 1)
    out = tmp_path / "sweep.json"
    rc = cli_experiments.main(
        [
            "sweep",
            "--prompts",
            _prompts(tmp_path, CONVERSATIONS[:1]),
            "--nodes",
            "2,4",
            "--depth",
            "2,3",
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
            "--no-progress",
        ],
        teacher=teacher,
        renderer=ToyRenderer(),
    )
    assert rc == 0
    report = json.loads(out.read_text())
    cells = ["ngram n=2 d=2", "ngram n=4 d=2", "ngram n=2 d=3", "ngram n=4 d=3"]
    assert sorted(report["groups"]) == sorted([c] for c in cells)
    assert set(report["summary"]) == {"greedy", *cells}
    for turn in report["turns"]:
        assert set(turn["methods"]) == {"greedy", *cells}
        for name in cells:
            record = turn["methods"][name]
            assert record["identical_to_greedy"] and record["speedup"] > 0
