"""The teacher's ``[out, in]`` weight copies, side by side in the engine: greedy, each drafter
on the teacher with the copies (full verify trees multiply them, see
``llama.prepare_params``) and the same drafter on the teacher without them (every product
from the ``[in, out]`` weights), interleaved per turn on the same prompts, under the default
controller. ``runtime.load_teacher()`` picks one of the two per machine
(``calibration.layout``); this script runs both, whatever the machine chose.

Both teachers share one set of ``[in, out]`` weights; the copies add only the second
layout. The copy-free variant runs as a runner around the same engine (and the same
re-run-if-compiled rule as every method) and learns its own cost correction. Both read the
calibration of the teacher with the copies (measured now, and saved, where the machine chose
the other layout; the next run in that layout measures its own again), so the copy-free
variant is told the other layout's verify costs: its correction learns the difference, as
it learns any machine's. ::

    PYTHONPATH=. python3 bench/teacher_layout.py --suite dev --per-category 2 \\
        --methods ngram,ngram-corpus --json layout.json

Methods are named ``D`` (with the copies) and ``D/in-out`` (without); the JSON is the bench
report with a ``teacher_layout`` entry.

With ``--verify-slots`` the script times the engine's verify forward alone instead, at each
number of slots after ``--context`` committed tokens, the two teachers alternating (each
pass times every point once per teacher; the median of ``--repeats`` passes is kept)::

    PYTHONPATH=. python3 bench/teacher_layout.py --verify-slots 1,2,4,5,9,17 --json v.json
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

from eaglepangu_jax.cli import side_by_side

PLAIN_SUFFIX = "/in-out"


class PlainLayoutRunner:
    """Runs an engine method on a teacher without the ``[out, in]`` copies."""

    def __init__(self, teacher: Any, method: Any):
        self.teacher, self.method = teacher, method

    def __call__(self, prompt_ids: Sequence[int], spec, *, eos_id: int):
        from eaglepangu_jax.evaluation.run import run_method

        result, _ = run_method(self.teacher, self.method, prompt_ids)
        return result

    def describe(self) -> dict[str, Any]:
        return {
            "teacher_layout": "prepared, [in, out] weights only",
            "drafter": repr(self.method.drafter),
        }


def main(argv=None, *, teacher=None, renderer=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side_by_side.add_suite_arguments(p, per_category=2)
    p.add_argument("--methods", default="ngram,ngram-corpus", help="drafters, comma-separated")
    p.add_argument(
        "--verify-slots",
        default=None,
        help="time the verify forward at these slot counts instead of generating",
    )
    p.add_argument("--context", type=int, default=200, help="committed tokens (verify timing)")
    p.add_argument("--repeats", type=int, default=15, help="timed passes (verify timing)")
    args = p.parse_args(argv)
    slots = None
    if args.verify_slots is not None:
        try:
            slots = [int(s) for s in args.verify_slots.split(",")]
        except ValueError:
            p.error(f"--verify-slots must be comma-separated integers, got {args.verify_slots!r}")
        if not slots or min(slots) < 1 or args.context < 0 or args.repeats < 1:
            p.error("--verify-slots must be >= 1 each, --context >= 0, --repeats >= 1")
    side_by_side.check_suite_arguments(p, args)

    from eaglepangu_jax.methods.registry import REFERENCE, engine_drafters

    try:
        names = engine_drafters(args.methods)
    except ValueError as err:
        p.error(str(err))

    from eaglepangu_jax.calibration.layout import with_layout

    # The library teacher in the layout this machine chose (see calibration.layout) has the
    # copies made if it lacks them; the plain one shares its [in, out] arrays.
    teacher = with_layout(side_by_side.real_teacher(teacher), transposed_copy=True)
    plain = with_layout(teacher, transposed_copy=False)
    if slots is not None:
        return _verify_report(teacher, plain, slots, args.context, args.repeats, args.json)

    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.methods.registry import DEFAULT_BUDGET, DEFAULT_DEPTH, make_method

    # The tree settings of `eaglepangu bench` with none given.
    spec = SpecConfig(
        budget=DEFAULT_BUDGET, depth=DEFAULT_DEPTH, max_new_tokens=args.max_new_tokens
    )
    methods = [make_method(REFERENCE, spec)]
    for name in names:
        method = make_method(name, spec, default_depth=True)
        # Its own cost correction: the two layouts' verify costs differ.
        twin = dataclasses.replace(method, correction=None)
        methods += [
            method,
            dataclasses.replace(
                method,
                name=name + PLAIN_SUFFIX,
                runner=PlainLayoutRunner(plain, twin),
                # The twin's correction, so the report shows the one that learns.
                correction=twin.correction,
            ),
        ]
    side_by_side.run_and_report(
        teacher,
        methods,
        args,
        "teacher_layout",
        {"with_copies": names, "without_copies": [n + PLAIN_SUFFIX for n in names]},
        renderer=renderer,
    )
    return 0


def _verify_report(with_copies, plain, slots, context, repeats, path) -> int:
    import statistics

    from eaglepangu_jax.calibration.measure import measure_grids
    from eaglepangu_jax.files import write_json_atomic
    from eaglepangu_jax.models.llama import TRANSPOSED_MIN_ROWS

    # Each pass times every slot count once per teacher, the teachers alternating.
    grids = measure_grids(
        {"with_copies": with_copies, "in_out_only": plain}, slots, [context], repeats
    )
    times = {(name, x.slots): x.times for name, samples in grids.items() for x in samples}
    ms = {key: 1e3 * statistics.median(t) for key, t in times.items()}
    report = {
        "context": context,
        "repeats": repeats,
        "min_rows_for_copies": TRANSPOSED_MIN_ROWS,
        "verify_ms": {
            str(s): {
                "with_copies": ms["with_copies", s],
                "in_out_only": ms["in_out_only", s],
                "ratio": ms["with_copies", s] / ms["in_out_only", s],
            }
            for s in slots
        },
    }
    write_json_atomic(path, report)
    print(f"{'slots':>5} {'[in,out] ms':>12} {'with copies ms':>15} {'ratio':>6}")
    for s in slots:
        row = report["verify_ms"][str(s)]
        print(
            f"{s:>5} {row['in_out_only']:>12.2f} {row['with_copies']:>15.2f} {row['ratio']:>6.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
