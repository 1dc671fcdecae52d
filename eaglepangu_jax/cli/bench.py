"""``eaglepangu bench`` and ``eaglepangu demo``: methods side by side with greedy."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration.auto import calibrated_methods
from eaglepangu_jax.cli import args as args_lib
from eaglepangu_jax.cli import backend as backend_lib
from eaglepangu_jax.drafters.registry import DrafterUnavailableError
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation import plots
from eaglepangu_jax.evaluation.report import format_summary, format_turns, write_report
from eaglepangu_jax.evaluation.run import run_bench
from eaglepangu_jax.evaluation.suites import (
    SUITES,
    Conversation,
    load_prompts,
    load_suite,
    per_category,
)
from eaglepangu_jax.methods.registry import (
    DEFAULT_BUDGET,
    DEFAULT_DEPTH,
    METHODS,
    Method,
    make_method,
    parse_methods,
)
from eaglepangu_jax.models.config import LlamaConfig

__all__ = [
    "add_bench_parser",
    "add_demo_parser",
    "run_bench_command",
    "run_demo",
    "demo_conversations",
    "demo_methods",
    "DEMO_TURNS",
    "DEMO_MAX_NEW_TOKENS",
]

DEMO_MAX_NEW_TOKENS = 96
# Two MT-Bench openings (an editing task and a coding task) and one HumanEval problem, each
# short enough that prompt, answer and a full tree fit the 256-slot attention window: every
# method then compiles one decode loop, not a second one for the 512-slot window.
# (HumanEval/0, 179 prompt tokens, needed the second: with the block drafter added, the
# compile seconds on a fresh clone came to 90.2 s, over the 90 s the demo is held to.)
DEMO_TURNS = (("mtbench", "90"), ("mtbench", "122"), ("humaneval", "HumanEval/2"))


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench`` to the sub-command set ``sub``."""
    b = sub.add_parser(
        "bench",
        formatter_class=args_lib.Formatter,
        help="side-by-side benchmark",
        description="Run the methods one after another on every turn (greedy first: it is the\n"
        "reference), on the same teacher. Later turns of a conversation follow the\n"
        "greedy answers. Compilation is excluded from the timings and reported\n"
        "apart. Prints a summary table and writes every turn's figures to --json.",
        epilog="prompt files are JSON Lines, one conversation per line:\n"
        '  {"id": "q1", "turns": ["Write a poem.", "Now make it shorter."]}\n'
        '  {"question_id": 7, "turns": ["def add(a, b):"]}\n\n'
        "example:\n  eaglepangu bench --suite mtbench --limit 5 "
        "--methods greedy,ngram --json mt.json",
    )
    source = b.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", metavar="FILE.jsonl", help="conversations to run")
    source.add_argument("--suite", choices=SUITES, help="a shipped prompt suite")
    b.add_argument(
        "--limit",
        type=args_lib.positive,
        default=None,
        metavar="N",
        help="run only the first N conversations",
    )
    b.add_argument(
        "--per-category",
        type=args_lib.positive,
        default=None,
        metavar="N",
        help="run only the first N conversations of every category (applied before --limit)",
    )
    args_lib.add_tree_options(b, max_new_tokens=128)
    b.add_argument(
        "--methods",
        default=None,
        metavar="LIST",
        help=f"comma-separated, from {', '.join(METHODS)}; NAME:D runs a drafter at "
        f"tree depth D (e.g. eagle3:4,eagle3:6, side by side); greedy always "
        f"runs first (default: greedy,ngram and eagle3 if it loads)",
    )
    b.add_argument("--json", metavar="OUT", required=True, help="where to write the report")
    b.add_argument(
        "--torch-threads",
        type=args_lib.positive,
        default=None,
        metavar="N",
        help="torch threads for the transformers-* methods (default: torch's own; "
        "1 is steadier on a loaded machine)",
    )
    b.add_argument(
        "--plot-dir",
        metavar="DIR",
        default=None,
        help="also draw the speed-up per category (PNG) into DIR; needs the 'plots' extra",
    )
    b.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    backend_lib.add_option(b)
    return b


def add_demo_parser(sub) -> argparse.ArgumentParser:
    """Add ``demo`` to the sub-command set ``sub``."""
    d = sub.add_parser(
        "demo",
        formatter_class=args_lib.Formatter,
        help="a few-minute side-by-side demo",
        description=f"Greedy vs the shipped drafter (eagle3 if available, else ngram),\n"
        f"ngram, ngram-corpus, block and ngram-eagle3 on {len(DEMO_TURNS)} short turns "
        f"(MT-Bench and "
        f"HumanEval), "
        f"{DEMO_MAX_NEW_TOKENS} new tokens each.\n"
        f"Prints tokens/s, speed-up over greedy, accepted length and whether each\n"
        f"output is identical to greedy's.",
    )
    d.add_argument("--json", metavar="OUT", default=None, help="also write the report")
    d.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return d


def _conversations(parser, args) -> list[Conversation]:
    try:
        conversations = load_prompts(args.prompts) if args.prompts else load_suite(args.suite)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    if args.per_category:
        conversations = per_category(conversations, args.per_category)
    return conversations[: args.limit] if args.limit else conversations


def run_bench_command(parser, args, teacher=None, renderer=None) -> int:
    """``eaglepangu bench``."""
    try:
        names = parse_methods(args.methods or "greedy,ngram")
    except ValueError as err:
        parser.error(str(err))
    spec = args_lib.spec_of(parser, args)
    args_lib.writable(parser, args.json, "report")
    conversations = _conversations(parser, args)
    device = backend_lib.torch_device(parser, args)
    _, default = args_lib.depth_of(args)
    default_budget = args_lib.budget_is_default(args)
    methods = [
        args_lib.method_of(
            parser,
            name,
            spec,
            default,
            args.torch_threads,
            args.draft_top_k,
            args.draft_tree,
            default_budget=default_budget,
        )
        for name in names
    ]
    if args.plot_dir is not None:
        try:
            plots.require_matplotlib()
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)  # fail now, not after
        except (plots.PlotsUnavailableError, OSError) as err:
            parser.error(f"argument --plot-dir: {err}")
    if args.methods is None:
        try:
            methods.insert(
                1,
                make_method("eagle3", spec, default_depth=default, default_budget=default_budget),
            )
        except (ValueError, DrafterUnavailableError) as err:
            args_lib.note(f"methods: greedy, ngram (eagle3 unavailable: {err})")
    # The opening turns are encoded and checked against the teacher's shape before its
    # weights load (later turns follow greedy's answers: the engine checks them as they come).
    renderer = renderer if renderer is not None else runtime.load_renderer()
    config = teacher.config if teacher is not None else LlamaConfig.smollm2_135m()
    for c in conversations:
        prompt_ids = renderer.encode([{"role": "user", "content": c.turns[0]}])
        for method in methods:
            args_lib.check_prompt(parser, config, method, prompt_ids, f"conversation {c.id!r}: ")
    report = _run(methods, conversations, teacher, renderer, args.progress, device)
    write_report(args.json, report)
    print(format_summary(report))
    args_lib.note(f"report written to {args.json}")
    if args.plot_dir is not None:
        for path in plots.write_bench_plots(report, args.plot_dir):
            args_lib.note(f"figure written to {path}")
    return 0


def _run(methods, conversations, teacher, renderer, progress, device=None) -> dict[str, Any]:
    """Load what is not given and run; ``device``: the teacher in torch there (``--backend
    torch``; every engine method then runs through the torch runner)."""
    if teacher is None:  # the real model: its 'auto' runs read this machine's calibration
        teacher = runtime.load_teacher()
        methods, _ = calibrated_methods(teacher, methods, progress=progress)
    renderer = renderer if renderer is not None else runtime.load_renderer()
    if device is not None:
        methods = backend_lib.torch_methods(methods, teacher, device)
        args_lib.note(f"backend: torch on {device}")
    return run_bench(teacher, conversations, methods, renderer, progress=progress)


def demo_conversations() -> list[Conversation]:
    """The demo's turns: the opening message of each of :data:`DEMO_TURNS`."""
    suites: dict[str, dict[str, Conversation]] = {}
    chosen = []
    for suite, ident in DEMO_TURNS:
        if suite not in suites:
            suites[suite] = {c.id: c for c in load_suite(suite)}
        c = suites[suite][ident]
        chosen.append(dataclasses.replace(c, turns=c.turns[:1]))
    return chosen


def demo_methods() -> list[Method]:
    """The demo's methods at the settings a user gets by default: greedy, the shipped EAGLE-3
    head, n-gram, ngram-corpus, the block drafter and ngram-eagle3 (n-gram's tree with the
    head's node), each at its own default depth and budget
    (:data:`~eaglepangu_jax.methods.registry.DRAFTER_BUDGETS`). A shipped drafter whose files
    are missing or corrupt is left out with a note."""
    spec = SpecConfig(
        budget=DEFAULT_BUDGET, depth=DEFAULT_DEPTH, max_new_tokens=DEMO_MAX_NEW_TOKENS
    )
    methods = [make_method("greedy", spec)]
    for name in ("eagle3", "ngram", "ngram-corpus", "block", "ngram-eagle3"):
        try:
            methods.append(make_method(name, spec, default_depth=True, default_budget=True))
        except (ValueError, DrafterUnavailableError) as err:
            if name == "eagle3":
                args_lib.note(f"shipped drafter: ngram (eagle3 unavailable: {err})")
            else:
                args_lib.note(f"{name} drafter left out: {err}")
        else:
            if name == "eagle3":
                args_lib.note("shipped drafter: eagle3")
    return methods


def run_demo(parser, args, teacher=None, renderer=None) -> int:
    """``eaglepangu demo``."""
    args_lib.writable(parser, args.json, "report")
    methods = demo_methods()
    conversations = demo_conversations()
    args_lib.note(
        f"loading SmolLM2-135M-Instruct; {len(conversations)} turns x {len(methods)} methods, "
        f"{DEMO_MAX_NEW_TOKENS} new tokens each (the first run of each shape compiles)"
    )
    report = _run(methods, conversations, teacher, renderer, args.progress)
    if args.json:
        write_report(args.json, report)
    print(format_turns(report))
    print()
    print(format_summary(report))
    return 0
