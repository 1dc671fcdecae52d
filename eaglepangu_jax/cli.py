"""The ``eaglepangu`` command: generate, benchmark side by side, read traces, run the demo.

Every flag is checked before the model loads, so a typo costs a second, not a model load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from eaglepangu_jax import bench
from eaglepangu_jax.engine.config import POLICIES, SpecConfig
from eaglepangu_jax.suites import (SUITES, Conversation, load_prompts, load_suite,
                                   per_category)

DRAFTER_CHOICES = ("none", "ngram", "eagle3", "block")
DEMO_MAX_NEW_TOKENS = 96
# Two MT-Bench openings (an editing task and a coding task) and one HumanEval problem.
DEMO_TURNS = (("mtbench", "90"), ("mtbench", "122"), ("humaneval", "HumanEval/0"))

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


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the hand-written layout of descriptions; shows the defaults worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = action.default is None or isinstance(action.default, bool) \
            or action.default == argparse.SUPPRESS
        if action.option_strings and not hidden and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


# ----------------------------------------------------------------------------- the parser


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number of tree nodes, "
                                         f"got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"budget must be >= 1 tree node, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_tree_options(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=_positive, default=max_new_tokens, metavar="N",
                   help="tokens to generate per answer (fewer if the model stops)")
    p.add_argument("--budget", type=_budget, default="auto", metavar="{auto,N}",
                   help=f"tree nodes verified per round, root excluded; 'auto' = "
                        f"{bench.DEFAULT_BUDGET} (with --policy auto: the ceiling under which "
                        f"the controller chooses each round)")
    p.add_argument("--depth", type=_positive, default=None, metavar="D",
                   help=f"deepest tree node (default: {bench.DEFAULT_DEPTH} for ngram, the "
                        f"shipped head's own depth for eagle3)")
    p.add_argument("--policy", choices=POLICIES, default="drafter",
                   help="tree shape: 'drafter' = the drafter's own tree; 'best_first' = the "
                        "top-budget prefixes of per-depth marginals; 'auto' = best-first with "
                        "a roofline controller choosing the node count; 'static' = a fixed "
                        "topology")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``eaglepangu`` (all sub-commands)."""
    parser = argparse.ArgumentParser(prog="eaglepangu", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", metavar="DIR", default=None,
                       help="keep compiled XLA programs in DIR, so that later runs skip "
                            "compilation (default: the 'xla' folder of the weights cache, "
                            "$EAGLEPANGU_CACHE or ~/.cache/eaglepangu)")
    cache.add_argument("--no-compile-cache", dest="compile_cache", action="store_const",
                       const="", help="compile everything afresh, keep nothing")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    g = sub.add_parser(
        "generate", formatter_class=_Formatter, help="answer one prompt",
        description="Generate an answer to PROMPT with the real teacher and report tokens/s\n"
                    "(compilation excluded) and the accepted length: tokens per verify round,\n"
                    "the bonus token included (plain decoding scores 1.00).",
        epilog='example:\n  eaglepangu generate "What is the capital of France?" '
               '--drafter ngram --max-new-tokens 32')
    g.add_argument("prompt", metavar="PROMPT", help="the user message (or raw text with --raw)")
    _add_tree_options(g, max_new_tokens=128)
    g.add_argument("--drafter", choices=DRAFTER_CHOICES, default=None,
                   help="'none' = plain greedy/sampled decoding; default: eagle3 if its "
                        "shipped weights load, else ngram")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (output identical to plain greedy decoding); > 0 = "
                        "lossless speculative sampling")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap PROMPT in the model's chat template")
    chat.add_argument("--raw", dest="chat", action="store_false",
                      help="feed PROMPT as plain text (continue it)")
    g.add_argument("--trace", metavar="FILE", default=None,
                   help="write one JSON record per round (docs/TRACE_SCHEMA.md); runs the "
                        "slower host-driven loop so that each phase can be timed")
    g.add_argument("--json", metavar="FILE", default=None, help="write the result as JSON")

    b = sub.add_parser(
        "bench", formatter_class=_Formatter, help="side-by-side benchmark",
        description="Run the methods one after another on every turn (greedy first: it is the\n"
                    "reference), on the same teacher. Later turns of a conversation follow the\n"
                    "greedy answers. Compilation is excluded from the timings and reported\n"
                    "apart. Prints a summary table and writes every turn's figures to --json.",
        epilog="prompt files are JSON Lines, one conversation per line:\n"
               '  {"id": "q1", "turns": ["Write a poem.", "Now make it shorter."]}\n'
               '  {"question_id": 7, "turns": ["def add(a, b):"]}\n\n'
               "example:\n  eaglepangu bench --suite mtbench --limit 5 "
               "--methods greedy,ngram --json mt.json")
    source = b.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", metavar="FILE.jsonl", help="conversations to run")
    source.add_argument("--suite", choices=SUITES, help="a shipped prompt suite")
    b.add_argument("--limit", type=_positive, default=None, metavar="N",
                   help="run only the first N conversations")
    b.add_argument("--per-category", type=_positive, default=None, metavar="N",
                   help="run only the first N conversations of every category (applied "
                        "before --limit)")
    _add_tree_options(b, max_new_tokens=128)
    b.add_argument("--methods", default=None, metavar="LIST",
                   help=f"comma-separated, from {', '.join(bench.METHODS)}; greedy always "
                        f"runs first (default: greedy,ngram and eagle3 if it loads)")
    b.add_argument("--json", metavar="OUT", required=True, help="where to write the report")
    b.add_argument("--torch-threads", type=_positive, default=None, metavar="N",
                   help="torch threads for the transformers-* methods (default: torch's own; "
                        "1 is steadier on a loaded machine)")
    b.add_argument("--plot-dir", metavar="DIR", default=None,
                   help="also draw the speed-up per category (PNG) into DIR; needs the "
                        "'plots' extra")
    b.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")

    t = sub.add_parser("trace", formatter_class=_Formatter, help="read traces",
                       description="Read traces written by 'eaglepangu generate --trace'.")
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    ts = tsub.add_parser("summarize", formatter_class=_Formatter,
                         help="per-phase totals and the acceptance histogram",
                         description="Per-phase time totals and the histogram of accepted "
                                     "lengths of a trace file.")
    ts.add_argument("file", metavar="FILE", help="a trace (JSON Lines)")
    ts.add_argument("--json", metavar="OUT", default=None, help="also write the summary as JSON")

    d = sub.add_parser(
        "demo", formatter_class=_Formatter, help="a few-minute side-by-side demo",
        description=f"Greedy vs the shipped drafter (eagle3 if available, else ngram) and\n"
                    f"ngram on {len(DEMO_TURNS)} short turns (MT-Bench and HumanEval), "
                    f"{DEMO_MAX_NEW_TOKENS} new tokens each.\n"
                    f"Prints tokens/s, speed-up over greedy, accepted length and whether each\n"
                    f"output is identical to greedy's.")
    d.add_argument("--json", metavar="OUT", default=None, help="also write the report")
    d.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    tr = sub.add_parser(
        "train-draft", formatter_class=_Formatter, add_help=False,
        help="reproduce a shipped drafter, --kind eagle3 or block (self-distillation + "
             "training)",
        description="Self-distil training data from the teacher (cached shards), build the\n"
                    "draft vocabulary, train the head; '--help' after it lists its options.")
    from eaglepangu_jax import calibrate, experiments

    c = sub.add_parser(
        "calibrate", formatter_class=_Formatter, help="time the verify forward, fit the roofline",
        description="Time the teacher's verify forward on this machine over a grid of tree\n"
                    "sizes and contexts, the engine's per-round overhead and each drafter's\n"
                    "cost; fit the roofline, save it (JSON) where '--policy auto' finds it,\n"
                    "and plot measured vs predicted latency.",
        epilog="example:\n  eaglepangu calibrate --repeats 3 --plot calibration.png")
    calibrate.add_arguments(c)
    c.set_defaults(command_parser=c)
    for name, (add_arguments, _) in experiments.COMMANDS.items():
        e = sub.add_parser(name, formatter_class=_Formatter,
                           help=experiments.DESCRIPTIONS[name].split(";")[0],
                           description=experiments.DESCRIPTIONS[name])
        add_arguments(e)
        e.set_defaults(command_parser=e)
    for command_parser in (g, b, ts, d):
        command_parser.set_defaults(command_parser=command_parser)
    return parser


# ----------------------------------------------------------------------------- checks


def _depth(args: argparse.Namespace) -> tuple[int, bool]:
    """The depth to use, and whether it is a default (see ``bench.make_method``)."""
    if args.depth is None:
        return bench.DEFAULT_DEPTH, True
    return args.depth, False


def _spec(parser: argparse.ArgumentParser, args: argparse.Namespace, **extra: Any
          ) -> SpecConfig:
    depth, _ = _depth(args)
    budget = bench.DEFAULT_BUDGET if args.budget == "auto" else args.budget
    try:
        return SpecConfig(policy=args.policy, budget=budget, depth=depth,
                          max_new_tokens=args.max_new_tokens, **extra)
    except ValueError as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


def _writable(parser: argparse.ArgumentParser, path: str | None, what: str) -> None:
    if path is not None and not Path(path).resolve().parent.is_dir():
        parser.error(f"cannot write the {what} {path}: its folder does not exist")


def _method(parser: argparse.ArgumentParser, name: str, spec: SpecConfig, default: bool,
            torch_threads: int | None = None) -> bench.Method:
    try:
        return bench.make_method(name, spec, default_depth=default,
                                 torch_threads=torch_threads)
    except (ValueError, bench.DrafterUnavailableError) as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- loading


def load_teacher():
    """The real teacher (SmolLM2-135M-Instruct, float32, weights laid out per layer)."""
    from eaglepangu_jax.engine.generate import Teacher
    from eaglepangu_jax.models import llama
    from eaglepangu_jax.models.smollm2 import load_smollm2

    config, params = load_smollm2()
    return Teacher(config, llama.prepare_params(params))


def load_renderer() -> bench.ChatRenderer:
    """The teacher's chat template and tokenizer."""
    from eaglepangu_jax.models.tokenizer import load_tokenizer

    return bench.ChatRenderer(load_tokenizer())


def enable_compile_cache(path: str | None) -> None:
    """Turn on JAX's persistent compilation cache in ``path`` (default folder if ``None``;
    off if empty). Compiling the decode loop takes tens of seconds per shape on a small CPU;
    with the cache a second run of the same command reads the programs back."""
    if path == "":
        return
    import jax

    from eaglepangu_jax.models import weights_cache

    folder = Path(path) if path is not None else weights_cache.resolve_cache_dir() / "xla"
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- commands


def cmd_generate(parser, args, teacher=None, renderer=None) -> int:
    """``eaglepangu generate``."""
    if args.temperature < 0:
        parser.error(f"temperature must be >= 0, got {args.temperature}")
    sampling = dict(acceptance="sample" if args.temperature > 0 else "greedy",
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    spec = _spec(parser, args, **sampling)
    _writable(parser, args.json, "JSON output")
    _writable(parser, args.trace, "trace")
    _, default = _depth(args)
    name = args.drafter
    if name is None:
        try:
            method = bench.make_method("eagle3", spec, default_depth=default)
        except (ValueError, bench.DrafterUnavailableError) as err:
            _note(f"drafter: ngram (eagle3 unavailable: {err})")
            method = _method(parser, "ngram", spec, default)
        else:
            _note("drafter: eagle3 (shipped weights)")
    else:
        method = _method(parser, "greedy" if name == "none" else name, spec, default)
        _note(f"drafter: {name}")

    teacher = teacher if teacher is not None else load_teacher()
    renderer = renderer if renderer is not None else load_renderer()
    if args.chat:
        prompt_ids = renderer.encode([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = renderer.encode_text(args.prompt)
    result, compile_s = _generate(teacher, method, prompt_ids, args.trace)
    text = renderer.decode(result.tokens)
    stats = result.stats
    seconds = max(stats.seconds - compile_s, 1e-9)
    label = method.name if method.drafter is not None else "none"
    print(text)
    print(f"[{label}] "
          f"{stats.new_tokens} tokens in {seconds:.2f} s: {stats.new_tokens / seconds:.1f} "
          f"tokens/s, accepted length {stats.accepted_length:.2f} over {stats.rounds} rounds"
          f" ({compile_s:.1f} s of compilation excluded)")
    if args.trace:
        _note(f"trace written to {args.trace} (eaglepangu trace summarize {args.trace})")
    if args.json:
        record = {
            "prompt": args.prompt, "prompt_ids": list(prompt_ids), "tokens": result.tokens,
            "text": text, "drafter": label,
            "spec": dataclasses.asdict(method.spec), "new_tokens": stats.new_tokens,
            "seconds": seconds, "compile_seconds": compile_s,
            "prefill_seconds": stats.prefill_seconds,
            "tokens_per_s": stats.new_tokens / seconds, "rounds": stats.rounds,
            "accepted_length": stats.accepted_length,
            "accepted_per_round": list(stats.accepted_per_round),
            "nodes_per_round": list(stats.nodes_per_round),
        }
        bench.write_report(args.json, record)
    return 0


def _generate(teacher, method: bench.Method, prompt_ids: list[int], trace_path: str | None):
    """One generation; returns the result and the compile seconds inside its decode time."""
    from eaglepangu_jax.engine.generate import generate
    from eaglepangu_jax.engine.trace import generate_traced

    verify_latency = bench.method_verify_latency(teacher.config, method, len(prompt_ids))
    watch = bench.CompileWatch()
    start = time.perf_counter()
    with watch.active():
        if trace_path:
            result = generate_traced(teacher, method.drafter, prompt_ids, method.spec,
                                     draft_params=method.draft_params, trace_path=trace_path,
                                     verify_latency=verify_latency)
        else:
            result = generate(teacher, method.drafter, prompt_ids, method.spec,
                              draft_params=method.draft_params, verify_latency=verify_latency)
    # Compilations that ended after the prefill belong to the decode time.
    return result, watch.seconds_after(start + result.stats.prefill_seconds)


def _conversations(parser, args) -> list[Conversation]:
    try:
        conversations = load_prompts(args.prompts) if args.prompts else load_suite(args.suite)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    if args.per_category:
        conversations = per_category(conversations, args.per_category)
    return conversations[: args.limit] if args.limit else conversations


def cmd_bench(parser, args, teacher=None, renderer=None) -> int:
    """``eaglepangu bench``."""
    try:
        names = bench.parse_methods(args.methods or "greedy,ngram")
    except ValueError as err:
        parser.error(str(err))
    spec = _spec(parser, args)
    _writable(parser, args.json, "report")
    conversations = _conversations(parser, args)
    _, default = _depth(args)
    methods = [_method(parser, name, spec, default, args.torch_threads) for name in names]
    if args.plot_dir is not None:
        from eaglepangu_jax import plots

        try:
            plots.require_matplotlib()
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)  # fail now, not after
        except (plots.PlotsUnavailableError, OSError) as err:
            parser.error(f"argument --plot-dir: {err}")
    if args.methods is None:
        try:
            methods.insert(1, bench.make_method("eagle3", spec, default_depth=default))
        except (ValueError, bench.DrafterUnavailableError) as err:
            _note(f"methods: greedy, ngram (eagle3 unavailable: {err})")
    report = _run(methods, conversations, teacher, renderer, args.progress)
    bench.write_report(args.json, report)
    print(bench.format_summary(report))
    _note(f"report written to {args.json}")
    if args.plot_dir is not None:
        from eaglepangu_jax import plots

        for path in plots.write_bench_plots(report, args.plot_dir):
            _note(f"figure written to {path}")
    return 0


def _run(methods, conversations, teacher, renderer, progress) -> dict[str, Any]:
    teacher = teacher if teacher is not None else load_teacher()
    renderer = renderer if renderer is not None else load_renderer()
    return bench.run_bench(teacher, conversations, methods, renderer, progress=progress)


def cmd_trace(parser, args) -> int:
    """``eaglepangu trace summarize``."""
    from eaglepangu_jax.engine.trace import summarize, write_text_atomic

    try:
        summary = summarize(args.file)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    if args.json:
        _writable(parser, args.json, "summary")
        write_text_atomic(args.json, json.dumps(summary.to_json(), indent=1) + "\n")
    print(summary.to_text())
    return 0


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


def cmd_demo(parser, args, teacher=None, renderer=None) -> int:
    """``eaglepangu demo``."""
    _writable(parser, args.json, "report")
    spec = SpecConfig(budget=bench.DEFAULT_BUDGET, depth=bench.DEFAULT_DEPTH,
                      max_new_tokens=DEMO_MAX_NEW_TOKENS)
    methods = [bench.make_method("greedy", spec)]
    try:
        methods.append(bench.make_method("eagle3", spec, default_depth=True))
        _note("shipped drafter: eagle3")
    except (ValueError, bench.DrafterUnavailableError) as err:
        _note(f"shipped drafter: ngram (eagle3 unavailable: {err})")
    methods.append(bench.make_method("ngram", spec))
    conversations = demo_conversations()
    _note(f"loading SmolLM2-135M-Instruct; {len(conversations)} turns x {len(methods)} methods, "
          f"{DEMO_MAX_NEW_TOKENS} new tokens each (the first run of each shape compiles)")
    report = _run(methods, conversations, teacher, renderer, args.progress)
    if args.json:
        bench.write_report(args.json, report)
    print(bench.format_turns(report))
    print()
    print(bench.format_summary(report))
    return 0


def main(argv: Sequence[str] | None = None, *, teacher: Any = None, renderer: Any = None
         ) -> int:
    """Entry point of ``eaglepangu``.

    Args:
      argv: the arguments (default: ``sys.argv[1:]``).
      teacher, renderer: use these instead of loading SmolLM2 and its chat template (tests,
        embedding); ``renderer`` follows :class:`eaglepangu_jax.bench.Renderer`.

    Returns:
      The exit status (bad flags exit with status 2 before any model is loaded).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train-draft"]:  # its own parser takes every option after the command
        from eaglepangu_jax.training.train import train_draft_main

        return train_draft_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = args.command_parser  # errors name the sub-command's usage
    if args.command != "trace":
        enable_compile_cache(args.compile_cache)
    if args.command == "generate":
        return cmd_generate(sub, args, teacher, renderer)
    if args.command == "bench":
        return cmd_bench(sub, args, teacher, renderer)
    if args.command == "trace":
        return cmd_trace(sub, args)
    if args.command == "demo":
        return cmd_demo(sub, args, teacher, renderer)
    if args.command == "calibrate":
        from eaglepangu_jax import calibrate

        return calibrate.run(args, teacher=teacher)
    from eaglepangu_jax import experiments

    return experiments.COMMANDS[args.command][1](args, teacher=teacher, renderer=renderer)


if __name__ == "__main__":
    sys.exit(main())
