"""``bench/eagle3_pieces.py``: the EAGLE-3 head's drafting timed piece by piece."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script


@pytest.fixture(scope="module")
def script():
    return load_bench_script("eagle3_pieces")


@pytest.mark.parametrize(
    "argv", [["--repeats", "0"], ["--committed", "0"], ["--capacity", "64", "--committed", "64"]]
)
def test_settings_it_cannot_time_are_refused(script, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(argv)
    assert exc.value.code == 2 and "--committed < --capacity" in capsys.readouterr().err


@pytest.mark.slow  # the real teacher and head, a dozen compilations
def test_every_piece_is_timed(script, tmp_path):
    out = tmp_path / "pieces.json"
    assert (
        script.main(["--repeats", "2", "--capacity", "64", "--committed", "20", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    ms = report["milliseconds"]
    assert {"update", "propose_budget_3", "update_and_propose_budget_8"} <= set(ms)
    assert all(v > 0 for v in ms.values()) and report["capacity"] == 64
