"""The shipped EAGLE-3 head's drafting, piece by piece, each jitted and timed alone.

Where a drafting round's milliseconds go: the head's products at the row counts the engine
uses (``fuse`` and ``project`` over the ``D + 1`` feature rows of an update, ``finish`` for the
one row an update keeps, ``draft_logits`` at 1 and 4 rows), the drafter's whole ``update``,
its ``propose`` at budgets 1, 3 and 8 (every level grown: ``early_stop=False``), and both
together. Median of ``--repeats`` calls after one compiling call; a no-op gives the dispatch
floor. Run it with nothing else on the machine, once per setting of
``EAGLEPANGU_FEW_ROW_KERNEL`` to compare the few-row kernel::

    EAGLEPANGU_FEW_ROW_KERNEL=off PYTHONPATH=. python3 bench/eagle3_pieces.py --json off.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--capacity", type=int, default=512, help="cache slots of the context")
    p.add_argument("--committed", type=int, default=300, help="tokens already committed")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or not 0 < args.committed < args.capacity:
        p.error("need --repeats >= 1 and 0 < --committed < --capacity")

    from eaglepangu_jax import runtime
    from eaglepangu_jax.drafters import eagle3
    from eaglepangu_jax.drafters import eagle3_head as head_lib
    from eaglepangu_jax.engine.drafter import DraftContext
    from eaglepangu_jax.models import few_row

    teacher = runtime.load_teacher()
    drafter, params = eagle3.load_shipped_eagle3(teacher.params, budget=3, depth=6)
    cfg, head = drafter.config, params["head"]
    rows = drafter.depth + 1  # feature rows an update reads
    rng = np.random.default_rng(0)
    taps = len(cfg.feature_layers)
    features = jnp.asarray(rng.normal(size=(rows, taps, cfg.hidden_size)), jnp.float32)
    one = jnp.asarray(rng.normal(size=(1, cfg.hidden_size)), jnp.float32)
    several = jnp.asarray(rng.normal(size=(rows, cfg.hidden_size)), jnp.float32)
    positions = jnp.arange(rows, dtype=jnp.int32) + args.committed
    width = cfg.num_heads * cfg.head_dim

    def timed(fn, *fn_args):
        return _median_ms(jax.jit(fn), *fn_args, repeats=args.repeats)

    out = {
        "noop": timed(lambda x: x + 1, one),
        f"fuse_{rows}_rows": timed(lambda f: head_lib.fuse(head, f), features),
        f"project_{rows}_rows": timed(
            lambda x: head_lib.project(head, cfg, x, x, positions), several
        ),
        "finish_1_row": timed(lambda x: head_lib.finish(head, cfg, x, x[:, :width]), one),
        "draft_logits_1_row": timed(lambda x: head_lib.draft_logits(head, cfg, x), one),
        "draft_logits_4_rows": timed(
            lambda x: head_lib.draft_logits(head, cfg, x), jnp.tile(one, (4, 1))
        ),
    }
    tokens = jnp.asarray(rng.integers(3, 1000, size=args.capacity), jnp.int32)
    context = DraftContext(
        tokens=tokens,
        num_tokens=jnp.int32(args.committed),
        features=features,
        num_features=jnp.int32(3),
        start=jnp.int32(0),
    )
    state = jax.jit(drafter.init_state)(params, context)
    out["update"] = timed(drafter.update, params, state, context)
    key = jax.random.key(0)
    for budget in (1, 3, 8):
        d = eagle3.Eagle3Drafter(config=cfg, budget=budget, depth=6, early_stop=False)
        out[f"propose_budget_{budget}"] = timed(d.propose, params, state, context, key)
        out[f"update_and_propose_budget_{budget}"] = timed(
            lambda pr, s, c, k, d=d: d.propose(pr, d.update(pr, s, c), c, k),
            params,
            state,
            context,
            key,
        )
    report = {
        "few_row_kernel": few_row.identity(),
        "capacity": args.capacity,
        "repeats": args.repeats,
        "milliseconds": out,
    }
    for name, ms in out.items():
        print(f"{name:32s} {ms:7.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
