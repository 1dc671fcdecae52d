"""Calibration on a tiny random teacher: the grid, the saved file, the curve, the plot, the CLI."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax.calibration import curve as cal_curve
from eaglepangu_jax.calibration import fit as cal_fit
from eaglepangu_jax.calibration import measure as cal_measure
from eaglepangu_jax.calibration import store as cal_store
from eaglepangu_jax.cli import calibrate as cli_calibrate
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation import calibration_report as cal_report
from eaglepangu_jax.evaluation import plots
from eaglepangu_jax.methods import registry as methods_lib
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
SLOTS, CONTEXTS, REPEATS = (1, 4), (8, 300), 2
SPEC = SpecConfig(budget=4, depth=3)


@pytest.fixture(scope="module")
def teacher():
    return gen.Teacher(CFG, random_params(CFG, jax.random.key(3)))


@pytest.fixture(scope="module")
def measured(teacher):
    """One real (tiny) calibration shared by the tests that need measurements."""
    return cal_measure.calibrate_teacher(
        teacher,
        slots=SLOTS,
        contexts=CONTEXTS,
        repeats=REPEATS,
        drafters={"ngram": methods_lib.make_method("ngram", SPEC)},
    )


def synthetic(**override) -> cal_store.MachineCalibration:
    """A calibration with known coefficients and overheads (no timing noise)."""
    base = cal_curve.uncalibrated(CFG)
    values = dict(
        a_c=3.0,
        b_c=2e-4,
        a_m=1.5,
        b_m=1e-4,
        t_other=5e-4,
        t_draft={"ngram": 2.5e-4},
        samples=(
            cal_store.Sample(slots=1, context=8, window=256, seconds=1e-3, times=(1e-3,)),
            cal_store.Sample(slots=4, context=8, window=256, seconds=2e-3, times=(2e-3,)),
        ),
    )
    return dataclasses.replace(base, **{**values, **override})


# ----------------------------------------------------------------------------- measuring


def test_grid_shape_windows_and_positive_medians(measured):
    samples = measured.samples
    assert [(x.context, x.slots) for x in samples] == [(c, s) for c in CONTEXTS for s in SLOTS]
    for x in samples:
        assert x.window == gen.window_for(x.context + x.slots, CFG.max_position)
        assert x.context + x.slots <= x.window
        assert len(x.times) == REPEATS and all(t > 0 for t in x.times)
        assert x.seconds == pytest.approx(float(np.median(x.times)))
    assert {x.window for x in samples} == {256, 512}  # the engine's windows at c = 8, 300
    assert measured.t_other >= 0 and measured.t_draft["ngram"] > 0
    overhead = measured.details["overhead"]
    assert overhead["round_seconds"] > 0 and overhead["verify_seconds"] > 0
    for k in ("a_c", "b_c", "a_m", "b_m"):
        assert getattr(measured, k) >= 0
    assert measured.teacher == cal_store.teacher_fingerprint(CFG, "float32")


def test_probe_tree_is_valid_and_as_deep_as_asked():
    tree = cal_measure.probe_tree(9, 3)
    assert bool(jnp.all(tree.valid))
    assert np.asarray(tree.depth).tolist() == [0, 1, 2, 3, 1, 2, 3, 1, 2]
    assert cal_measure.probe_tree(1, 3).num_slots == 1


def test_measure_grid_rejects_bad_grids(teacher):
    with pytest.raises(ValueError, match="slots must be >= 1"):
        cal_measure.measure_grid(teacher, [0], [8], 1)
    with pytest.raises(ValueError, match="exceed the teacher's context"):
        cal_measure.measure_grid(teacher, [64], [500], 1)


def test_fit_uses_the_window_as_context():
    """Points made from known coefficients at the attended context are fitted back."""
    truth = synthetic()
    roofline = truth.roofline(CFG)
    rows = []
    for s, c in [(1, 8), (4, 8), (16, 8), (64, 8), (1, 300), (16, 300), (64, 300)]:
        w = cal_fit.engine_window(c, s, CFG)
        t = float(cal_fit.roofline_prediction(truth, CFG, s, c))
        rows.append(cal_store.Sample(slots=s, context=c, window=w, seconds=t, times=(t,)))
    fit = cal_fit.fit_samples(rows, roofline)
    again = dataclasses.replace(
        truth, **{k: float(getattr(fit, k)) for k in ("a_c", "b_c", "a_m", "b_m")}
    )
    np.testing.assert_allclose(
        cal_fit.roofline_prediction(again, CFG, [1, 16, 64], 300),
        cal_fit.roofline_prediction(truth, CFG, [1, 16, 64], 300),
        rtol=1e-3,
    )


def test_predict_interpolates_the_measured_grid():
    """Measured points are reproduced; between slot counts the line joins them; between
    windows the log-window mix; beyond the grid the roofline's relative change."""
    base = dataclasses.replace(synthetic(), samples=())
    rows = [
        cal_store.Sample(slots=s, context=0, window=w, seconds=t, times=(t,))
        for (s, w, t) in [
            (1, 256, 0.050),
            (4, 256, 0.074),
            (16, 256, 0.114),
            (1, 1024, 0.080),
            (4, 1024, 0.120),
            (16, 1024, 0.200),
        ]
    ]
    calibration = dataclasses.replace(base, samples=tuple(rows))
    for x in rows:
        assert float(
            cal_fit.predict(calibration, CFG, x.slots, 0, window=x.window)
        ) == pytest.approx(x.seconds)
    assert float(cal_fit.predict(calibration, CFG, 10, 0, window=256)) == pytest.approx(0.094)
    assert float(cal_fit.predict(calibration, CFG, 4, 0, window=512)) == pytest.approx(0.097)
    ratio = cal_fit.roofline_prediction(base, CFG, 32, 0, window=256) / cal_fit.roofline_prediction(
        base, CFG, 16, 0, window=256
    )
    assert float(cal_fit.predict(calibration, CFG, 32, 0, window=256)) == pytest.approx(
        0.114 * float(ratio)
    )
    assert float(cal_fit.predict(base, CFG, 4, 0, window=256)) == pytest.approx(
        float(cal_fit.roofline_prediction(base, CFG, 4, 0, window=256))
    )


def test_predict_never_makes_a_smaller_forward_dearer_than_a_larger_one():
    """A noisy grid (one slot timed slower than four, four slower than sixteen) is read as the
    minimum over every larger forward: the curve the controller sees is non-decreasing."""
    base = dataclasses.replace(synthetic(), samples=())
    rows = [
        cal_store.Sample(slots=s, context=0, window=256, seconds=t, times=(t,))
        for (s, t) in [(1, 0.098), (4, 0.069), (16, 0.119), (17, 0.115)]
    ]
    calibration = dataclasses.replace(base, samples=tuple(rows))
    got = [float(cal_fit.predict(calibration, CFG, s, 0, window=256)) for s in (1, 4, 16, 17)]
    assert got == pytest.approx([0.069, 0.069, 0.115, 0.115])
    curve = np.asarray(
        cal_curve.verify_latency_curve(
            dataclasses.replace(calibration, t_other=0.0), CFG, 100, 16, bucketed=True
        )
    )
    assert np.all(np.diff(curve) >= 0)


# ----------------------------------------------------------------------------- saving


def test_save_load_round_trip(measured, tmp_path):
    path = cal_store.save_calibration(measured, tmp_path / "cal.json")
    assert cal_store.load_calibration(path, config=CFG) == measured
    data = json.loads(path.read_text())
    assert data["format"] == cal_store.FORMAT and data["version"] == cal_store.VERSION
    assert {"date", "machine", "teacher", "fit", "samples", "t_other", "t_draft"} <= set(data)
    assert sorted(os.listdir(tmp_path)) == ["cal.json"]  # no temporary left behind


def test_save_is_atomic(measured, tmp_path, monkeypatch):
    path = cal_store.save_calibration(synthetic(), tmp_path / "cal.json")
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        cal_store.save_calibration(measured, path)
    assert path.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["cal.json"]


def test_default_path_follows_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLEPANGU_CACHE", str(tmp_path))
    assert cal_store.default_path() == tmp_path / "calibration.json"
    cal_store.save_calibration(synthetic())
    assert cal_store.load_calibration().a_c == 3.0


def test_load_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="eaglepangu calibrate"):
        cal_store.load_calibration(tmp_path / "nothing.json")


def _corrupt(data: dict, change) -> dict:
    data = json.loads(json.dumps(data))
    change(data)
    return data


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(format="something-else"), "not a eaglepangu-calibration"),
        (lambda d: d["fit"].pop("a_m"), "'a_m' is missing"),
        (lambda d: d["fit"].update(b_c=-1.0), "b_c must be finite and >= 0"),
        (lambda d: d["fit"].update(a_c="fast"), "a_c must be a number"),
        (lambda d: d["roofline"].update(bandwidth=0), "bandwidth must be > 0"),
        (lambda d: d["samples"][0].update(seconds=None), "seconds must be a number"),
        (lambda d: d.update(t_draft=[1, 2]), "corrupt"),
    ],
)
def test_load_refuses_corrupt_fields(tmp_path, change, message):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_corrupt(cal_store.to_json(synthetic()), change)))
    with pytest.raises(cal_store.CalibrationFileError, match=message):
        cal_store.load_calibration(path)


def test_load_refuses_truncated_json_other_versions_and_teachers(tmp_path):
    path = tmp_path / "cal.json"
    text = json.dumps(cal_store.to_json(synthetic()))
    path.write_text(text[: len(text) // 2])
    with pytest.raises(cal_store.CalibrationFileError, match="corrupt.*not JSON"):
        cal_store.load_calibration(path)
    path.write_text(
        json.dumps(_corrupt(cal_store.to_json(synthetic()), lambda d: d.update(version=99)))
    )
    with pytest.raises(cal_store.CalibrationFileError, match="version 99"):
        cal_store.load_calibration(path)
    cal_store.save_calibration(synthetic(), path)
    other = dataclasses.replace(CFG, num_layers=5)
    with pytest.raises(cal_store.CalibrationFileError, match="another teacher.*num_layers=3"):
        cal_store.load_calibration(path, config=other)
    with pytest.raises(cal_store.CalibrationFileError, match="another teacher"):
        cal_store.load_calibration(path, config=CFG, dtype="bfloat16")
    assert cal_store.load_calibration(path, config=CFG).a_c == 3.0


# ----------------------------------------------------------------------------- the curve


def test_curve_shape_monotone_and_bucket_steps():
    calibration = synthetic()
    budget = 20
    curve = np.asarray(cal_curve.verify_latency_curve(calibration, CFG, 100, budget))
    assert curve.shape == (budget + 1,) and curve.dtype == np.float32
    assert np.all(np.diff(curve) >= 0)
    # Buckets 1, 2, 4, 8, 16, 21: node counts 0 | 1 | 2-3 | 4-7 | 8-15 | 16-20 share their
    # cost.
    for lo, hi in [(0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 20)]:
        assert np.all(curve[lo : hi + 1] == curve[lo])
    assert len(np.unique(curve)) == 6
    # A run's own sizes: 1, 4, then the full tree.
    own = np.asarray(
        cal_curve.verify_latency_curve(calibration, CFG, 100, budget, slot_buckets=(1, 4))
    )
    for lo, hi in [(0, 0), (1, 3), (4, 20)]:
        assert np.all(own[lo : hi + 1] == own[lo])
    assert len(np.unique(own)) == 3 and np.all(own >= curve - 1e-9)
    flat = np.asarray(cal_curve.verify_latency_curve(calibration, CFG, 100, budget, bucketed=False))
    assert np.all(np.diff(flat) > 0)  # a_c > 0: every extra slot costs
    assert np.all(flat <= curve + 1e-9)  # a bucket never costs less than its content


def test_curve_adds_the_overheads_and_matches_predict():
    calibration = synthetic()
    window = gen.window_for(100 + 8 + 1, CFG.max_position)
    plain = np.asarray(cal_curve.verify_latency_curve(calibration, CFG, 100, 8, bucketed=False))
    verify = cal_fit.predict(calibration, CFG, np.arange(1, 10), 100, window=window)
    np.testing.assert_allclose(plain, verify + 5e-4, rtol=1e-6)
    with_draft = np.asarray(
        cal_curve.verify_latency_curve(calibration, CFG, 100, 8, bucketed=False, drafter="ngram")
    )
    np.testing.assert_allclose(with_draft - plain, 2.5e-4, rtol=1e-4)


def test_curve_rejects_bad_input():
    calibration = synthetic()
    with pytest.raises(ValueError, match="budget must be >= 1"):
        cal_curve.verify_latency_curve(calibration, CFG, 10, 0)
    with pytest.raises(ValueError, match="'eagle3' was not calibrated.*ngram"):
        cal_curve.verify_latency_curve(calibration, CFG, 10, 4, drafter="eagle3")
    with pytest.raises(ValueError, match="another teacher"):
        cal_curve.verify_latency_curve(calibration, dataclasses.replace(CFG, hidden_size=64), 10, 4)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.integers(0, 64), min_size=12, max_size=12),
    base=st.integers(1, 256),
    t_draft=st.integers(0, 512),
    t_other=st.integers(0, 512),
    logs=st.lists(st.floats(-12.0, 0.0), min_size=11, max_size=11),
)
def test_folding_constant_overheads_into_the_curve_keeps_the_choice(
    steps, base, t_draft, t_other, logs
):
    """choose_budget(curve + t_draft + t_other, 0, 0) == choose_budget(curve, t_draft, t_other).

    Times are multiples of 2**-10 s, so float32 sums are exact and the identity holds bit for
    bit (in real arithmetic it holds always: the rule compares C(n) and differences of T).
    """
    unit = 2.0**-10
    verify = np.float32(unit) * np.cumsum([base] + steps[1:]).astype(np.float32)
    logscores = jnp.asarray(sorted(logs, reverse=True), jnp.float32)
    explicit = budget_lib.choose_budget(
        logscores, jnp.asarray(verify), t_draft * unit, t_other * unit
    )
    folded_curve = verify + np.float32((t_draft + t_other) * unit)
    folded = budget_lib.choose_budget(logscores, jnp.asarray(folded_curve), 0.0, 0.0)
    assert int(folded) == int(explicit)


def test_folded_curve_gives_the_controller_the_same_answer():
    calibration = synthetic()
    logscores = jnp.log(jnp.asarray([0.9, 0.8, 0.5, 0.45, 0.3, 0.2, 0.1, 0.05], jnp.float32))
    bare = dataclasses.replace(calibration, t_other=0.0, t_draft={"ngram": 0.0})
    curve = cal_curve.verify_latency_curve(bare, CFG, 100, 8, bucketed=False)
    folded = cal_curve.verify_latency_curve(
        calibration, CFG, 100, 8, bucketed=False, drafter="ngram"
    )
    explicit = budget_lib.choose_budget(logscores, curve, 2.5e-4, 5e-4)
    assert int(budget_lib.choose_budget(logscores, folded, 0.0, 0.0)) == int(explicit)


def test_curve_for_uses_a_saved_calibration_and_falls_back(tmp_path, caplog):
    spec = SpecConfig(budget=8, depth=3)
    path = cal_store.save_calibration(synthetic(), tmp_path / "cal.json")
    np.testing.assert_array_equal(
        cal_curve.curve_for(CFG, spec, 50, "ngram", path=path),
        cal_curve.verify_latency_curve(synthetic(), CFG, 50, 8, drafter="ngram"),
    )
    fallback = np.asarray(cal_curve.verify_latency_curve(cal_curve.uncalibrated(CFG), CFG, 50, 8))
    np.testing.assert_array_equal(
        cal_curve.curve_for(CFG, spec, 50, path=tmp_path / "no.json"), fallback
    )
    # Corrupt, another teacher's, another machine's: the uncalibrated roofline, with a reason.
    (tmp_path / "bad.json").write_text("{")
    other_machine = dataclasses.replace(synthetic(), machine={"backend": "tpu"})
    cal_store.save_calibration(other_machine, tmp_path / "other.json")
    for name, reason in [("bad.json", "corrupt"), ("other.json", "another machine")]:
        caplog.clear()
        np.testing.assert_array_equal(
            cal_curve.curve_for(CFG, spec, 50, path=tmp_path / name), fallback
        )
        assert reason in caplog.text
    bigger = dataclasses.replace(CFG, num_layers=4)
    assert cal_curve.curve_for(bigger, spec, 50, path=path).shape == (9,)
    # A drafter without a timed cost adds nothing (and says so).
    caplog.clear()
    np.testing.assert_array_equal(
        cal_curve.curve_for(CFG, spec, 50, "eagle3", path=path),
        cal_curve.verify_latency_curve(synthetic(), CFG, 50, 8),
    )
    assert "eagle3" in caplog.text


# ----------------------------------------------------------------------------- reporting


def test_report_table_and_plot(measured, tmp_path):
    rows = cal_report.error_table(measured, CFG)
    assert len(rows) == len(SLOTS) * len(CONTEXTS)
    text = cal_report.format_report(measured, CFG)
    assert "measured ms" in text and "a_c=" in text and "t_draft[ngram]" in text
    path = cal_report.plot_calibration(measured, CFG, tmp_path / "cal.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["cal.png"]


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(plots.PlotsUnavailableError, match="plots"):
        cal_report.plot_calibration(synthetic(), CFG, tmp_path / "x.png")
    assert not os.listdir(tmp_path)


# ----------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--slots", "0,4"], "--slots"),
        (["--slots", "a,b"], "--slots"),
        (["--slots", ""], "--slots"),
        (["--contexts", "-5"], "--contexts"),
        (["--repeats", "0"], "--repeats"),
        (["--drafters", "nope"], "--drafters"),
        (["--slots", "600"], "--slots"),
        (["--slots", "64", "--contexts", "500"], "--contexts"),
        (["--out", "/no/such/folder/c.json"], "--out"),
        (["--plot", "/no/such/folder/c.png"], "--plot"),
    ],
)
def test_cli_rejects_bad_values(teacher, capsys, argv, option):
    with pytest.raises(SystemExit) as exit_info:
        cli_calibrate.main(argv, teacher=teacher)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_cli_measures_saves_and_plots(teacher, measured, tmp_path, capsys):
    out, png = tmp_path / "cal.json", tmp_path / "cal.png"
    code = cli_calibrate.main(
        [
            "--slots",
            ",".join(map(str, SLOTS)),
            "--contexts",
            ",".join(map(str, CONTEXTS)),
            "--repeats",
            "1",
            "--drafters",
            "ngram",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ],
        teacher=teacher,
    )
    assert code == 0
    saved = cal_store.load_calibration(out, config=CFG)
    assert len(saved.samples) == len(SLOTS) * len(CONTEXTS)
    # Drafting costs are keyed by method and tree shape (an EAGLE-3 head as MTP drafts
    # one node; as EAGLE-3, a tree): what `make run` and `bench` look up.
    assert set(saved.t_draft) == {"ngram:budget=8,depth=6"}
    assert png.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "error %" in printed and "max |error|" in printed
