"""``bench/block_heads.py``: block exports run beside the shipped head in the engine, each
with its own stored temperatures; a checkpoint it cannot run is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_bench_script

SHIPPED = Path(__file__).resolve().parents[1] / "eaglepangu_jax" / "weights" / "block_smollm2"


@pytest.fixture(scope="module")
def script():
    return load_bench_script("block_heads")


def test_a_checkpoint_that_is_no_block_head_is_refused(script, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.with_suffix(".json").write_text("{not json")
    with pytest.raises(SystemExit) as exc:
        script.main(["--checkpoint", str(bad), "--json", str(tmp_path / "r.json")])
    assert exc.value.code == 2 and f"--checkpoint {bad}" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow  # the real teacher and the block drafter in the engine: about a minute
def test_the_shipped_export_as_a_checkpoint_runs_like_the_shipped_head(script, tmp_path):
    out = tmp_path / "r.json"
    argv = ["--suite", "humaneval", "--max-new-tokens", "12", "--checkpoint", str(SHIPPED)]
    assert script.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["block_heads"]["checkpoints"] == [str(SHIPPED)]
    summary = report["summary"]
    assert set(summary) == {"greedy", "block", "block#0"}
    for name in ("block", "block#0"):
        assert summary[name]["identical_fraction"] == 1.0
    # The same weights and temperatures through the script's loading: the same trees.
    assert (
        summary["block"]["overall_accepted_length"] == summary["block#0"]["overall_accepted_length"]
    )
