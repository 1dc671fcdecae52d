"""``eaglepangu trace summarize``: per-phase totals and the acceptance histogram."""

from __future__ import annotations

import argparse
import json

from eaglepangu_jax.cli import args as args_lib
from eaglepangu_jax.engine.trace import summarize
from eaglepangu_jax.files import write_text_atomic

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``trace`` (and its ``summarize`` action) to the sub-command set ``sub``."""
    t = sub.add_parser(
        "trace",
        formatter_class=args_lib.Formatter,
        help="read traces",
        description="Read traces written by 'eaglepangu generate --trace'.",
    )
    tsub = t.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    ts = tsub.add_parser(
        "summarize",
        formatter_class=args_lib.Formatter,
        help="per-phase totals and the acceptance histogram",
        description="Per-phase time totals and the histogram of accepted lengths of a trace file.",
    )
    ts.add_argument("file", metavar="FILE", help="a trace (JSON Lines)")
    ts.add_argument("--json", metavar="OUT", default=None, help="also write the summary as JSON")
    return ts


def run(parser, args) -> int:
    """``eaglepangu trace summarize``."""
    try:
        summary = summarize(args.file)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    if args.json:
        args_lib.writable(parser, args.json, "summary")
        write_text_atomic(args.json, json.dumps(summary.to_json(), indent=1) + "\n")
    print(summary.to_text())
    return 0
