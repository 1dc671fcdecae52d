"""What a verify row costs: the teacher's weight products at 1, 2, ... rows, jitted with XLA.

A plain decoding step multiplies one row (the new token's hidden state) by every weight
matrix of the teacher; verifying a tree of ``s`` slots multiplies ``s`` rows by the same
matrices. On a CPU the one-row product is a matrix-vector product that streams the weights
at the memory-bandwidth floor; from two rows XLA runs a matrix-matrix product, which costs
more per weight byte. This script times that alone, with the teacher's shapes and random
float32 weights (no model file needed): per layer the attention projections (q, k, v, o)
and the MLP's gate, up and down products, chained through the layers so nothing is
skipped, then the tied ``lm_head``.

Interleaved over ``--repeats`` passes (every row count timed once per pass, median kept).
Writes JSON and prints a table. Example::

    PYTHONPATH=. python3 bench/matmul_rows.py --rows 1,2,4,9,17 --json rows.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,9,17", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--layers", type=int, default=None, help="layers (default: the teacher's)")
    p.add_argument("--json", required=True, help="the report to write")
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    bad_layers = args.layers is not None and args.layers < 1
    if not rows or min(rows) < 1 or args.repeats < 1 or bad_layers:
        p.error("--rows must be >= 1 each, --repeats and --layers >= 1")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from eaglepangu_jax.files import write_json_atomic
    from eaglepangu_jax.models.config import LlamaConfig

    cfg = LlamaConfig.smollm2_135m()
    h, f = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    rng = np.random.default_rng(0)

    def weight(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[0]))

    layers = tuple(
        dict(
            wq=weight(h, h),
            wk=weight(h, kv),
            wv=weight(h, kv),
            wo=weight(h, h),
            gate=weight(h, f),
            up=weight(h, f),
            down=weight(f, h),
        )
        for _ in range(args.layers or cfg.num_layers)
    )
    lm_head = weight(h, cfg.vocab_size)

    @jax.jit
    def products(x, layers, lm_head):
        # Each product feeds the next, so XLA can neither skip nor merge any of them.
        for w in layers:
            q = x @ w["wq"]
            x = x + (q + jnp.tile(x @ w["wk"] + x @ w["wv"], h // kv)) @ w["wo"] * 0.01
            x = x + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"] * 0.01
        return x @ lm_head

    inputs = {r: jnp.ones((r, h), jnp.float32) for r in rows}
    for r in rows:  # compile
        jax.block_until_ready(products(inputs[r], layers, lm_head))
    times = {r: [] for r in rows}
    for _ in range(args.repeats):
        for r in rows:
            start = time.perf_counter()
            jax.block_until_ready(products(inputs[r], layers, lm_head))
            times[r].append(time.perf_counter() - start)
    median = {r: statistics.median(times[r]) for r in rows}
    weight_bytes = 4 * (sum(v.size for w in layers for v in w.values()) + lm_head.size)
    report = {
        "shapes": "SmolLM2-135M's q/k/v/o, gate/up/down per layer, then its lm_head",
        "layers": len(layers),
        "weight_bytes": weight_bytes,
        "repeats": args.repeats,
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
        },
        "rows": {
            str(r): {
                "median_ms": median[r] * 1e3,
                "times_ms": [t * 1e3 for t in times[r]],
                "vs_one_row": median[r] / median[rows[0]] if rows[0] == 1 else None,
                "weight_gb_per_s": weight_bytes / median[r] / 1e9,
            }
            for r in rows
        },
    }
    write_json_atomic(args.json, report)
    print(f"{'rows':>5} {'ms':>8} {'x 1 row':>8} {'weights GB/s':>13}")
    for r in rows:
        row = report["rows"][str(r)]
        ratio = f"{row['vs_one_row']:.2f}" if row["vs_one_row"] is not None else "-"
        print(f"{r:>5} {row['median_ms']:>8.2f} {ratio:>8} {row['weight_gb_per_s']:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
