"""``eaglepangu ngram-table``: count the corpus n-gram table of the ``ngram-corpus`` drafter
(the training answers of the given corpora; default: the three packaged corpora, into the
packaged table)."""

from __future__ import annotations

import argparse
import json
from importlib import resources

from eaglepangu_jax.cli import args as args_lib

__all__ = ["DEFAULT_CORPORA", "add_arguments", "run"]

DEFAULT_CORPORA = ("corpus", "corpus-written", "corpus-h200")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--corpus",
        action="append",
        default=None,
        help="count this corpus folder's training answers; repeat for several (default: the "
        f"package's {', '.join(DEFAULT_CORPORA)})",
    )
    p.add_argument(
        "--min-count",
        type=args_lib.positive,
        default=2,
        help="keep a context only if its most frequent next token followed it this often",
    )
    p.add_argument(
        "--max-order",
        type=args_lib.positive,
        default=None,
        metavar="K",
        help="count contexts of 1 .. K tokens (default 3, as the packaged table; the drafter "
        "reads up to 5: on the dev suite 4 and 5 did not beat 3)",
    )
    p.add_argument(
        "--prune",
        action="store_true",
        help="leave out the rows whose next token the context one token shorter already "
        "predicts (the drafter chains the same tokens from a smaller table; the frequencies "
        "it reads for those contexts are the shorter ones')",
    )
    p.add_argument(
        "--out",
        default=None,
        help="table path without suffix (default: the packaged table the drafter loads)",
    )


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from eaglepangu_jax.drafters.ngram_corpus import SHIPPED
    from eaglepangu_jax.drafters.ngram_table import MAX_ORDER
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint
    from eaglepangu_jax.training.ngram_counts import DEFAULT_MAX_ORDER, build_table_file

    package = resources.files("eaglepangu_jax")
    corpora = args.corpus or [str(package / "data" / name) for name in DEFAULT_CORPORA]
    out = args.out if args.out is not None else str(package / "weights" / SHIPPED)
    max_order = DEFAULT_MAX_ORDER if args.max_order is None else args.max_order
    if max_order > MAX_ORDER:
        parser.error(f"--max-order must be in 1..{MAX_ORDER}, got {max_order}")
    args_lib.writable(parser, f"{out}.json", "n-gram table")
    try:
        info = build_table_file(
            corpora,
            out,
            fingerprint=teacher_fingerprint(),
            min_count=args.min_count,
            max_order=max_order,
            prune=args.prune,
        )
    except ValueError as err:
        parser.error(f"--corpus: {err}")
    info.pop("corpora")
    print(f"wrote {out}.safetensors: {json.dumps(info)}")
    return 0
