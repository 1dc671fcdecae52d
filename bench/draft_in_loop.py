"""Drafting cost inside the engine's loop against the same drafting run alone.

A drafter's cost is measured two ways, interleaved in one process on one prompt:

* **standalone**: the engine's own proposal, tree shaping and drafter update, jitted alone
  (:func:`~eaglepangu_jax.calibration.measure.measure_draft`, what the calibration stores);
* **in the loop**: what drafting adds to a round of the on-device loop. A round of the
  drafter's run (fixed policy: every round drafts) costs its drafting, its verify forward and
  the round's other work; a greedy round costs a one-slot verify and the same other work. So

      in-loop drafting = (round_drafter - round_greedy) - (verify(s) - verify(1))

  with ``verify`` the engine's verify forward timed alone at the run's attention window and
  context, at each slot bucket the drafter's rounds used (weighted by how often).

The issue's bar: in-loop within 25% of standalone, and at most 20% of a greedy step. Writes
JSON (``--json``) and prints a table. Example::

    PYTHONPATH=. python3 bench/draft_in_loop.py --methods eagle3,block,draft-distilled \\
        --repeats 5 --json draft_in_loop.json
    PYTHONPATH=. python3 bench/draft_in_loop.py --methods eagle3,eagle3:4 --json depth.json
    PYTHONPATH=. python3 bench/draft_in_loop.py --methods eagle3,eagle3/every-level \
        --budget 8 --json early_stop.json
    PYTHONPATH=. python3 bench/draft_in_loop.py --methods eagle3,block --budget auto \
        --json defaults.json

``--budget auto`` runs each drafter at the tree a user gets by default (its entry in
:data:`~eaglepangu_jax.methods.registry.DRAFTER_BUDGETS`, and no deeper than that budget), still
drafting every round.

``NAME/every-level`` is a drafter with an early stop (EAGLE-3) growing every level of its
tree; its standalone time is the same as ``NAME``'s (calibration times the costliest round).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics

import numpy as np

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration import measure
from eaglepangu_jax.cli.args import budget
from eaglepangu_jax.engine import SpecConfig, generate
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.drafter import costliest
from eaglepangu_jax.engine.verification import slot_buckets
from eaglepangu_jax.files import write_json_atomic
from eaglepangu_jax.methods.registry import make_method, split_method

# Long enough that the whole run (prompt + new tokens + one tree) stays in one 256-slot
# attention window, so one verify timing per bucket describes every round.
PROMPT = (
    "I keep a sourdough starter in my kitchen. Some weeks I bake twice, some weeks not at all, "
    "and twice this year the starter went grey and smelled of nail polish. Write me a short, "
    "practical guide to keeping it alive: how often to feed it, in what ratio of flour to "
    "water, where to keep it between bakes, how to revive it after a week in the fridge, and "
    "the signs that it is truly dead rather than just hungry. Finish with a weekly schedule "
    "for someone who bakes on Saturdays."
)
# Fixed policies, so every round drafts a tree of the drafter's usual size.
POLICIES = {"eagle3": "best_first", "block": "best_first", "draft-distilled": "drafter"}
EVERY_LEVEL = "/every-level"


def _bucket(nodes: int, slots: int) -> int:
    return next(b for b in slot_buckets(slots) if b >= nodes + 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--methods",
        default="eagle3,block,draft-distilled",
        help="comma-separated; NAME:D runs NAME at tree depth D (e.g. eagle3,eagle3:4)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--budget",
        type=budget,
        default=None,
        help="tree nodes, or 'auto': each drafter's own default tree (default: 16)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--verify-calls", type=int, default=6, help="verify timings per repeat")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runtime.enable_compile_cache(None)
    teacher, renderer = runtime.load_teacher(), runtime.load_renderer()
    prompt = renderer.encode([{"role": "user", "content": PROMPT}])
    base = SpecConfig(max_new_tokens=args.max_new_tokens)
    if isinstance(args.budget, int):
        base = dataclasses.replace(base, budget=args.budget)
    methods = {}
    for entry in args.methods.split(","):
        # "eagle3:4": the method at tree depth 4 (default: its own default depth).
        method_name = entry.removesuffix(EVERY_LEVEL)
        name, _ = split_method(method_name)
        spec = dataclasses.replace(base, policy=POLICIES.get(name, "best_first"))
        method = make_method(
            method_name, spec, default_depth=True, default_budget=args.budget == "auto"
        )
        if entry != method_name:
            if not hasattr(method.drafter, "early_stop"):
                raise SystemExit(f"{name} has no early stop to turn off")
            method = dataclasses.replace(method, name=entry, drafter=costliest(method.drafter))
        methods[entry] = method
    need = max(m.spec.budget + 1 for m in methods.values())
    capacity = gen.cache_slots(len(prompt), base, teacher.config.max_position)
    first = gen.window_for(len(prompt) + need, capacity)
    last = gen.window_for(len(prompt) + args.max_new_tokens + need, capacity)
    if first != last:
        raise SystemExit(f"the run spans windows {first} and {last}; shorten --max-new-tokens")
    context = len(prompt) + args.max_new_tokens // 2

    # Compile everything, check the tokens, and find each drafter's slot buckets.
    reference = generate(teacher, None, prompt, base).tokens
    rows: dict[str, dict] = {"greedy": {"round_s": []}}
    timer = measure._VerifyTimer(teacher)
    verify_keys = {1: timer.add(1, context, first)}
    for name, m in methods.items():
        out = generate(teacher, m.drafter, prompt, m.spec, draft_params=m.draft_params)
        nodes = out.stats.nodes_per_round
        slots = collections.Counter(_bucket(n, m.spec.budget + 1) for n in nodes)
        for s in slots:
            verify_keys.setdefault(s, timer.add(s, context, first))
        rows[name] = {
            "policy": m.spec.policy,
            "budget": m.spec.budget,
            "depth": m.spec.depth,
            "same_tokens": out.tokens == reference,
            "round_s": [],
            "standalone_s": measure.measure_draft(
                teacher, m, context=context, repeats=args.repeats
            ),
        }
    verify = {s: [] for s in verify_keys}
    for _ in range(args.repeats):  # interleaved: greedy, each drafter, the verify points
        for name in rows:
            m = methods.get(name)
            if m is None:
                out = generate(teacher, None, prompt, base)
            else:
                out = generate(teacher, m.drafter, prompt, m.spec, draft_params=m.draft_params)
                rows[name]["slots"] = dict(
                    collections.Counter(
                        _bucket(n, m.spec.budget + 1) for n in out.stats.nodes_per_round
                    )
                )
                rows[name]["accepted_per_round"] = float(np.mean(out.stats.accepted_per_round))
            rows[name]["round_s"].append(out.stats.seconds / max(out.stats.rounds, 1))
        for s, key in verify_keys.items():
            verify[s] += [timer.time(key) for _ in range(args.verify_calls)]
    v = {s: statistics.median(t) for s, t in verify.items()}
    greedy_round = statistics.median(rows["greedy"]["round_s"])
    rows["greedy"]["median_round_s"] = greedy_round
    print(
        f"window {first}, context {context}; verify ms: "
        + ", ".join(f"{s} slots {t * 1e3:.1f}" for s, t in sorted(v.items()))
    )
    print(
        f"{'method':16s} {'round ms':>9s} {'standalone':>10s} {'in loop':>8s} "
        f"{'loop/alone':>10s} {'of greedy':>9s} same"
    )
    print(f"{'greedy':16s} {greedy_round * 1e3:9.2f}")
    for name in methods:
        row = rows[name]
        r = statistics.median(row["round_s"])
        share = {s: c / sum(row["slots"].values()) for s, c in row["slots"].items()}
        mean_verify = sum(share[s] * v[s] for s in share)
        in_loop = (r - greedy_round) - (mean_verify - v[1])
        row.update(
            median_round_s=r,
            mean_verify_s=mean_verify,
            in_loop_s=in_loop,
            in_loop_over_standalone=in_loop / row["standalone_s"],
            in_loop_over_greedy_round=in_loop / greedy_round,
        )
        print(
            f"{name:16s} {r * 1e3:9.2f} {row['standalone_s'] * 1e3:8.2f}ms "
            f"{in_loop * 1e3:6.2f}ms {in_loop / row['standalone_s']:9.2f}x "
            f"{in_loop / greedy_round:8.0%} {row['same_tokens']}"
        )
    result = {
        "prompt_tokens": len(prompt),
        "max_new_tokens": args.max_new_tokens,
        "window": first,
        "context": context,
        "repeats": args.repeats,
        "verify_s": {str(s): t for s, t in verify.items()},
        "verify_median_s": {str(s): t for s, t in v.items()},
        "methods": rows,
    }
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
