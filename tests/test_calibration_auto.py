"""Calibration without a manual step (``calibration.auto.ensure_calibration``), on a tiny
teacher: measured once and saved, reused afterwards, refused and rebuilt when the saved file
is corrupt or belongs to another machine or teacher, completed when a drafter is missing,
and written atomically.

One real quick calibration is measured per module (:func:`measured`); the other tests start
from a copy of its file, and the re-measurements they trigger reuse its compiled programs.
"""

import contextlib
import dataclasses
import json
import logging
import os
import shutil

import jax
import pytest

from eaglepangu_jax import engine
from eaglepangu_jax.calibration import auto, curve, store
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.methods.registry import make_method
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, num_layers=1, max_position=256)
OTHER = LlamaConfig.tiny(vocab_size=97, num_layers=2, max_position=256)
SPEC = SpecConfig(budget=4, depth=3, max_new_tokens=8)
DTYPE = "float32"


@pytest.fixture(scope="module")
def teacher():
    return engine.Teacher(CFG, random_params(CFG, jax.random.key(0)))


NGRAM = make_method("ngram", SPEC)
NGRAM_KEY = curve.draft_cost_key(NGRAM)  # "ngram:budget=4,depth=3"


@pytest.fixture(scope="module")
def methods():
    return auto.controlled_methods([NGRAM])


@pytest.fixture(scope="module")
def measured(teacher, methods, tmp_path_factory):
    """``(path, calibration)``: a first call on a missing file (in a missing folder)."""
    path = tmp_path_factory.mktemp("first") / "sub" / "cal.json"
    calibration = auto.ensure_calibration(teacher, methods, path=path, progress=False)
    return path, calibration


@pytest.fixture
def counted(monkeypatch):
    """Counts full measurements and drafter timings (the real ones still run)."""
    calls = {"calibrate": 0, "draft": []}
    real_calibrate, real_draft = auto.calibrate_teacher, auto.measure_draft

    def calibrate(*args, **kwargs):
        calls["calibrate"] += 1
        return real_calibrate(*args, **kwargs)

    def draft(teacher, method, **kwargs):
        calls["draft"].append(method.drafter.name)
        return real_draft(teacher, method, **kwargs)

    monkeypatch.setattr(auto, "calibrate_teacher", calibrate)
    monkeypatch.setattr(auto, "measure_draft", draft)
    return calls


@pytest.fixture
def no_measuring(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured again: the saved calibration should have been used")

    monkeypatch.setattr(auto, "calibrate_teacher", refuse)
    monkeypatch.setattr(auto, "measure_draft", refuse)


def copy_of(measured, tmp_path):
    path = tmp_path / "cal.json"
    shutil.copyfile(measured[0], path)
    return path


def only_the_file(path):
    """Nothing but the calibration in its folder: no temporary file left behind."""
    assert sorted(os.listdir(path.parent)) == [path.name]


def assert_fresh(calibration, path):
    """``calibration`` is a quick one for this teacher and machine, saved at ``path``."""
    assert calibration.teacher == store.teacher_fingerprint(CFG, DTYPE)
    assert store.same_machine(calibration)
    assert calibration.details.get("quick") is True
    assert calibration.t_draft[NGRAM_KEY] > 0
    assert store.load_calibration(path, config=CFG, dtype=DTYPE) == calibration
    only_the_file(path)


# ------------------------------------------------------------------ measured, then reused


def test_missing_file_is_measured_and_saved(measured):
    path, calibration = measured
    assert path.exists()
    assert_fresh(calibration, path)
    # The quick grid: the engine's slot buckets for the budget, at one context.
    assert sorted({s.slots for s in calibration.samples}) == list(auto.quick_slots(SPEC.budget))
    assert {s.context for s in calibration.samples} == set(auto.QUICK_CONTEXTS)
    assert all(s.seconds > 0 for s in calibration.samples)
    # What the engine's controller reads from it.
    assert curve.usable_calibration(CFG, path=path, dtype=DTYPE) == calibration


def test_second_call_reuses_the_saved_file(teacher, methods, measured, tmp_path, no_measuring):
    path = copy_of(measured, tmp_path)
    before = path.read_bytes()
    again = auto.ensure_calibration(teacher, methods, path=path, progress=False)
    assert again == measured[1]
    assert path.read_bytes() == before  # not rewritten
    only_the_file(path)


# ------------------------------------------------------------------ refused and rebuilt


def truncated(path):
    text = path.read_text()
    path.write_text(text[: len(text) // 2])


def garbage(path):
    path.write_bytes(b"\xff\xfe\x00\x9c garbage \x00\x81" * 50)


def not_a_calibration(path):
    path.write_text(json.dumps({"format": "something-else", "version": 1}))


def negative_time(path):
    data = json.loads(path.read_text())
    data["t_other"] = -1.0
    path.write_text(json.dumps(data))


def empty(path):
    path.write_bytes(b"")


CORRUPTIONS = [
    truncated,
    garbage,
    not_a_calibration,
    negative_time,
    empty,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_corrupt_file_is_refused_and_rebuilt(
    teacher, methods, measured, tmp_path, counted, caplog, corrupt
):
    path = copy_of(measured, tmp_path)
    corrupt(path)
    with caplog.at_level(logging.WARNING):
        rebuilt = auto.ensure_calibration(teacher, methods, path=path, progress=False)
    assert counted["calibrate"] == 1
    assert "corrupt" in caplog.text and "not used" in caplog.text
    assert_fresh(rebuilt, path)


def test_file_from_another_machine_is_replaced(
    teacher, methods, measured, tmp_path, counted, caplog
):
    path = copy_of(measured, tmp_path)
    data = json.loads(path.read_text())
    data["machine"] = dict(data["machine"], processor="Another CPU", device_kind="TPU v9")
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        replaced = auto.ensure_calibration(teacher, methods, path=path, progress=False)
    assert counted["calibrate"] == 1
    assert "another machine" in caplog.text
    assert_fresh(replaced, path)
    assert json.loads(path.read_text())["machine"]["device_kind"] != "TPU v9"


def test_file_for_another_teacher_is_replaced(teacher, methods, tmp_path, counted, caplog):
    path = tmp_path / "cal.json"
    other = dataclasses.replace(curve.uncalibrated(OTHER, DTYPE), t_draft={"ngram": 1e-3})
    store.save_calibration(other, path)
    with caplog.at_level(logging.WARNING):
        replaced = auto.ensure_calibration(teacher, methods, path=path, progress=False)
    assert counted["calibrate"] == 1
    assert "another teacher" in caplog.text
    assert replaced.teacher != other.teacher
    assert_fresh(replaced, path)


# ------------------------------------------------------------------ completed


def test_missing_drafter_is_timed_and_added(teacher, methods, measured, tmp_path, counted):
    path = tmp_path / "cal.json"
    without = dataclasses.replace(measured[1], t_draft={"eagle3": 0.125})
    store.save_calibration(without, path)
    completed = auto.ensure_calibration(teacher, methods, path=path, progress=False)
    assert counted["calibrate"] == 0
    assert counted["draft"] == ["ngram"]  # only the missing drafter was timed
    assert completed.t_draft["eagle3"] == 0.125  # the others are kept
    assert completed.t_draft[NGRAM_KEY] > 0
    # Nothing else changed, and the completed calibration was saved.
    assert dataclasses.replace(completed, t_draft=without.t_draft) == without
    assert store.load_calibration(path, config=CFG, dtype=DTYPE) == completed
    only_the_file(path)


# ------------------------------------------------------------------ atomic writes


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    teacher, methods, measured, tmp_path, monkeypatch
):
    path = copy_of(measured, tmp_path)
    truncated(path)  # to be rebuilt
    before = path.read_bytes()
    # No real measuring (it might write files of its own); then the final rename breaks.
    monkeypatch.setattr(auto, "calibrate_teacher", lambda *a, **k: measured[1])

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    # Whether a failed save reaches the caller is the caller's business; the file is not.
    with contextlib.suppress(OSError):
        auto.ensure_calibration(teacher, methods, path=path, progress=False)
    assert path.read_bytes() == before
    only_the_file(path)


def test_nothing_is_measured_when_no_method_runs_under_the_controller(
    teacher, measured, tmp_path, no_measuring
):
    """Greedy, a fixed policy (``--policy drafter``) or a peer read no costs: no calibration
    is measured or written for them; a usable saved one is still returned."""
    fixed = make_method("ngram", dataclasses.replace(SPEC, policy="drafter"))
    assert auto.controlled_methods([fixed]) == {}
    path = tmp_path / "none" / "cal.json"
    assert auto.ensure_calibration(teacher, {}, path=path, progress=False) is None
    assert not path.parent.exists()
    saved = copy_of(measured, tmp_path)
    assert auto.ensure_calibration(teacher, {}, path=saved, progress=False) == measured[1]
