"""A draft-target drafter's chains at the run's budget against the budget they can fill.

``make_method`` lowers a draft-target drafter's budget to ``depth * top_k``, the most nodes its
chains hold (:func:`eaglepangu_jax.methods.registry._fit_chain_budget`). Before, one chain of 4
under the default budget of 8 was verified on the 9-slot bucket. This script runs, interleaved
on the same turns (an evaluation suite, each turn after the greedy answers to the earlier
ones): greedy, the method with its budget padded back to ``--budget``, and the method as
``make_method`` builds it. Compiling runs are discarded and rerun (``run_method``).

Writes JSON (``--json``) and prints a table. Example::

    PYTHONPATH=. python3 bench/chain_budget.py --method draft-distilled --depth 4 \\
        --per-category 1 --json chain_budget.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np

from eaglepangu_jax import runtime
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation import suites
from eaglepangu_jax.evaluation.run import check_prompts, run_method
from eaglepangu_jax.files import write_json_atomic
from eaglepangu_jax.methods.registry import DEFAULT_BUDGET, REFERENCE, make_method


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="draft-distilled")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    p.add_argument("--suite", default="mtbench-humaneval")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runtime.enable_compile_cache(None)
    teacher, renderer = runtime.load_teacher(), runtime.load_renderer()
    spec = SpecConfig(
        budget=args.budget, depth=args.depth, policy="drafter", max_new_tokens=args.max_new_tokens
    )
    fitted = make_method(args.method, spec)
    padded = dataclasses.replace(
        fitted,
        name=f"{args.method}@{args.budget}",
        spec=spec,
        drafter=dataclasses.replace(fitted.drafter, budget=args.budget),
    )
    fitted = dataclasses.replace(fitted, name=f"{args.method}@{fitted.spec.budget}")
    methods = [make_method(REFERENCE, spec), padded, fitted]
    conversations = suites.per_category(suites.load_suite(args.suite), args.per_category)
    check_prompts(conversations, renderer, teacher.config, args.max_new_tokens)
    rows = {m.name: {"seconds": [], "tokens": 0, "accepted": [], "identical": 0} for m in methods}
    turns = 0
    for conversation in conversations:
        history: list[dict[str, str]] = []
        for text in conversation.turns:
            history.append({"role": "user", "content": text})
            prompt = renderer.encode(history)
            reference = None
            for m in methods:
                result, _ = run_method(teacher, m, prompt)
                row = rows[m.name]
                row["seconds"].append(result.stats.seconds / max(result.stats.new_tokens, 1))
                row["tokens"] += result.stats.new_tokens
                row["accepted"] += [a + 1 for a in result.stats.accepted_per_round]
                if reference is None:
                    reference = result.tokens
                row["identical"] += result.tokens == reference
            history.append({"role": "assistant", "content": renderer.decode(reference)})
            turns += 1
            print(f"turn {turns}: {conversation.category}", flush=True)
    greedy = rows[REFERENCE]["seconds"]
    print(f"{'method':24s} {'speed-up (mean)':>15s} {'ms/token':>9s} {'acc.len':>8s} identical")
    for name, row in rows.items():
        ratio = [g / s for g, s in zip(greedy, row["seconds"])]
        row.update(
            speedup_mean=float(np.mean(ratio)),
            speedup_per_turn=ratio,
            median_ms_per_token=1e3 * statistics.median(row["seconds"]),
            accepted_length=float(np.mean(row["accepted"])) if name != REFERENCE else 1.0,
            identical_share=row["identical"] / turns,
        )
        row.pop("accepted")
        print(
            f"{name:24s} {row['speedup_mean']:14.2f}x {row['median_ms_per_token']:9.1f} "
            f"{row['accepted_length']:8.2f} {row['identical']}/{turns}"
        )
    if args.json:
        write_json_atomic(args.json, {"args": vars(args), "turns": turns, "methods": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
