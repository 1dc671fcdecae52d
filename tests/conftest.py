"""Shared test settings: strict dtype promotion, CI-sized hypothesis profiles.

The mode fixtures only set an environment variable that no example changes, so sharing them
across hypothesis examples is safe (hence the suppressed function-scoped-fixture check).
"""

import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# Implicit rank promotion and dtype promotion hide bugs in index arithmetic: forbid them.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
    derandomize=True,
)
settings.register_profile("dev", max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
