"""``bench/block_heads.py``: block exports run beside the shipped head in the engine, each
with its own stored temperatures; a checkpoint it cannot run is refused by name."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
from conftest import load_bench_script, refusal

SHIPPED = Path(__file__).resolve().parents[1] / "eaglepangu_jax" / "weights" / "block_smollm2"


@pytest.fixture(scope="module")
def script():
    return load_bench_script("block_heads")


def test_a_checkpoint_that_is_no_block_head_is_refused(script, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.with_suffix(".json").write_text("{not json")
    assert f"--checkpoint {bad}" in refusal(script, ["--checkpoint", str(bad)], tmp_path, capsys)


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


def test_a_head_with_another_block_size_is_refused_naming_both(script, tmp_path, capsys):
    """A deeper or wider head runs beside the shipped one; one that drafts another tree depth
    (another block size) is refused, the message naming its shape and the shipped one's."""
    from eaglepangu_jax.drafters import checkpoint as checkpoint_lib
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint

    config, head, d2t, _, _ = checkpoint_lib.load_checkpoint(SHIPPED, fingerprint=None)
    shorter = tmp_path / "four_slots"
    four = dataclasses.replace(config, block_size=4)
    checkpoint_lib.save_checkpoint(shorter, head, four, d2t, fingerprint=teacher_fingerprint())
    err = refusal(script, ["--checkpoint", str(shorter)], tmp_path, capsys)
    assert f"--checkpoint {shorter}" in err
    assert "blocks of 4" in err and f"with {config.block_size}" in err


def test_under_the_controller_a_head_is_named_by_its_shape(script):
    """The calibration keeps drafting costs by method name: under ``--policy auto`` a head of
    another depth gets another name (so another measured cost), one of the same shape the
    same; every-round runs keep the plain ``block#I``."""
    from eaglepangu_jax.drafters import checkpoint as checkpoint_lib

    config, *_ = checkpoint_lib.load_checkpoint(SHIPPED, fingerprint=None)
    deeper = dataclasses.replace(config, num_layers=config.num_layers + 1)
    assert script.method_name(0, config, "best_first") == "block#0"
    same = script.method_name(0, config, "auto")
    assert same.startswith("block#0-") and same == script.method_name(0, config, "auto")
    assert script.method_name(0, deeper, "auto") != same


def test_a_negative_conversation_count_is_refused(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(
            ["--per-category", "-1", "--checkpoint", str(SHIPPED), "--json", str(tmp_path / "r")]
        )
    assert exc.value.code == 2 and "--per-category must be >= 0" in capsys.readouterr().err


def _methods(script, budget):
    args = argparse.Namespace(
        budget=budget, policy="best_first", max_new_tokens=16, checkpoint=[str(SHIPPED)]
    )
    return script.head_methods(argparse.ArgumentParser(), args)


def test_budget_auto_runs_every_head_at_the_shipped_default_tree(script):
    """``--budget auto``: the shipped head and each checkpoint draft the tree a user gets by
    default (one node, one level deep), a number keeps the depth the drafter comes with."""
    from eaglepangu_jax.methods.registry import DRAFTER_BUDGETS

    nodes = DRAFTER_BUDGETS["block"]
    greedy, shipped, ours = _methods(script, "auto")
    assert greedy.drafter is None
    for method in (shipped, ours):
        assert (method.spec.budget, method.spec.depth) == (nodes, nodes)
        assert method.drafter.depth == nodes
    _, shipped8, ours8 = _methods(script, 8)
    assert shipped8.spec.budget == ours8.spec.budget == 8
    assert shipped8.drafter.depth == ours8.drafter.depth > nodes


def test_a_budget_below_one_is_refused(script, tmp_path, capsys):
    err = refusal(script, ["--budget", "0", "--checkpoint", str(SHIPPED)], tmp_path, capsys)
    assert "--budget" in err


EAGLE3 = SHIPPED.with_name("eagle3_smollm2")


def test_eagle3_exports_run_beside_the_shipped_eagle3_head(script):
    """``--kind eagle3``: the shipped EAGLE-3 head and each export, at the shipped default
    tree, each with the temperature its own export stores."""
    from eaglepangu_jax.drafters import checkpoint as checkpoint_lib
    from eaglepangu_jax.methods.registry import DRAFTER_BUDGETS

    args = argparse.Namespace(
        budget="auto", policy="auto", max_new_tokens=16, checkpoint=[str(EAGLE3)], kind="eagle3"
    )
    greedy, shipped, ours = script.head_methods(argparse.ArgumentParser(), args)
    assert greedy.drafter is None and shipped.name == "eagle3"
    config, *_ = checkpoint_lib.load_checkpoint(EAGLE3, fingerprint=None)
    assert ours.name == script.method_name(0, config, "auto", "eagle3")
    assert ours.name.startswith("eagle3#0-")
    nodes = DRAFTER_BUDGETS["eagle3"]
    assert ours.spec.budget == shipped.spec.budget == nodes
    assert ours.drafter.tree_levels == shipped.drafter.tree_levels
    np_temperature = ours.draft_params["depth_temperature"]
    assert float(np_temperature[0]) == float(shipped.draft_params["depth_temperature"][0])


def test_an_eagle3_head_tapping_other_layers_is_refused_naming_both(script, tmp_path, capsys):
    from eaglepangu_jax.drafters import checkpoint as checkpoint_lib
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint

    config, head, d2t, _, _ = checkpoint_lib.load_checkpoint(EAGLE3, fingerprint=None)
    other = dataclasses.replace(config, feature_layers=(1, 14, 26))
    path = tmp_path / "other_taps"
    checkpoint_lib.save_checkpoint(path, head, other, d2t, fingerprint=teacher_fingerprint())
    err = refusal(script, ["--kind", "eagle3", "--checkpoint", str(path)], tmp_path, capsys)
    assert f"--checkpoint {path}" in err
    assert "(1, 14, 26)" in err and str(config.feature_layers) in err
