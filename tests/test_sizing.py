"""A drafter's budget from this machine's verify timings (``calibration.sizing``), the method
it resizes (``methods.registry.with_machine_budget``) and the run-time entry point that
measures and sizes (``calibration.auto.calibrated_methods``)."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from conftest import random_eagle3_head

from eaglepangu_jax import engine
from eaglepangu_jax.calibration import auto, curve, sizing
from eaglepangu_jax.calibration.store import Sample
from eaglepangu_jax.drafters import eagle3
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, num_layers=1, max_position=256)
DEFAULT = SpecConfig(budget=methods_lib.DEFAULT_BUDGET, depth=methods_lib.DEFAULT_DEPTH)
# Verify milliseconds at the engine's buckets for 8-node trees, 128 cached tokens: the AMD
# machine's quiet timings (two and four slots alike) and the Intel machine's (four 1.4x two).
FLAT = {1: 28.0, 2: 37.0, 4: 37.0, 9: 54.0}
STEEP = {1: 42.0, 2: 45.0, 4: 63.0, 9: 86.0}
# The AMD machine with the few-row product kernel (models/few_row.py): two slots cost one's.
KERNEL = {1: 26.9, 2: 27.7, 4: 30.6, 9: 47.0}


def calibration_of(ms_by_slots, context=128, extra=()):
    samples = tuple(
        Sample(slots=s, context=context, window=256, seconds=t / 1e3, times=(t / 1e3,))
        for s, t in ms_by_slots.items()
    )
    return dataclasses.replace(curve.uncalibrated(CFG), samples=samples + tuple(extra))


def budget_of(ms_by_slots, floor=1, **kwargs):
    return sizing.machine_budget(calibration_of(ms_by_slots), CFG, floor, **kwargs).budget


# ------------------------------------------------------------------------- machine_budget


def test_flat_verify_raises_the_budget_to_the_largest_flat_bucket():
    assert budget_of(FLAT) == 3  # four slots cost two's; nine cost 1.46x
    assert budget_of(STEEP) == 1  # four slots cost 1.4x two
    assert budget_of(KERNEL) == 3  # four slots 1.10x two: three nodes paid more than one
    assert budget_of({1: 10.0, 2: 10.0, 4: 10.2, 9: 10.9}) == 8


def test_the_tolerance_is_inclusive_and_measured_against_the_floor_bucket():
    assert budget_of({1: 30.0, 2: 40.0, 4: 48.0, 9: 80.0}) == 3  # exactly 1.20x
    assert budget_of({1: 30.0, 2: 40.0, 4: 48.5, 9: 80.0}) == 1
    assert budget_of({1: 30.0, 2: 40.0, 4: 48.5, 9: 80.0}, tolerance=0.3) == 3
    assert budget_of(FLAT, tolerance=0.0) == 3  # equal times count as flat
    # From a floor of 3 the reference is four slots: nine cost 1.46x.
    assert budget_of(FLAT, floor=3) == 3


def test_only_measured_buckets_within_the_ceiling_are_candidates():
    flat_to_nine = {1: 10.0, 2: 10.0, 4: 10.0, 9: 10.0}
    assert budget_of(flat_to_nine, ceiling=7) == 3  # 8 nodes (9 slots) is above it
    assert budget_of(flat_to_nine, ceiling=2) == 1  # 3 nodes too; 2 was never measured
    assert budget_of({1: 10.0, 2: 10.0}) == 1  # nothing above the floor was timed


def test_a_disturbed_smaller_bucket_reads_as_the_larger_ones_time():
    """A two-slot median slower than four slots' was slowed by something else (see
    fit.predict): the monotone table reads it at four slots' time, so the curve is flat."""
    assert budget_of({1: 28.0, 2: 52.0, 4: 37.0, 9: 54.0}) == 3


def test_the_shortest_measured_context_decides():
    long_flat = [
        Sample(slots=s, context=1024, window=2048, seconds=t / 1e3, times=(t / 1e3,))
        for s, t in {1: 10.0, 2: 10.0, 4: 10.0, 9: 10.0}.items()
    ]
    got = sizing.machine_budget(calibration_of(STEEP, extra=long_flat), CFG, 1)
    assert (got.budget, got.context) == (1, 128)
    assert got.verify_seconds == pytest.approx({s: t / 1e3 for s, t in STEEP.items()})
    assert "4 slots 63.0 ms" in got.describe()


def test_no_timings_keep_the_floor_and_bad_arguments_are_refused():
    got = sizing.machine_budget(curve.uncalibrated(CFG), CFG, 2)
    assert (got.budget, got.floor, got.context) == (2, 2, None)
    assert "no verify timings" in got.describe()
    for kwargs in ({"floor": 0}, {"floor": 3, "ceiling": 2}, {"floor": 1, "tolerance": -0.1}):
        with pytest.raises(ValueError, match="floor"):
            sizing.machine_budget(calibration_of(FLAT), CFG, **kwargs)


# -------------------------------------------------------------------- the methods it sizes


@pytest.fixture(scope="module")
def tiny_head():
    params = random_params(CFG, jax.random.key(0))
    head_cfg, head_params = random_eagle3_head(CFG, params["embed"], stride=2)
    return params, lambda: (eagle3.Eagle3Drafter(config=head_cfg), head_params)


def default_eagle3(loader, spec=DEFAULT):
    return methods_lib.make_method(
        "eagle3", spec, default_depth=True, default_budget=True, eagle3_loader=loader
    )


def test_only_a_sized_drafter_at_its_default_budget_and_depth_is_machine_sized(tiny_head):
    _, loader = tiny_head
    own = default_eagle3(loader)
    assert own.machine_sized and (own.spec.budget, own.spec.depth) == (1, 1)
    named_depth = methods_lib.make_method(
        "eagle3:2", DEFAULT, default_depth=True, default_budget=True, eagle3_loader=loader
    )
    chosen_budget = methods_lib.make_method(
        "eagle3", DEFAULT, default_depth=True, eagle3_loader=loader
    )
    ngram = methods_lib.make_method("ngram", DEFAULT, default_depth=True, default_budget=True)
    for method in (named_depth, chosen_budget, ngram):
        assert not method.machine_sized
        with pytest.raises(ValueError, match="not sized by the machine"):
            methods_lib.with_machine_budget(method, 3)
    assert set(methods_lib.MACHINE_SIZED) <= set(methods_lib.DRAFTER_BUDGETS)


def test_a_resized_method_is_the_method_built_at_that_budget(tiny_head):
    _, loader = tiny_head
    own = default_eagle3(loader)
    resized = methods_lib.with_machine_budget(own, 3)
    built = methods_lib.make_method(
        "eagle3", dataclasses.replace(DEFAULT, budget=3, depth=3), eagle3_loader=loader
    )
    assert resized.spec == built.spec and resized.drafter == built.drafter
    assert (resized.drafter.budget, resized.drafter.depth) == (3, 3)
    assert not resized.machine_sized  # sized once
    assert resized.correction is not own.correction  # its own cost correction
    assert curve.draft_cost_key(resized) != curve.draft_cost_key(own)
    # Never deeper than the drafter goes.
    deep = methods_lib.with_machine_budget(own, 8)
    full = methods_lib.make_method("eagle3", DEFAULT, default_depth=True, eagle3_loader=loader)
    assert deep.spec.depth == deep.drafter.depth == full.spec.depth < 8
    with pytest.raises(ValueError, match="budget must be >= 1"):
        methods_lib.with_machine_budget(own, 0)


def test_sized_methods_resizes_only_the_machine_sized_ones(tiny_head):
    _, loader = tiny_head
    greedy = methods_lib.make_method(methods_lib.REFERENCE, DEFAULT)
    ngram = methods_lib.make_method("ngram", DEFAULT, default_depth=True, default_budget=True)
    methods = [greedy, default_eagle3(loader), ngram]
    out, sizings = sizing.sized_methods(calibration_of(FLAT), CFG, methods)
    assert out[0] is greedy and out[2] is ngram
    assert out[1].spec.budget == 3 and set(sizings) == {"eagle3"}
    assert sizing.sized_methods(calibration_of(FLAT), CFG, out)[0] == out  # idempotent
    same, none = sizing.sized_methods(None, CFG, methods)
    assert same == methods and none == {}
    steep, _ = sizing.sized_methods(calibration_of(STEEP), CFG, methods)
    assert steep[1].spec.budget == 1 and not steep[1].machine_sized


def test_calibrated_methods_measures_the_default_buckets_sizes_and_times_the_new_size(
    tiny_head, tmp_path
):
    params, loader = tiny_head
    teacher = engine.Teacher(CFG, params)
    spec = dataclasses.replace(DEFAULT, max_new_tokens=8)
    path = tmp_path / "cal.json"
    ngram = methods_lib.make_method("ngram", dataclasses.replace(spec, budget=2, depth=2))
    methods, calibration = auto.calibrated_methods(
        teacher, [default_eagle3(loader, spec), ngram], path=path, progress=False
    )
    # The grid reaches the default budget's buckets although no method runs above 2 nodes.
    assert sorted({s.slots for s in calibration.samples}) == list(
        auto.quick_slots(methods_lib.DEFAULT_BUDGET)
    )
    want = sizing.machine_budget(calibration, CFG, 1).budget
    sized = methods[0]
    assert sized.spec.budget == want and not sized.machine_sized
    assert methods[1] is ngram
    # Both drafting costs are timed, the head's at the size it runs at.
    assert {curve.draft_cost_key(m) for m in methods} <= set(calibration.t_draft)
    # Sizing is reproducible from the saved file: a second call measures nothing new.
    again, saved = auto.calibrated_methods(
        teacher, [default_eagle3(loader, spec), ngram], path=path, progress=False
    )
    assert saved == calibration and again[0].spec == sized.spec
