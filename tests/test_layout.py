"""The teacher's weight layout chosen per machine (``calibration.layout``): the rule, the
probe on a tiny teacher, the saved file (reused, refused when corrupt or foreign), the
calibration that follows the layout, and ``runtime.load_teacher``'s choices."""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import pytest

from eaglepangu_jax import runtime
from eaglepangu_jax.calibration import auto, curve, layout, store
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, num_layers=1, max_position=256)


@pytest.fixture(scope="module")
def teacher():
    return Teacher(CFG, random_params(CFG, jax.random.key(3)))


def probe_of(with_ms, without_ms, **fields):
    return layout.LayoutProbe(
        teacher=store.teacher_fingerprint(CFG),
        machine=store.describe_machine(),
        date="2026-12-07T00:00:00+00:00",
        slots=9,
        context=128,
        with_copies=tuple(t / 1e3 for t in with_ms),
        in_out_only=tuple(t / 1e3 for t in without_ms),
        **fields,
    )


# ------------------------------------------------------------------------------ the rule


def test_the_copies_are_kept_only_for_a_real_gain():
    # The 9-slot verify measured on two machines (ms): Intel 75.3 vs 86.5, AMD 69.9 vs 54.6.
    assert layout.copies_pay(75.3, 86.5)
    assert not layout.copies_pay(69.9, 54.6)
    assert not layout.copies_pay(50.0, 50.0)  # equal: one copy of the weights is enough
    assert layout.copies_pay(97.0, 100.0) and not layout.copies_pay(97.1, 100.0)
    assert layout.copies_pay(97.1, 100.0, min_gain=0.0)
    # The probe decides by the medians of its timings.
    assert probe_of((70.0, 69.9, 90.0), (54.6, 54.0, 56.0)).transposed_copy is False
    assert probe_of((75.3, 75.0, 80.0), (86.5, 86.0, 88.0)).transposed_copy is True


def test_with_layout_makes_or_drops_the_copies_and_shares_the_weights(teacher):
    plain = layout.with_layout(teacher, transposed_copy=False)
    both = layout.with_layout(plain, transposed_copy=True)
    assert not llama.has_transposed_copy(plain.params)
    assert llama.has_transposed_copy(both.params)
    assert plain.params["layers"][0]["wq"] is both.params["layers"][0]["wq"]
    assert layout.with_layout(both, transposed_copy=True) is both


# ----------------------------------------------------------------------------- the probe


def test_probe_times_both_layouts_and_refuses_a_size_that_reads_no_copy(teacher):
    probe = layout.probe_layout(teacher, slots=9, context=16, repeats=3)
    assert len(probe.with_copies) == len(probe.in_out_only) == 3
    assert min(probe.with_copies + probe.in_out_only) > 0
    assert probe.teacher == store.teacher_fingerprint(CFG)
    assert (probe.slots, probe.context) == (9, 16)
    assert isinstance(probe.transposed_copy, bool)
    with pytest.raises(ValueError, match="never reads the copies"):
        layout.probe_layout(teacher, slots=llama.TRANSPOSED_MIN_ROWS - 1)


# ----------------------------------------------------------------------- the saved probe


def test_machine_layout_measures_once_then_reads_the_file(teacher, tmp_path, monkeypatch):
    path = tmp_path / "layout.json"
    calls = []

    def fake_probe(t, **kwargs):
        calls.append(t)
        return probe_of((70.0,), (55.0,))  # the copies do not pay

    monkeypatch.setattr(layout, "probe_layout", fake_probe)
    chosen, probe = layout.machine_layout(teacher, path=path, progress=False)
    assert len(calls) == 1 and not llama.has_transposed_copy(chosen.params)
    assert layout.load_probe(path) == probe
    assert json.loads(path.read_text())["transposed_copy"] is False
    again, saved = layout.machine_layout(teacher, path=path, progress=False)
    assert len(calls) == 1 and saved == probe
    assert not llama.has_transposed_copy(again.params)


@pytest.mark.parametrize(
    "change",
    [
        {"teacher": "another teacher's fingerprint"},
        {"machine": {**store.describe_machine(), "processor": "another CPU"}},
        {"machine": {**store.describe_machine(), "xla_flags": "--xla_some_other_flag=true"}},
    ],
    ids=["teacher", "machine", "flags"],
)
def test_a_probe_for_another_teacher_machine_or_flags_is_measured_again(
    teacher, tmp_path, monkeypatch, change
):
    path = tmp_path / "layout.json"
    layout.save_probe(dataclasses.replace(probe_of((70.0,), (55.0,)), **change), path)
    assert layout.saved_probe(CFG, path=path) is None
    monkeypatch.setattr(layout, "probe_layout", lambda t, **kw: probe_of((50.0,), (60.0,)))
    chosen, probe = layout.machine_layout(teacher, path=path, progress=False)
    assert llama.has_transposed_copy(chosen.params)
    assert layout.load_probe(path) == probe  # the new measurement replaced the file


@pytest.mark.parametrize(
    "text,message",
    [
        ("{not json", "corrupt"),
        (b"\xff\xfe".decode("latin-1"), "corrupt"),
        ('{"format": "something-else"}', "not a teacher layout file"),
        ('{"format": "eaglepangu-teacher-layout", "version": 99}', "version 99"),
        ('{"format": "eaglepangu-teacher-layout", "version": 1}', "missing or bad field"),
    ],
)
def test_a_corrupt_or_foreign_file_is_refused_by_name_and_measured_again(
    teacher, tmp_path, monkeypatch, caplog, text, message
):
    path = tmp_path / "layout.json"
    path.write_text(text, encoding="latin-1")
    with pytest.raises(store.CalibrationFileError, match=message):
        layout.load_probe(path)
    monkeypatch.setattr(layout, "probe_layout", lambda t, **kw: probe_of((70.0,), (55.0,)))
    with caplog.at_level(logging.WARNING):
        chosen, _ = layout.machine_layout(teacher, path=path, progress=False)
    assert str(path) in caplog.text
    assert not llama.has_transposed_copy(chosen.params)
    assert layout.load_probe(path).transposed_copy is False


@pytest.mark.parametrize("bad", [-0.01, float("nan"), "fast", True])
def test_a_timing_that_is_not_a_finite_non_negative_number_is_refused(tmp_path, bad):
    path = tmp_path / "layout.json"
    layout.save_probe(probe_of((70.0, 71.0), (55.0,)), path)
    document = json.loads(path.read_text())
    document["with_copies"][1] = bad
    path.write_text(json.dumps(document))
    with pytest.raises(store.CalibrationFileError, match="with_copies"):
        layout.load_probe(path)
    assert layout.saved_probe(CFG, path=path) is None


# ---------------------------------------------------------- the calibration follows it


def test_a_calibration_measured_in_the_other_layout_is_measured_again(teacher, tmp_path):
    path = tmp_path / "cal.json"
    both = layout.with_layout(teacher, transposed_copy=True)
    plain = layout.with_layout(teacher, transposed_copy=False)
    grid = dict(path=path, progress=False, grid_budget=1)
    first = auto.ensure_calibration(both, {}, **grid)
    assert first.details["transposed_copy"] is True
    assert auto.ensure_calibration(both, {}, **grid) == first  # read back, not measured
    second = auto.ensure_calibration(plain, {}, **grid)
    assert second.details["transposed_copy"] is False and second.date >= first.date
    assert store.load_calibration(path) == second
    # A file from before the layout was recorded was measured with the copies.
    details = {k: v for k, v in second.details.items() if k != "transposed_copy"}
    store.save_calibration(dataclasses.replace(second, details=details), path)
    assert auto.ensure_calibration(both, {}, **grid).details == details
    assert auto.ensure_calibration(plain, {}, **grid).details["transposed_copy"] is False


# --------------------------------------------------------------------- runtime's choice


def test_load_teacher_refuses_an_unknown_layout_before_loading_anything(monkeypatch):
    def refuse():
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(runtime, "load_smollm2", refuse)
    with pytest.raises(ValueError, match="unknown weight layout 'sideways'"):
        runtime.load_teacher(layout="sideways")


@pytest.mark.parametrize("choice", ["transposed", "in-out", "auto"])
def test_load_teacher_lays_out_the_weights_as_asked_or_as_the_machine_chose(
    monkeypatch, tmp_path, choice
):
    stacked = random_params(CFG, jax.random.key(4))
    monkeypatch.setattr(runtime, "load_smollm2", lambda: (CFG, stacked))
    monkeypatch.setenv("EAGLEPANGU_CACHE", str(tmp_path))
    monkeypatch.setattr(layout, "probe_layout", lambda t, **kw: probe_of((50.0,), (60.0,)))
    loaded = runtime.load_teacher(layout=choice, progress=False)
    assert llama.has_transposed_copy(loaded.params) is (choice != "in-out")
    if choice != "in-out" and "lm_head" not in stacked:
        # Made from the stacked layout, the tied head's [out, in] copy is the table itself.
        assert loaded.params[llama.TRANSPOSED]["lm_head"] is loaded.params["embed"]
    assert (tmp_path / layout.FILE_NAME).exists() is (choice == "auto")


@pytest.mark.parametrize("flags", ["--xla_some_other_flag=true", None], ids=["other", "unrecorded"])
def test_a_calibration_measured_under_other_xla_flags_is_measured_again(teacher, tmp_path, flags):
    """The test suite compiles at -O0: its calibrations must not serve the command line's
    runs (nor theirs the suite's). A file from before the flags were recorded neither."""
    path = tmp_path / "cal.json"
    grid = dict(path=path, progress=False, grid_budget=1)
    first = auto.ensure_calibration(teacher, {}, **grid)
    assert first.machine["xla_flags"] == store.describe_machine()["xla_flags"]
    machine = {k: v for k, v in first.machine.items() if k != "xla_flags"}
    if flags is not None:
        machine["xla_flags"] = flags
    store.save_calibration(dataclasses.replace(first, machine=machine), path)
    assert curve.usable_calibration(CFG, path=path) is None
    again = auto.ensure_calibration(teacher, {}, **grid)
    assert again.machine == first.machine and store.load_calibration(path) == again
