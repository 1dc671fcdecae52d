"""The ``eaglepangu`` command line: the top layer, and the only user of argparse."""

from eaglepangu_jax.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
