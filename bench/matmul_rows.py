"""What a verify row costs: the teacher's weight products at 1, 2, ... rows, jitted with XLA.

A plain decoding step multiplies one row (the new token's hidden state) by every weight
matrix of the teacher; verifying a tree of ``s`` slots multiplies ``s`` rows by the same
matrices. On a CPU the one-row product is a matrix-vector product that streams the weights
at the memory-bandwidth floor; from two rows XLA runs a matrix-matrix product, which costs
more per weight byte. This script times that alone, with the teacher's shapes and random
float32 weights (no model file needed): per layer the attention projections (q, k, v, o)
and the MLP's gate, up and down products, chained through the layers so nothing is
skipped, then the tied ``lm_head``.

With ``--transposed`` the same products also run on the weights stored ``[out, in]`` (each
product contracting both operands' minor axis), interleaved with the ``[in, out]`` layout the
teacher uses, under the key ``transposed`` of the report: XLA picks other kernels for it.

With ``--fused`` the layer's products that read the same input also run as one product each:
q, k and v against one ``[H, Q + 2 KV]`` weight, gate and up against one ``[H, 2 F]``
(same bytes, two products a layer instead of five; key ``fused``, and
``fused_transposed`` with ``--transposed``).

With ``--few-row`` the ``[in, out]`` products also run on the few-row product kernel
(:mod:`eaglepangu_jax.models.few_row`, up to 16 rows; key ``few_row``), what the teacher's
verify uses for 2-8 rows where it is available; where the kernel runs its AVX-512 build, its
AVX2 build too (key ``few_row_avx2``: what a machine without AVX-512 gets).

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
from unittest import mock


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,9,17", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--layers", type=int, default=None, help="layers (default: the teacher's)")
    p.add_argument(
        "--transposed",
        action="store_true",
        help="also time the weights stored [out, in] (interleaved; reported apart)",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="also time q/k/v and gate/up as one product each (interleaved; reported apart)",
    )
    p.add_argument(
        "--few-row",
        action="store_true",
        help="also time the few-row product kernel (interleaved; reported apart)",
    )
    p.add_argument("--json", required=True, help="the report to write")
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    bad_layers = args.layers is not None and args.layers < 1
    if not rows or min(rows) < 1 or args.repeats < 1 or bad_layers:
        p.error("--rows must be >= 1 each, --repeats and --layers >= 1")
    if args.few_row and max(rows) > 16:
        p.error("--few-row times at most 16 rows")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from eaglepangu_jax.files import write_json_atomic
    from eaglepangu_jax.models import few_row
    from eaglepangu_jax.models.config import LlamaConfig

    if args.few_row and not few_row.available():
        p.error(f"--few-row: the kernel cannot run here ({few_row.unavailable_reason()})")

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

    def chain(mm):
        @jax.jit
        def products(x, layers, lm_head):
            # Each product feeds the next, so XLA can neither skip nor merge any of them.
            for w in layers:
                q = mm(x, w["wq"])
                x = x + mm(q + jnp.tile(mm(x, w["wk"]) + mm(x, w["wv"]), h // kv), w["wo"]) * 0.01
                x = x + mm(jax.nn.silu(mm(x, w["gate"])) * mm(x, w["up"]), w["down"]) * 0.01
            return mm(x, lm_head)

        return products

    variants = {"rows": (chain(lambda x, w: x @ w), layers, lm_head)}
    switch = {}  # the kernel's switch while a variant is traced, where not the caller's
    if args.few_row:
        variants["few_row"] = (chain(few_row.product), layers, lm_head)
        if few_row.instruction_set() == "avx512" and "avx2" in few_row.usable_instruction_sets():
            variants["few_row_avx2"] = (chain(few_row.product), layers, lm_head)
            switch["few_row_avx2"] = "avx2"
    if args.transposed:

        def flip(v):
            return jnp.asarray(np.ascontiguousarray(np.asarray(v).T))

        flipped = tuple({k: flip(v) for k, v in w.items()} for w in layers)
        variants["transposed"] = (
            chain(lambda x, w: jnp.einsum("ti,oi->to", x, w)),
            flipped,
            flip(lm_head),
        )
    if args.fused:

        def fuse(w):
            return dict(
                qkv=jnp.concatenate([w["wq"], w["wk"], w["wv"]], axis=1),
                wo=w["wo"],
                gate_up=jnp.concatenate([w["gate"], w["up"]], axis=1),
                down=w["down"],
            )

        def fused_chain(mm):
            @jax.jit
            def products(x, layers, lm_head):
                for w in layers:
                    qkv = mm(x, w["qkv"])
                    q, k, v = qkv[:, :h], qkv[:, h : h + kv], qkv[:, h + kv :]
                    x = x + mm(q + jnp.tile(k + v, h // kv), w["wo"]) * 0.01
                    gate, up = jnp.split(mm(x, w["gate_up"]), 2, axis=1)
                    x = x + mm(jax.nn.silu(gate) * up, w["down"]) * 0.01
                return mm(x, lm_head)

            return products

        fused = tuple(fuse(w) for w in layers)
        variants["fused"] = (fused_chain(lambda x, w: x @ w), fused, lm_head)
        if args.transposed:
            variants["fused_transposed"] = (
                fused_chain(lambda x, w: jnp.einsum("ti,oi->to", x, w)),
                tuple({k: flip(v) for k, v in w.items()} for w in fused),
                flip(lm_head),
            )
    inputs = {r: jnp.ones((r, h), jnp.float32) for r in rows}
    for name, (fn, ws, head) in variants.items():  # compile (the kernel is chosen here)
        setting = {few_row.ENV_SWITCH: switch[name]} if name in switch else {}
        with mock.patch.dict(os.environ, setting):  # the caller's switch is back afterwards
            for r in rows:
                jax.block_until_ready(fn(inputs[r], ws, head))
    times = {(name, r): [] for name in variants for r in rows}
    for _ in range(args.repeats):
        for r in rows:
            for name, (fn, ws, head) in variants.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(inputs[r], ws, head))
                times[name, r].append(time.perf_counter() - start)
    median = {key: statistics.median(t) for key, t in times.items()}
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
    }
    for name in variants:
        report[name] = {
            str(r): {
                "median_ms": median[name, r] * 1e3,
                "times_ms": [t * 1e3 for t in times[name, r]],
                "vs_one_row": median[name, r] / median[name, rows[0]] if rows[0] == 1 else None,
                "weight_gb_per_s": weight_bytes / median[name, r] / 1e9,
            }
            for r in rows
        }
    write_json_atomic(args.json, report)
    print(f"{'layout':>10} {'rows':>5} {'ms':>8} {'x 1 row':>8} {'weights GB/s':>13}")
    for name in variants:
        layout = {
            "rows": "[in,out]",
            "transposed": "[out,in]",
            "fused": "fused",
            "fused_transposed": "fused^T",
            "few_row": "few-row",
            "few_row_avx2": "f-r avx2",
        }[name]
        for r in rows:
            row = report[name][str(r)]
            ratio = f"{row['vs_one_row']:.2f}" if row["vs_one_row"] is not None else "-"
            print(
                f"{layout:>10} {r:>5} {row['median_ms']:>8.2f} {ratio:>8} "
                f"{row['weight_gb_per_s']:>13.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
