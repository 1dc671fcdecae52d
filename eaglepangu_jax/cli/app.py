"""The ``eaglepangu`` command: generate, benchmark side by side, read traces, run the demo,
calibrate, run experiments, train drafters.

Every flag is checked before the model loads, so a typo costs a second, not a model load. A
bad value, file or setting ends with one ``error:`` line that names the problem and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from eaglepangu_jax import runtime
from eaglepangu_jax.cli import args as args_lib
from eaglepangu_jax.cli import bench as bench_cli
from eaglepangu_jax.cli import calibrate as calibrate_cli
from eaglepangu_jax.cli import corpus as corpus_cli
from eaglepangu_jax.cli import errors
from eaglepangu_jax.cli import experiments as experiments_cli
from eaglepangu_jax.cli import generate as generate_cli
from eaglepangu_jax.cli import ngram_table as ngram_table_cli
from eaglepangu_jax.cli import trace as trace_cli

__all__ = ["build_parser", "main"]

DESCRIPTION = """\
Tree speculative decoding in JAX on SmolLM2-135M-Instruct: a drafter proposes a tree of
continuations, the teacher verifies the whole tree in one forward pass, and every accepted
token is exactly what the teacher would have produced on its own.

commands:
  generate   answer one prompt and report tokens/s and the accepted length
  bench      run greedy and speculative methods side by side on a prompt suite
  trace      read the per-round traces written by 'generate --trace'
  demo       a few-minute side-by-side comparison (what 'make run' shows)

experiments (each a grid of settings run side by side with greedy; JSON + PNG):
  sweep          tree nodes x max depth: speed-up and accepted length, the sweet spot
  ablate-window  the drafter sees only the last W tokens (W = 128, 256, 512, full)
  budgets        best-first at fixed budgets vs the 'auto' roofline controller, per category
  calibrate      time the verify forward on this machine, fit the roofline, save it
  train-draft    reproduce a shipped drafter (self-distillation + training)
  corpus         grow the self-distilled corpus: user turns the teacher writes, its answers
  ngram-table    count the corpus n-gram table the ngram-corpus drafter reads
"""

EPILOG = """\
examples:
  eaglepangu generate "What is the capital of France?"
  eaglepangu generate "Write a Python function that reverses a list." --drafter ngram \\
      --max-new-tokens 128 --json out.json
  eaglepangu generate "Tell me a story." --temperature 0.7 --top-p 0.9 --seed 1
  eaglepangu generate "List the planets." --trace trace.jsonl
  eaglepangu trace summarize trace.jsonl
  eaglepangu bench --suite humaneval --limit 3 --max-new-tokens 64 \\
      --methods greedy,ngram --json bench.json
  eaglepangu bench --prompts my_prompts.jsonl --json bench.json
  eaglepangu demo
  eaglepangu --no-compile-cache demo
  eaglepangu sweep --drafter ngram --nodes 4,8,16 --depth 2,4,6 --suite mtbench-humaneval \
      --limit 4 --json sweep.json --plot-dir plots
  eaglepangu ablate-window --drafter eagle3 --suite mtbench --limit 4 --json window.json
  eaglepangu budgets --drafter block --suite mtbench-humaneval --limit 8 --json budgets.json

Compiled programs are kept on disk (see --compile-cache), so the first run of a command
compiles for a while and later runs start quickly.
Run 'eaglepangu COMMAND --help' for the options of one command.
"""


def _add_cache_options(parser: argparse.ArgumentParser) -> None:
    """The global options, given before the command."""
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache",
        metavar="DIR",
        default=None,
        help="keep compiled XLA programs in DIR, so that later runs skip "
        "compilation (default: the 'xla' folder of the weights cache, "
        "$EAGLEPANGU_CACHE or ~/.cache/eaglepangu)",
    )
    cache.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_const",
        const="",
        help="compile everything afresh, keep nothing",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``eaglepangu`` (all sub-commands)."""
    parser = argparse.ArgumentParser(
        prog="eaglepangu",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_cache_options(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    g = generate_cli.add_parser(sub)
    b = bench_cli.add_bench_parser(sub)
    ts = trace_cli.add_parser(sub)
    d = bench_cli.add_demo_parser(sub)
    sub.add_parser(
        "train-draft",
        formatter_class=args_lib.Formatter,
        add_help=False,
        help="reproduce a shipped drafter, --kind eagle3 or block (self-distillation + training)",
        description="Self-distil training data from the teacher (cached shards), build the\n"
        "draft vocabulary, train the head; '--help' after it lists its options.",
    )
    c = sub.add_parser(
        "calibrate",
        formatter_class=args_lib.Formatter,
        help="time the verify forward, fit the roofline",
        description="Time the teacher's verify forward on this machine over a grid of tree\n"
        "sizes and contexts, the engine's per-round overhead and each drafter's\n"
        "cost; fit the roofline, save it (JSON) where '--policy auto' finds it,\n"
        "and plot measured vs predicted latency.",
        epilog="example:\n  eaglepangu calibrate --repeats 3 --plot calibration.png",
    )
    calibrate_cli.add_arguments(c)
    c.set_defaults(command_parser=c)
    k = sub.add_parser(
        "corpus",
        formatter_class=args_lib.Formatter,
        help="grow the self-distilled corpus (resumable; --ray-address for Ray)",
        description="Sample user turns from the teacher's pre-query template, filter and\n"
        "deduplicate them, drop any that overlaps MT-Bench or HumanEval, mix in the\n"
        "template prompts, and answer them greedily in batches, one content-addressed\n"
        "shard of token ids at a time, until the answers hold --target-tokens.\n"
        "With --written (or --conversations FILE), answer every turn of given\n"
        "conversations instead, each after the teacher's answers to the earlier ones.",
        epilog="examples:\n  eaglepangu corpus --target-tokens 1000000\n"
        "  eaglepangu corpus --summary\n  eaglepangu corpus --ray-address local\n"
        "  eaglepangu corpus --written          # into the package's corpus-written",
    )
    corpus_cli.add_arguments(k)
    k.set_defaults(command_parser=k)
    n = sub.add_parser(
        "ngram-table",
        formatter_class=args_lib.Formatter,
        help="count the corpus n-gram table of the ngram-corpus drafter",
        description="Count, over the training answers of the corpora, the most frequent next\n"
        "token after every context of one to three tokens; write the table the\n"
        "ngram-corpus drafter reads (safetensors + JSON with its provenance).",
        epilog="example:\n  eaglepangu ngram-table            # the packaged table, remade",
    )
    ngram_table_cli.add_arguments(n)
    n.set_defaults(command_parser=n)
    for name, (add_arguments, _) in experiments_cli.COMMANDS.items():
        e = sub.add_parser(
            name,
            formatter_class=args_lib.Formatter,
            help=experiments_cli.DESCRIPTIONS[name].split(";")[0],
            description=experiments_cli.DESCRIPTIONS[name],
        )
        add_arguments(e)
        e.set_defaults(command_parser=e)
    for command_parser in (g, b, ts, d):
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv: Sequence[str] | None = None, *, teacher: Any = None, renderer: Any = None) -> int:
    """Entry point of ``eaglepangu``.

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).
      teacher, renderer: use these instead of loading SmolLM2 and its chat template (tests,
        embedding); ``renderer`` follows :class:`eaglepangu_jax.evaluation.run.Renderer`.

    Returns:
      The exit status. Bad flags exit with status 2 before any model is loaded; so does any
      other user error (:func:`eaglepangu_jax.cli.errors.user_message`: a prompt too long for
      the teacher, a missing model package or optional dependency, a file that cannot be read
      or written), with one ``error:`` line and no traceback. Bugs keep their traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "train-draft" in argv:  # its own parser takes every option after the command
        at = argv.index("train-draft")
        options = argparse.ArgumentParser(prog="eaglepangu", add_help=False)
        _add_cache_options(options)
        known, rest = options.parse_known_args(argv[:at])
        if not rest:  # only global options before it (else it is some other command's text)
            from eaglepangu_jax.cli.train import train_draft_main

            given = known.compile_cache if at else False
            return train_draft_main(argv[at + 1 :], compile_cache=given)
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = args.command_parser  # errors name the sub-command's usage
    return errors.guard(sub, lambda: _dispatch(args, sub, teacher, renderer))


def _dispatch(args: argparse.Namespace, sub: argparse.ArgumentParser, teacher, renderer) -> int:
    if args.command != "trace":
        runtime.enable_compile_cache(args.compile_cache)
    if args.command == "generate":
        return generate_cli.run(sub, args, teacher, renderer)
    if args.command == "bench":
        return bench_cli.run_bench_command(sub, args, teacher, renderer)
    if args.command == "trace":
        return trace_cli.run(sub, args)
    if args.command == "demo":
        return bench_cli.run_demo(sub, args, teacher, renderer)
    if args.command == "calibrate":
        return calibrate_cli.run(args, teacher=teacher)
    if args.command == "corpus":
        return corpus_cli.run(sub, args, teacher=teacher)
    if args.command == "ngram-table":
        return ngram_table_cli.run(sub, args)
    return experiments_cli.COMMANDS[args.command][1](args, teacher=teacher, renderer=renderer)
