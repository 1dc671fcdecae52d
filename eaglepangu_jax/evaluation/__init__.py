"""Evaluation: prompt suites, the side-by-side benchmark, reports, experiment grids, figures.

* :mod:`.suites`: MT-Bench and HumanEval turns (shipped), prompt files;
* :mod:`.run`: every method on the same turns beside greedy (:func:`run_bench`);
* :mod:`.report`: summaries, tables and the JSON report;
* :mod:`.grids` and :mod:`.experiments`: sweeps, window ablation, controller vs fixed budgets;
* :mod:`.plots` and :mod:`.calibration_report`: figures.
"""

from eaglepangu_jax.evaluation.report import format_summary, summarize_turns, write_report
from eaglepangu_jax.evaluation.run import CompileWatch, generate_with, run_bench, run_method
from eaglepangu_jax.evaluation.suites import SUITES, Conversation, load_prompts, load_suite

__all__ = [
    "SUITES",
    "CompileWatch",
    "Conversation",
    "format_summary",
    "generate_with",
    "load_prompts",
    "load_suite",
    "run_bench",
    "run_method",
    "summarize_turns",
    "write_report",
]
