"""Tokens of the n-gram drafter on a fixed prompt set, for before/after comparisons.

Runs on this checkout's library *and* on older layouts (before the layering moves the engine
lived in ``engine/generate.py``), so the same script answers "did a refactor change any
output?": run it at two commits on the same prompt file and compare the JSON files::

    python3 bench/same_tokens.py prompts --out prompts.json          # this checkout
    python3 bench/same_tokens.py run prompts.json --out after.json
    (cd old-checkout && python3 /path/to/same_tokens.py run prompts.json --out before.json)
    python3 bench/same_tokens.py compare before.json after.json

``prompts`` writes the first turn of the first ``--per-category`` conversations of every
category of MT-Bench + HumanEval as chat-formatted ids. ``run`` decodes each with the n-gram
drafter (policy ``drafter``, budget 16, depth 8: the defaults both layouts share) and with plain
greedy decoding, and records both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _prompts(args) -> int:
    from eaglepangu_jax.evaluation.suites import load_suite, per_category
    from eaglepangu_jax.runtime import load_renderer

    renderer = load_renderer()
    conversations = per_category(load_suite("mtbench-humaneval"), args.per_category)
    out = [
        {
            "id": c.id,
            "category": c.category,
            "ids": renderer.encode([{"role": "user", "content": c.turns[0]}]),
        }
        for c in conversations
    ]
    with open(args.out, "w") as f:
        json.dump(out, f)
    print(f"{len(out)} prompts -> {args.out}")
    return 0


def _run(args) -> int:
    try:
        from eaglepangu_jax.engine.decode import Teacher, generate
    except ImportError:  # the layout before the layering moves
        from eaglepangu_jax.engine.generate import Teacher, generate
    from eaglepangu_jax.drafters.ngram import NGramDrafter
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.models import llama, smollm2

    config, params = smollm2.load_smollm2()
    teacher = Teacher(config, llama.prepare_params(params))
    spec = SpecConfig(policy="drafter", budget=16, depth=8, max_new_tokens=args.max_new_tokens)
    drafter = NGramDrafter(budget=16, depth=8)
    prompts = json.load(open(args.prompts))
    rows = []
    t0 = time.time()
    for p in prompts:
        spec_tokens = generate(teacher, drafter, p["ids"], spec).tokens
        greedy_tokens = generate(teacher, None, p["ids"], spec).tokens
        rows.append({"id": p["id"], "ngram": spec_tokens, "greedy": greedy_tokens})
        print(
            f"{p['category']:12s} {p['id']}: {len(spec_tokens)} tokens, "
            f"ngram == greedy: {spec_tokens == greedy_tokens}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump({"max_new_tokens": args.max_new_tokens, "rows": rows}, f)
    print(f"{len(rows)} prompts in {time.time() - t0:.0f} s -> {args.out}")
    return 0


def _compare(args) -> int:
    a, b = json.load(open(args.before)), json.load(open(args.after))
    pairs = list(zip(a["rows"], b["rows"]))
    same = sum(x["ngram"] == y["ngram"] for x, y in pairs)
    same_greedy = sum(x["greedy"] == y["greedy"] for x, y in pairs)
    lossless = sum(y["ngram"] == y["greedy"] for _, y in pairs)
    print(
        f"n-gram tokens identical before/after: {same}/{len(pairs)}; greedy: "
        f"{same_greedy}/{len(pairs)}; n-gram == greedy after: {lossless}/{len(pairs)}"
    )
    return 0 if same == len(pairs) and len(a["rows"]) == len(b["rows"]) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prompts")
    pr.add_argument("--per-category", type=int, default=2)
    pr.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("prompts")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = p.parse_args()
    return {"prompts": _prompts, "run": _run, "compare": _compare}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
