"""The engine's verify forward with and without the few-row product kernel, real teacher.

The kernel is chosen when a program is traced (:mod:`eaglepangu_jax.models.few_row`), so
settings cannot share a process: this script runs itself in child processes, alternating the
``--settings`` ``--rounds`` times: ``xla`` (``EAGLEPANGU_FEW_ROW_KERNEL=0``, XLA's products),
``kernel`` (the kernel as the machine chooses it), ``avx512`` or ``avx2`` (the kernel built
for that instruction set; ``avx2`` on an AVX-512 machine shows what one without gets). Each
child times the engine's verify (the calibration's timer: the teacher without the ``[out,
in]`` weight copies, ``--context`` cached tokens in one attention window) at every slot
count of ``--slots``, ``--passes`` interleaved passes, and reports medians. Writes JSON and
prints a table; example::

    PYTHONPATH=. python3 bench/few_row_verify.py --rounds 2 --json few_row_verify.json
    PYTHONPATH=. python3 bench/few_row_verify.py --settings xla,avx512,avx2 --json isa.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def time_verify(teacher, slots, context, passes) -> dict[int, float]:
    """Median seconds of the engine's verify forward at each slot count (interleaved)."""
    from eaglepangu_jax.calibration import measure
    from eaglepangu_jax.calibration.fit import engine_window

    timer = measure._VerifyTimer(teacher)
    window = engine_window(context, max(slots), teacher.config)
    keys = {s: timer.add(s, context, window) for s in slots}
    times = {s: [] for s in slots}
    for _ in range(passes):
        for s, key in keys.items():
            times[s].append(timer.time(key))
    return {s: statistics.median(t) for s, t in times.items()}


def _child(args) -> None:
    from eaglepangu_jax import runtime
    from eaglepangu_jax.models import few_row

    teacher = runtime.load_teacher(layout="in-out", progress=False)
    medians = time_verify(teacher, args.slots, args.context, args.passes)
    ms = {s: t * 1e3 for s, t in medians.items()}
    print(json.dumps({"kernel": few_row.identity(), "ms": ms}))


def slot_list(text: str) -> list[int]:
    try:
        slots = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None
    if not slots or min(slots) < 1 or len(set(slots)) < len(slots):
        raise argparse.ArgumentTypeError(f"distinct slot counts >= 1, got {text!r}")
    return slots


# Each setting's value of the kernel's switch (None: unset, the machine chooses).
SETTINGS = {"xla": "0", "kernel": None, "avx512": "avx512", "avx2": "avx2"}


def setting_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",")]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"distinct names from {sorted(SETTINGS)}, got {text!r}")
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=slot_list, default=[1, 2, 3, 4, 5, 9])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--passes", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2, help="child processes per setting")
    p.add_argument(
        "--settings",
        type=setting_list,
        default=["xla", "kernel"],
        help=f"comma-separated, from {', '.join(SETTINGS)} (default: xla,kernel)",
    )
    p.add_argument("--json", required=True, help="the report to write")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.context < 1 or args.passes < 1 or args.rounds < 1:
        p.error("--context, --passes and --rounds must be >= 1")
    if args.child:
        _child(args)
        return 0

    from eaglepangu_jax.files import write_json_atomic
    from eaglepangu_jax.models.few_row import ENV_SWITCH

    child = [sys.executable, os.path.abspath(__file__), "--child", "--json", "-"]
    child += ["--slots", ",".join(map(str, args.slots)), "--context", str(args.context)]
    child += ["--passes", str(args.passes)]
    runs = {name: [] for name in args.settings}
    for _ in range(args.rounds):
        for name in runs:
            env = {k: v for k, v in os.environ.items() if k != ENV_SWITCH}
            if SETTINGS[name] is not None:
                env[ENV_SWITCH] = SETTINGS[name]
            done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for name in runs:
        if name != "xla" and runs[name][0]["kernel"] == "off":
            p.error(f"the kernel cannot run here as {name!r} (see eaglepangu_jax.models.few_row)")
    report = {"few_row_verify": {"context": args.context, "passes": args.passes, "runs": runs}}
    write_json_atomic(args.json, report)
    print(f"{'setting':>8} " + " ".join(f"{s:>8}" for s in args.slots) + "   (ms per verify)")
    for name, rs in runs.items():
        for r in rs:
            print(f"{name:>8} " + " ".join(f"{r['ms'][str(s)]:8.2f}" for s in args.slots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
