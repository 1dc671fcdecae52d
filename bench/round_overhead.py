"""What a round costs when the controller decides not to draft, against plain greedy decoding.

Under the "auto" policy most rounds of a weak drafter are plain one-token steps; they should
cost what a greedy step costs. This script times, interleaved on one prompt, seconds per
emitted token of:

* ``greedy``: no drafter;
* ``<drafter>-plain``: the drafter under "auto" with a verify-latency curve that makes every
  multi-node tree look ruinous, so only the exploration probes draft (counted and reported);
* ``<drafter>-auto``: the drafter under "auto" with the nominal curve (for reference).

Writes JSON (``--json``) and prints a table. Example::

    python3 bench/round_overhead.py --drafters ngram,eagle3 --repeats 3 --json overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from eaglepangu_jax import runtime
from eaglepangu_jax.drafters.registry import load_shipped, make_drafter
from eaglepangu_jax.engine import SpecConfig, generate
from eaglepangu_jax.files import write_json_atomic

PROMPT = "Write a short guide to keeping a sourdough starter alive, with a weekly schedule."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default="ngram,eagle3")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runtime.enable_compile_cache(None)
    teacher, renderer = runtime.load_teacher(), runtime.load_renderer()
    prompt = renderer.encode([{"role": "user", "content": PROMPT}])
    spec = SpecConfig(max_new_tokens=args.max_new_tokens, budget=8, depth=6)  # the methods' default
    variants = {"greedy": (None, None, {})}
    for name in args.drafters.split(","):
        if name == "ngram":
            drafter, params = make_drafter("ngram", budget=spec.budget, depth=spec.depth), None
        else:
            drafter, params = load_shipped(
                name, teacher_params=teacher.params, budget=spec.budget, depth=spec.depth
            )
        ruinous = np.full((spec.budget + 1,), 1e3, np.float32)
        ruinous[0] = 0.05
        variants[f"{name}-plain"] = (drafter, params, {"verify_latency": ruinous})
        variants[f"{name}-auto"] = (drafter, params, {})
    rows: dict[str, dict] = {}
    for name, (drafter, params, extra) in variants.items():  # compile, and check the tokens
        t0 = time.perf_counter()
        result = generate(teacher, drafter, prompt, spec, draft_params=params, **extra)
        rows[name] = {
            "compile_and_first_s": time.perf_counter() - t0,
            "per_token_s": [],
            "tokens": result.tokens,
        }
    reference = rows["greedy"]["tokens"]
    for _ in range(args.repeats):
        for name, (drafter, params, extra) in variants.items():
            result = generate(teacher, drafter, prompt, spec, draft_params=params, **extra)
            rows[name]["per_token_s"].append(result.stats.seconds / result.stats.new_tokens)
            rows[name]["speculated_rounds"] = sum(n > 0 for n in result.stats.nodes_per_round)
            rows[name]["rounds"] = result.stats.rounds
    base = statistics.median(rows["greedy"]["per_token_s"])
    print(f"{'method':16s} {'ms/token':>9s} {'vs greedy':>9s} {'spec rounds':>12s} same")
    for name, row in rows.items():
        med = statistics.median(row["per_token_s"])
        row["median_per_token_s"] = med
        row["speedup"] = base / med
        row["same_tokens"] = row.pop("tokens") == reference
        print(
            f"{name:16s} {med * 1e3:9.2f} {base / med:8.2f}x "
            f"{row.get('speculated_rounds', 0):5d}/{row.get('rounds', 0):<5d} {row['same_tokens']}"
        )
    if args.json:
        write_json_atomic(args.json, {"prompt": PROMPT, "spec": str(spec), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
