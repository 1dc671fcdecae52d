"""Answer tokens per second of corpus generation, batched against one prompt at a time.

The same ``--prompts`` template prompts are answered greedily by the real teacher at every
batch size in ``--batch-sizes`` (batch size 1 is the unbatched rate), the sizes interleaved in
each of ``--repeats`` rounds so machine noise hits all of them alike. A batch decodes until its
longest answer ends, so the rate counts only real answer tokens. The first pass at each size
compiles and is not timed. Writes JSON (``--json``) and prints a table::

    python3 bench/distill_throughput.py --prompts 64 --batch-sizes 1,16,32,64 --repeats 2 \\
        --max-new-tokens 128 --json docs/results/distill_throughput.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from eaglepangu_jax import runtime
from eaglepangu_jax.files import write_json_atomic
from eaglepangu_jax.models.chat import encode_chat
from eaglepangu_jax.training.corpus import CorpusSettings, answer_prompts
from eaglepangu_jax.training.prompts import training_prompts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,16,32,64")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    runtime.enable_compile_cache(None)
    teacher, tok = runtime.load_teacher(), runtime.load_renderer().tokenizer
    prompts = [
        encode_chat(tok, [{"role": "user", "content": t}])
        for t in training_prompts(args.prompts, seed=1)
    ]

    def answer_all(size: int) -> tuple[int, float, list[list[int]]]:
        settings = CorpusSettings(max_new_tokens=args.max_new_tokens, shard_size=size)
        t0 = time.perf_counter()
        answers: list[list[int]] = []
        for i in range(0, len(prompts), size):
            answers += answer_prompts(teacher, prompts[i : i + size], settings).answers()
        return sum(map(len, answers)), time.perf_counter() - t0, answers

    for size in sizes:  # compile every shape (the last partial batch included) once
        answer_all(size)
    rates: dict[int, list[float]] = {s: [] for s in sizes}
    outputs = {}
    for _ in range(args.repeats):
        for size in sizes:
            tokens, seconds, answers = answer_all(size)
            rates[size].append(tokens / seconds)
            outputs[size] = answers
    same = all(outputs[s] == outputs[sizes[0]] for s in sizes)
    base = statistics.median(rates[sizes[0]])
    print(f"{'batch':>5s} {'answer tok/s':>12s} {'vs first':>8s}   (answers identical: {same})")
    rows = []
    for size in sizes:
        med = statistics.median(rates[size])
        rows.append(
            {"batch_size": size, "tokens_per_s": rates[size], "median": med, "vs_first": med / base}
        )
        print(f"{size:5d} {med:12.1f} {med / base:7.2f}x")
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
                "answers_identical_across_batch_sizes": same,
                "answer_tokens": sum(map(len, outputs[sizes[0]])),
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
