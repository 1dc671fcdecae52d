"""``eaglepangu generate``: answer one prompt, report tokens/s and the accepted length."""

from __future__ import annotations

import argparse
import dataclasses
import time

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration.auto import calibrated_methods
from eaglepangu_jax.calibration.curve import method_costs
from eaglepangu_jax.cli import args as args_lib
from eaglepangu_jax.cli import backend as backend_lib
from eaglepangu_jax.drafters.registry import NAMES as DRAFTER_NAMES
from eaglepangu_jax.drafters.registry import DrafterUnavailableError
from eaglepangu_jax.engine.decode import generate
from eaglepangu_jax.engine.trace import generate_traced
from eaglepangu_jax.evaluation.report import write_report
from eaglepangu_jax.evaluation.run import CompileWatch
from eaglepangu_jax.methods.registry import Method, make_method
from eaglepangu_jax.models.config import LlamaConfig

__all__ = ["add_parser", "run"]

DRAFTER_CHOICES = ("none", *DRAFTER_NAMES)


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``generate`` to the sub-command set ``sub``."""
    g = sub.add_parser(
        "generate",
        formatter_class=args_lib.Formatter,
        help="answer one prompt",
        description="Generate an answer to PROMPT with the real teacher and report tokens/s\n"
        "(compilation excluded) and the accepted length: tokens per verify round,\n"
        "the bonus token included (plain decoding scores 1.00).",
        epilog='example:\n  eaglepangu generate "What is the capital of France?" '
        "--drafter ngram --max-new-tokens 32",
    )
    g.add_argument("prompt", metavar="PROMPT", help="the user message (or raw text with --raw)")
    args_lib.add_tree_options(g, max_new_tokens=128)
    g.add_argument(
        "--drafter",
        choices=DRAFTER_CHOICES,
        default=None,
        help="'none' = plain greedy/sampled decoding; default: eagle3 if its "
        "shipped weights load, else ngram",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 = greedy (output identical to plain greedy decoding); > 0 = "
        "lossless speculative sampling",
    )
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=True,
        help="wrap PROMPT in the model's chat template",
    )
    chat.add_argument(
        "--raw", dest="chat", action="store_false", help="feed PROMPT as plain text (continue it)"
    )
    g.add_argument(
        "--trace",
        metavar="FILE",
        default=None,
        help="write one JSON record per round (docs/TRACE_SCHEMA.md); runs the "
        "slower host-driven loop so that each phase can be timed",
    )
    g.add_argument("--json", metavar="FILE", default=None, help="write the result as JSON")
    backend_lib.add_option(g)
    return g


def run(parser, args, teacher=None, renderer=None) -> int:
    """``eaglepangu generate``."""
    if args.temperature < 0:
        parser.error(f"temperature must be >= 0, got {args.temperature}")
    sampling = dict(
        acceptance="sample" if args.temperature > 0 else "greedy",
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    spec = args_lib.spec_of(parser, args, **sampling)
    args_lib.writable(parser, args.json, "JSON output")
    args_lib.writable(parser, args.trace, "trace")
    if args.trace and args.backend != "jax":
        parser.error("--trace times the JAX engine's phases; it needs --backend jax")
    device = backend_lib.torch_device(parser, args)
    _, default = args_lib.depth_of(args)
    default_budget = args_lib.budget_is_default(args)
    name = args.drafter
    if name is None:
        try:
            method = make_method(
                "eagle3", spec, default_depth=default, default_budget=default_budget
            )
        except (ValueError, DrafterUnavailableError) as err:
            args_lib.note(f"drafter: ngram (eagle3 unavailable: {err})")
            method = args_lib.method_of(
                parser, "ngram", spec, default, default_budget=default_budget
            )
        else:
            args_lib.note("drafter: eagle3 (shipped weights)")
    else:
        method = args_lib.method_of(
            parser,
            "greedy" if name == "none" else name,
            spec,
            default,
            draft_top_k=args.draft_top_k,
            draft_tree=args.draft_tree,
            default_budget=default_budget,
        )
        args_lib.note(f"drafter: {name}")

    # The prompt is encoded and checked against the teacher's shape before its weights load.
    renderer = renderer if renderer is not None else runtime.load_renderer()
    if args.chat:
        prompt_ids = renderer.encode([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = renderer.encode_text(args.prompt)
    config = teacher.config if teacher is not None else LlamaConfig.smollm2_135m()
    args_lib.check_prompt(parser, config, method, prompt_ids)
    if teacher is None:  # the real model: an 'auto' run reads this machine's calibration
        teacher = runtime.load_teacher()
        (method,), _ = calibrated_methods(teacher, [method])
    runner = None
    if device is not None:
        runner = backend_lib.torch_methods([method], teacher, device)[0].runner
        args_lib.note(f"backend: torch on {device}")
    result, compile_s = _generate(teacher, method, prompt_ids, args.trace, runner)
    text = renderer.decode(result.tokens)
    stats = result.stats
    seconds = max(stats.seconds - compile_s, 1e-9)
    label = method.name if method.drafter is not None else "none"
    print(text)
    print(
        f"[{label}] "
        f"{stats.new_tokens} tokens in {seconds:.2f} s: {stats.new_tokens / seconds:.1f} "
        f"tokens/s, accepted length {stats.accepted_length:.2f} over {stats.rounds} rounds"
        f" ({compile_s:.1f} s of compilation excluded)"
    )
    if args.trace:
        args_lib.note(f"trace written to {args.trace} (eaglepangu trace summarize {args.trace})")
    if args.json:
        record = {
            "prompt": args.prompt,
            "prompt_ids": list(prompt_ids),
            "tokens": result.tokens,
            "text": text,
            "drafter": label,
            "backend": args.backend,
            "spec": dataclasses.asdict(method.spec),
            "new_tokens": stats.new_tokens,
            "seconds": seconds,
            "compile_seconds": compile_s,
            "prefill_seconds": stats.prefill_seconds,
            "tokens_per_s": stats.new_tokens / seconds,
            "rounds": stats.rounds,
            "accepted_length": stats.accepted_length,
            "accepted_per_round": list(stats.accepted_per_round),
            "nodes_per_round": list(stats.nodes_per_round),
        }
        write_report(args.json, record)
    return 0


def _generate(teacher, method: Method, prompt_ids: list[int], trace_path: str | None, runner=None):
    """One generation (by ``runner``, a peer-like runner, when given); returns the result and
    the compile seconds inside its decode time."""
    verify_latency, draft_seconds = method_costs(teacher.config, method, len(prompt_ids))
    watch = CompileWatch()
    start = time.perf_counter()
    with watch.active():
        if runner is not None:
            eos_id = teacher.config.eos_id if method.spec.eos_id is None else method.spec.eos_id
            result = runner(prompt_ids, method.spec, eos_id=eos_id)
        elif trace_path:
            result = generate_traced(
                teacher,
                method.drafter,
                prompt_ids,
                method.spec,
                draft_params=method.draft_params,
                trace_path=trace_path,
                verify_latency=verify_latency,
                draft_seconds=draft_seconds,
            )
        else:
            result = generate(
                teacher,
                method.drafter,
                prompt_ids,
                method.spec,
                draft_params=method.draft_params,
                verify_latency=verify_latency,
                draft_seconds=draft_seconds,
                correction=method.correction,
            )
    # Compilations that ended after the prefill belong to the decode time.
    return result, watch.seconds_after(start + result.stats.prefill_seconds)
