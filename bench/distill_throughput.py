"""Answer tokens per second of corpus generation, batched against one prompt at a time.

The same ``--prompts`` template prompts are answered greedily by the real teacher by every
variant in ``--variants``, interleaved in each of ``--repeats`` rounds so machine noise hits
all of them alike. A variant is ``decoder-batch``:

* ``engine-B``: :func:`~eaglepangu_jax.engine.decode.generate_batch` (the speculative round
  vmapped, no drafter), ``B`` prompts at a time; ``engine-1`` is one prompt at a time, the
  unbatched rate;
* ``plain-B``: :func:`~eaglepangu_jax.engine.plain_batch.greedy_batch`, the corpus path.

A batch decodes until its longest answer ends, so the rate counts only real answer tokens. The
first pass of each variant compiles and is not timed. Writes JSON (``--json``) and prints a
table::

    python3 bench/distill_throughput.py --prompts 32 --variants engine-1,engine-32,plain-32 \\
        --repeats 2 --max-new-tokens 96 --json docs/results/distill_throughput.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from eaglepangu_jax import runtime
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import generate_batch
from eaglepangu_jax.engine.plain_batch import greedy_batch
from eaglepangu_jax.files import write_json_atomic
from eaglepangu_jax.models.chat import encode_chat
from eaglepangu_jax.training.prompts import training_prompts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--variants", default="engine-1,engine-32,plain-32,plain-64")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        decoder, _, size = v.partition("-")
        if decoder not in ("engine", "plain") or not size.isdigit() or int(size) < 1:
            p.error(f"variant {v!r} is not engine-B or plain-B")
    runtime.enable_compile_cache(None)
    teacher, tok = runtime.load_teacher(), runtime.load_renderer().tokenizer
    prompts = [
        encode_chat(tok, [{"role": "user", "content": t}])
        for t in training_prompts(args.prompts, seed=1)
    ]

    spec = SpecConfig(policy="drafter", budget=1, depth=1, max_new_tokens=args.max_new_tokens)

    def answer_batch(decoder: str, batch: list[list[int]]) -> list[list[int]]:
        if decoder == "plain":
            return greedy_batch(teacher, batch, args.max_new_tokens)
        return [list(map(int, r.tokens)) for r in generate_batch(teacher, None, batch, spec)]

    def answer_all(variant: str) -> tuple[int, float, list[list[int]]]:
        decoder, _, size = variant.partition("-")
        t0 = time.perf_counter()
        answers: list[list[int]] = []
        for i in range(0, len(prompts), int(size)):
            answers += answer_batch(decoder, prompts[i : i + int(size)])
        return sum(map(len, answers)), time.perf_counter() - t0, answers

    for v in variants:  # compile every shape (the last partial batch included) once
        answer_all(v)
    rates: dict[str, list[float]] = {v: [] for v in variants}
    outputs = {}
    for _ in range(args.repeats):
        for v in variants:
            tokens, seconds, answers = answer_all(v)
            rates[v].append(tokens / seconds)
            outputs[v] = answers
    same = {v: outputs[v] == outputs[variants[0]] for v in variants}
    base = statistics.median(rates[variants[0]])
    print(f"{'variant':>10s} {'answer tok/s':>12s} {'vs first':>8s} {'same answers':>12s}")
    rows = []
    for v in variants:
        med = statistics.median(rates[v])
        rows.append(
            {
                "variant": v,
                "tokens_per_s": rates[v],
                "median": med,
                "vs_first": med / base,
                "answers_equal_first": same[v],
            }
        )
        print(f"{v:>10s} {med:12.1f} {med / base:7.2f}x {str(same[v]):>12s}")
    if args.json:
        write_json_atomic(
            args.json,
            {
                "command": "python3 bench/distill_throughput.py "
                + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"
                ),
                "prompts": args.prompts,
                "max_new_tokens": args.max_new_tokens,
                "answers_identical_across_variants": all(same.values()),
                "answer_tokens": sum(map(len, outputs[variants[0]])),
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
