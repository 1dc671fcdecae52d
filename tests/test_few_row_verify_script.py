"""``bench/few_row_verify.py``: the engine's verify with and without the few-row kernel."""

from __future__ import annotations

import jax
import pytest
from conftest import load_bench_script, refusal

from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params


@pytest.fixture(scope="module")
def script():
    return load_bench_script("few_row_verify")


def test_each_slot_count_gets_a_median(script):
    cfg = LlamaConfig.tiny(max_position=256)
    teacher = gen.Teacher(cfg, random_params(cfg, jax.random.key(0)))
    medians = script.time_verify(teacher, [1, 2, 4], context=20, passes=3)
    assert set(medians) == {1, 2, 4} and all(t > 0 for t in medians.values())


@pytest.mark.parametrize(
    "bad, named",
    [
        (["--slots", "0,2"], "--slots"),
        (["--slots", "2,2"], "--slots"),
        (["--slots", "a"], "--slots"),
        (["--passes", "0"], "--passes"),
        (["--rounds", "0"], "--rounds"),
        (["--settings", "xla,sse"], "--settings"),
        (["--settings", "xla,xla"], "--settings"),
    ],
)
def test_bad_arguments_are_refused_by_name(script, tmp_path, capsys, bad, named):
    assert named in refusal(script, bad, tmp_path, capsys)


def test_each_setting_names_a_value_of_the_kernels_switch(script):
    from eaglepangu_jax.models import few_row

    assert script.SETTINGS["xla"] == "0" and script.SETTINGS["kernel"] is None
    # every instruction set the kernel is built for can be asked for by name
    assert set(few_row.INSTRUCTION_SETS) <= set(script.SETTINGS)
    assert script.setting_list("avx2, xla") == ["avx2", "xla"]
