"""Does the cache's capacity bucket change decode speed? Greedy decoding at two values of
``engine.decode.CAPACITY_BUCKET``, interleaved on the demo's turns.

A larger bucket lets prompts of different lengths share one cache shape (fewer compilations);
the loop only reads the attention window, so the extra slots should cost memory, not time.
This script checks that: for each prompt and bucket it compiles once (untimed), then times
``--repeats`` rounds in which the buckets alternate (their order reversed every other round),
and reports the median ms per token and whether the tokens are identical. Writes JSON
(``--json``) and prints a table::

    python3 bench/capacity_bucket.py --buckets 256,512 --repeats 3 \\
        --json docs/results/capacity_bucket.json
"""

from __future__ import annotations

import argparse
import statistics

from eaglepangu_jax import runtime
from eaglepangu_jax.cli.bench import demo_conversations
from eaglepangu_jax.engine import SpecConfig, generate
from eaglepangu_jax.engine import decode as decode_lib
from eaglepangu_jax.files import write_json_atomic


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--buckets", default="256,512")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    runtime.enable_compile_cache(None)
    teacher, renderer = runtime.load_teacher(), runtime.load_renderer()
    prompts = {
        c.id: renderer.encode([{"role": "user", "content": c.turns[0]}])
        for c in demo_conversations()
    }
    spec = SpecConfig(max_new_tokens=args.max_new_tokens)

    def run(bucket: int, prompt: list[int]):
        decode_lib.CAPACITY_BUCKET = bucket  # read by cache_slots at each call
        return generate(teacher, None, prompt, spec)

    tokens = {(b, k): run(b, p).tokens for b in buckets for k, p in prompts.items()}  # compile
    times: dict[int, list[float]] = {b: [] for b in buckets}
    for rep in range(args.repeats):
        for k, prompt in prompts.items():
            for b in buckets if rep % 2 == 0 else buckets[::-1]:  # no bucket always runs first
                r = run(b, prompt)
                assert r.tokens == tokens[b, k]
                times[b].append(r.stats.seconds / len(r.tokens))
    identical = all(tokens[buckets[0], k] == tokens[b, k] for b in buckets for k in prompts)
    base = statistics.median(times[buckets[0]])
    print(f"{'bucket':>6s} {'ms/token (median)':>18s} {'vs first':>8s}   identical: {identical}")
    rows = []
    for b in buckets:
        med = statistics.median(times[b])
        rows.append(
            {"bucket": b, "ms_per_token": [1e3 * t for t in times[b]], "median_ms": 1e3 * med}
        )
        print(f"{b:6d} {1e3 * med:18.1f} {med / base:7.2f}x")
    if args.json:
        write_json_atomic(
            args.json,
            {
                "command": f"python3 bench/capacity_bucket.py --buckets {args.buckets} "
                f"--repeats {args.repeats} --max-new-tokens {args.max_new_tokens}",
                "prompts": list(prompts),
                "identical": identical,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
