"""``bench/matmul_rows.py``: the teacher's weight products timed at several row counts."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script, refusal


@pytest.fixture(scope="module")
def script():
    return load_bench_script("matmul_rows")


def test_one_layer_at_two_row_counts_writes_its_report(script, tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["--rows", "1,3", "--repeats", "2", "--layers", "1", "--json", str(out)]
    assert script.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["layers"] == 1 and report["repeats"] == 2
    assert set(report["rows"]) == {"1", "3"}
    one, three = report["rows"]["1"], report["rows"]["3"]
    assert one["vs_one_row"] == 1.0 and len(three["times_ms"]) == 2
    assert three["vs_one_row"] == pytest.approx(three["median_ms"] / one["median_ms"])
    # One layer of SmolLM2's shapes plus its tied lm_head, float32.
    assert report["weight_bytes"] == 4 * (
        2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 576 * 49152
    )
    assert "x 1 row" in capsys.readouterr().out and "transposed" not in report


def test_the_transposed_layout_is_timed_beside_the_teachers(script, tmp_path):
    out = tmp_path / "rows.json"
    argv = ["--rows", "1,2", "--repeats", "1", "--layers", "1", "--transposed"]
    assert script.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["rows"]) == set(report["transposed"]) == {"1", "2"}
    assert report["transposed"]["1"]["vs_one_row"] == 1.0


def test_fused_products_are_timed_beside_both_layouts(script, tmp_path):
    out = tmp_path / "rows.json"
    argv = ["--rows", "1,2", "--repeats", "1", "--layers", "1", "--transposed", "--fused"]
    assert script.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for name in ("rows", "transposed", "fused", "fused_transposed"):
        assert set(report[name]) == {"1", "2"} and report[name]["1"]["vs_one_row"] == 1.0


def test_the_few_row_kernel_is_timed_beside_xla(script, tmp_path):
    import os

    from eaglepangu_jax.models import few_row

    if not few_row.available():
        pytest.skip(f"kernel unavailable: {few_row.unavailable_reason()}")
    out = tmp_path / "rows.json"
    argv = ["--rows", "1,2", "--repeats", "1", "--layers", "1", "--few-row"]
    switch = os.environ.get(few_row.ENV_SWITCH)
    assert script.main([*argv, "--json", str(out)]) == 0
    assert os.environ.get(few_row.ENV_SWITCH) == switch  # the AVX2 variant's setting undone
    report = json.loads(out.read_text())
    assert set(report["rows"]) == set(report["few_row"]) == {"1", "2"}
    # an AVX-512 machine also times the build a machine without AVX-512 gets
    both = few_row.instruction_set() == "avx512" and "avx2" in few_row.usable_instruction_sets()
    assert ("few_row_avx2" in report) is both


def test_the_few_row_kernel_takes_at_most_16_rows(script, tmp_path, capsys):
    assert "--few-row" in refusal(script, ["--rows", "1,17", "--few-row"], tmp_path, capsys)


@pytest.mark.parametrize("bad", [["--rows", "0"], ["--rows", "a,b"], ["--layers", "0"]])
def test_bad_arguments_are_refused_by_name(script, tmp_path, bad, capsys):
    assert "--rows" in refusal(script, bad, tmp_path, capsys)
