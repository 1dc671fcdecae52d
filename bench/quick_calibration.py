"""Wall time of the quick calibration a new machine runs before its first ``"auto"`` run.

Runs :func:`~eaglepangu_jax.calibration.auto.ensure_calibration` for the methods ``make run``
uses (EAGLE-3 and n-gram at the default tree) into a temporary file, in this process, without
the persistent XLA cache: every program compiles, as on a fresh machine. Run it in a fresh
process for each measurement. Writes JSON (``--json``) and prints the seconds::

    python3 bench/quick_calibration.py --json docs/results/quick_calibration.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration.auto import controlled_methods, ensure_calibration
from eaglepangu_jax.engine import SpecConfig
from eaglepangu_jax.files import write_json_atomic
from eaglepangu_jax.methods.registry import make_method


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="eagle3,ngram")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    teacher = runtime.load_teacher()
    spec = SpecConfig(max_new_tokens=96)
    methods = [make_method(n, spec, default_depth=True) for n in args.methods.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        calibration = ensure_calibration(
            teacher, controlled_methods(methods), path=Path(tmp) / "c.json", progress=False
        )
        seconds = time.perf_counter() - start
    print(f"quick calibration: {seconds:.1f} s")
    if args.json:
        write_json_atomic(
            args.json,
            {
                "command": f"python3 bench/quick_calibration.py --methods {args.methods}",
                "seconds": seconds,
                "verify": {f"{s.slots}@{s.context}": s.seconds for s in calibration.samples},
                "t_draft": dict(calibration.t_draft),
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
