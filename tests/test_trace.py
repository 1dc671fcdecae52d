"""The host-driven traced loop: same tokens as ``generate``, records as documented."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import trace
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, max_position=512)
NO_EOS = -7
SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "TRACE_SCHEMA.md"
# Repetitive, so the n-gram drafter finds matches and some rounds accept drafts.
PROMPT = [5, 9, 14, 3, 22, 7, 5, 9, 14, 3, 22, 7, 5, 9]


@pytest.fixture(scope="module")
def teacher():
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return gen.Teacher(CFG, params)


def _table_column(section: str) -> list[str]:
    """First-column names (in backticks) of the markdown table under ``## section``."""
    text = SCHEMA.read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", body, flags=re.MULTILINE)


def test_schema_document_matches_code():
    assert tuple(_table_column("Record fields")) == trace.TRACE_FIELDS
    assert tuple(_table_column("Phases")) == trace.PHASES


def _eagle3(teacher):
    """A random EAGLE-3 head on the tiny teacher: a drafter with state and teacher features."""
    eagle3 = pytest.importorskip("eaglepangu_jax.drafters.eagle3")
    config = eagle3.Eagle3Config.for_teacher(CFG, draft_vocab_size=CFG.vocab_size)
    head = eagle3.init_head(config, jax.random.key(8))
    params = eagle3.make_params(
        head, teacher.params["embed"], jnp.arange(CFG.vocab_size, dtype=jnp.int32)
    )
    return eagle3.Eagle3Drafter(config=config, budget=6, depth=3, top_k=3), params


@pytest.mark.parametrize("drafter_kind", ["none", "ngram", "eagle3"])
def test_traced_tokens_equal_generate_and_records_match_schema(teacher, tmp_path, drafter_kind):
    spec = SpecConfig(budget=6, depth=3, max_new_tokens=30, eos_id=NO_EOS)
    drafter, params = None, None
    if drafter_kind == "ngram":
        drafter = NGramDrafter(depth=3, budget=6, max_ngram=2)
    elif drafter_kind == "eagle3":
        drafter, params = _eagle3(teacher)
    path = tmp_path / "t.jsonl"
    expected = gen.generate(teacher, drafter, PROMPT, spec, draft_params=params)
    got = trace.generate_traced(
        teacher, drafter, PROMPT, spec, draft_params=params, trace_path=path
    )
    assert got.tokens == expected.tokens
    assert got.stats.accepted_per_round == expected.stats.accepted_per_round
    assert got.stats.nodes_per_round == expected.stats.nodes_per_round

    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == got.stats.rounds
    for i, record in enumerate(records):
        assert list(record) == list(trace.TRACE_FIELDS)
        assert list(record["seconds"]) == list(trace.PHASES)
        assert record["round"] == i
        assert record["predicted_verify_s"] is None
        assert record["budget"] == 6
        assert 0 <= record["accepted"] <= record["tree_depth"] <= 3
    assert [r["accepted"] for r in records] == list(expected.stats.accepted_per_round)
    assert [r["tree_nodes"] for r in records] == list(expected.stats.nodes_per_round)
    assert sum(r["emitted"] for r in records) == len(got.tokens) == 30
    # Committed length grows by exactly what each round emitted (before the final cut).
    for a, b in zip(records, records[1:]):
        assert b["committed_len"] == a["committed_len"] + a["accepted"] + 1
    assert records[0]["committed_len"] == len(PROMPT) - 1
    if drafter_kind == "ngram":
        assert sum(r["accepted"] for r in records) > 0, "the test should exercise acceptance"
    elif drafter_kind == "none":
        assert all(r["tree_nodes"] == 0 and r["tree_depth"] == 0 for r in records)


def test_traced_sampling_equals_generate(teacher, tmp_path):
    spec = SpecConfig(
        budget=6,
        depth=3,
        max_new_tokens=20,
        eos_id=NO_EOS,
        acceptance="sample",
        temperature=1.0,
        seed=11,
    )
    drafter = NGramDrafter(depth=3, budget=6, max_ngram=2)
    expected = gen.generate(teacher, drafter, PROMPT, spec)
    got = trace.generate_traced(teacher, drafter, PROMPT, spec, trace_path=tmp_path / "s.jsonl")
    assert got.tokens == expected.tokens


def test_eos_cut_keeps_emitted_sum(teacher, tmp_path):
    free = gen.generate(
        teacher, None, PROMPT, SpecConfig(budget=2, depth=2, max_new_tokens=12, eos_id=NO_EOS)
    )
    eos = free.tokens[5]
    spec = SpecConfig(budget=6, depth=3, max_new_tokens=12, eos_id=eos)
    drafter = NGramDrafter(depth=3, budget=6, max_ngram=2)
    path = tmp_path / "e.jsonl"
    got = trace.generate_traced(teacher, drafter, PROMPT, spec, trace_path=path)
    assert got.tokens == free.tokens[: free.tokens.index(eos) + 1]
    assert sum(r["emitted"] for r in trace.read_trace(path)) == len(got.tokens)


def test_predicted_verify_time_with_calibration(teacher, tmp_path):
    spec = SpecConfig(budget=4, depth=2, max_new_tokens=5, eos_id=NO_EOS)
    roofline = budget_lib.Roofline.for_llama(CFG, peak_flops=1e9, bandwidth=1e9)
    calib = budget_lib.Calibration(
        a_c=jnp.float32(1.0), b_c=jnp.float32(0.0), a_m=jnp.float32(2.0), b_m=jnp.float32(1e-3)
    )
    path = tmp_path / "p.jsonl"
    drafter = NGramDrafter(depth=2, budget=4)
    trace.generate_traced(
        teacher, drafter, PROMPT, spec, trace_path=path, roofline=roofline, calibration=calib
    )
    for record in trace.read_trace(path):
        want = float(
            budget_lib.latency(roofline, calib, record["verified_slots"], record["committed_len"])
        )
        assert record["predicted_verify_s"] == pytest.approx(want)
    with pytest.raises(ValueError, match="both roofline and calibration"):
        trace.generate_traced(teacher, drafter, PROMPT, spec, trace_path=path, roofline=roofline)


def test_summarize_by_hand(tmp_path):
    def record(i, accepted, emitted, verify):
        seconds = {p: 0.001 for p in trace.PHASES} | {"verify": verify}
        return {
            "round": i,
            "committed_len": 10 + i,
            "tree_nodes": 4,
            "tree_depth": 2,
            "verified_slots": 5,
            "budget": 4,
            "accepted": accepted,
            "emitted": emitted,
            "seconds": seconds,
            "predicted_verify_s": None,
        }

    path = tmp_path / "h.jsonl"
    trace.write_jsonl_atomic(
        path, [record(0, 2, 3, 0.5), record(1, 0, 1, 0.25), record(2, 2, 2, 0.25)]
    )
    summary = trace.summarize(path)
    assert summary.rounds == 3 and summary.new_tokens == 6
    assert summary.accepted_length == 2.0
    assert summary.accepted_histogram == {0: 1, 2: 2}
    assert summary.phase_seconds["verify"] == pytest.approx(1.0)
    assert summary.phase_seconds["draft"] == pytest.approx(0.003)
    assert list(summary.phase_seconds) == list(trace.PHASES)
    text = summary.to_text()
    assert "verify" in text and "accepted length 2.00" in text


def test_read_trace_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"round": 0}\n')
    with pytest.raises(ValueError, match="line 1: expected the fields"):
        trace.read_trace(path)
    path.write_text("\nnot json\n")
    with pytest.raises(ValueError, match="line 2: invalid JSON"):
        trace.summarize(path)


def test_missing_trace_folder_fails_before_work(teacher, tmp_path):
    spec = SpecConfig(budget=4, depth=2, max_new_tokens=5)
    with pytest.raises(ValueError, match="folder does not exist"):
        trace.generate_traced(teacher, None, PROMPT, spec, trace_path=tmp_path / "nope" / "t.jsonl")


@pytest.mark.parametrize("sizes, one_node_slots", [(None, 2), ((1, 4), 4)])
def test_a_one_node_round_verifies_at_the_specs_smallest_fitting_bucket(
    teacher, tmp_path, sizes, one_node_slots
):
    """Under the default sizes a round that verifies one drafted node runs a 2-slot forward;
    without the 2-slot size it pays for 4. The tokens are the same either way."""
    spec = SpecConfig(
        budget=8, depth=1, policy="drafter", max_new_tokens=16, eos_id=NO_EOS, slot_buckets=sizes
    )
    drafter = NGramDrafter(depth=1, budget=8, max_ngram=2)
    plain = gen.generate(teacher, None, PROMPT, SpecConfig(max_new_tokens=16, eos_id=NO_EOS))
    fused = gen.generate(teacher, drafter, PROMPT, spec)
    path = tmp_path / "b.jsonl"
    traced = trace.generate_traced(teacher, drafter, PROMPT, spec, trace_path=path)
    assert fused.tokens == traced.tokens == plain.tokens
    records = trace.read_trace(path)
    one_node = [r["verified_slots"] for r in records if r["tree_nodes"] == 1]
    assert one_node and set(one_node) == {one_node_slots}, records
    assert {r["verified_slots"] for r in records if r["tree_nodes"] == 0} <= {1}
