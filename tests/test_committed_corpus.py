"""The corpora committed in the package (the synthesised one; the answers to the written
training conversations; corpus-h200, the synthesised corpus's first 30 shards as a GPU
machine with Python 3.12 remade them, on which the shipped EAGLE-3 head was last trained; and
corpus-seed1, synthesised the same way from seed 1): every
shard the manifest lists is on disk with the recorded sha256 and counts, the totals and the
held-out split follow the plan, they were answered by the shipped teacher, and no prompt quotes
an evaluation suite."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types

import pytest

from eaglepangu_jax.cli.corpus import DEFAULT_DIR, WRITTEN_DIR
from eaglepangu_jax.cli.train import _corpus_shards
from eaglepangu_jax.evaluation.suites import evaluation_texts, written_prompts
from eaglepangu_jax.files import sha256_file
from eaglepangu_jax.training import corpus as corpus_lib
from eaglepangu_jax.training import distill, synth

H200_DIR = DEFAULT_DIR.parent / "corpus-h200"
SEED1_DIR = DEFAULT_DIR.parent / "corpus-seed1"
ALL = pytest.mark.parametrize(
    "directory",
    [DEFAULT_DIR, WRITTEN_DIR, H200_DIR, SEED1_DIR],
    ids=["synthesised", "written", "h200", "seed1"],
)
# The corpora whose prompts the teacher synthesised, with the fewest prompts each holds (so
# the checks below cannot pass on an empty corpus).
SYNTHESISED = pytest.mark.parametrize(
    "directory, least", [(DEFAULT_DIR, 2_000), (SEED1_DIR, 500)], ids=["synthesised", "seed1"]
)


@functools.cache
def _corpus(directory):
    """The manifest in ``directory`` and every shard it lists, each checked by its own hash."""
    manifest = distill.read_manifest(directory)
    loaded = []
    for entry in manifest["shards"]:
        shard = corpus_lib.load_corpus_shard(directory / "answers", entry["key"])
        assert shard is not None, f"shard {entry['key']} is missing or fails its own hash"
        loaded.append(shard)
    return manifest, loaded


@pytest.fixture(scope="module")
def manifest():
    return _corpus(DEFAULT_DIR)[0]


@pytest.fixture(scope="module")
def shards():
    return _corpus(DEFAULT_DIR)[1]


@pytest.fixture(scope="module")
def written():
    return _corpus(WRITTEN_DIR)


@ALL
def test_every_listed_shard_has_the_manifests_hash_and_counts(directory):
    manifest, shards = _corpus(directory)
    for entry, shard in zip(manifest["shards"], shards, strict=True):
        # The manifest's hash, recomputed from the file (not only the shard's own meta).
        assert sha256_file(directory / "answers" / f"{entry['key']}.safetensors") == entry["sha256"]
        assert len(shard) == entry["sequences"]
        assert shard.prompt_tokens == entry["prompt_tokens"]
        assert shard.answer_tokens == entry["answer_tokens"]
        assert all(len(a) >= 1 for a in shard.answers())


@ALL
def test_the_package_ships_only_the_listed_shards(directory):
    # A corpus rebuilt over more prompts leaves its superseded shards behind; shipping them
    # would only make the package larger.
    manifest, _ = _corpus(directory)
    listed = {
        f"{e['key']}{suffix}" for e in manifest["shards"] for suffix in (".json", ".safetensors")
    }
    assert sorted(p.name for p in (directory / "answers").iterdir()) == sorted(listed)


@SYNTHESISED
def test_totals_and_split_follow_the_plan(directory, least):
    manifest = _corpus(directory)[0]
    plan = distill.CorpusPlan(
        **{
            k: v
            for k, v in manifest["plan"].items()
            if k in {f.name for f in dataclasses.fields(distill.CorpusPlan)}
            and not isinstance(v, dict)
        }
    )
    entries = manifest["shards"]
    assert [e["split"] for e in entries] == [
        "heldout" if plan.held_out(i) else "train" for i in range(len(entries))
    ]
    for split, totals in manifest["totals"].items():
        mine = [e for e in entries if e["split"] == split]
        assert totals["shards"] == len(mine)
        for field in ("sequences", "prompt_tokens", "answer_tokens"):
            assert totals[field] == sum(e[field] for e in mine)
    assert len({e["key"] for e in entries}) == len(entries)
    assert sum(e["sequences"] for e in entries) >= least


def test_written_corpus_answers_every_written_turn_in_order(written):
    # Turn by turn, in shards: all first turns (in the file's order), then all second turns;
    # each prompt is the chat template over the conversation so far, every shard for training.
    from eaglepangu_jax.models.chat import encode_chat
    from eaglepangu_jax.runtime import load_renderer

    manifest, shards = written
    conversations = written_prompts()
    turns = [len(c.turns) for c in conversations]
    assert manifest["plan"]["source"] == "written"
    assert manifest["plan"]["conversations"] == len(conversations)
    assert manifest["plan"]["turns"] == sum(turns)
    assert {e["split"] for e in manifest["shards"]} == {"train"}
    assert manifest["totals"]["train"]["sequences"] == sum(turns)
    tokenizer = load_renderer().tokenizer
    prompts = [p for shard in shards for p in shard.prompts()]
    first = [
        encode_chat(tokenizer, [{"role": "user", "content": c.turns[0]}]) for c in conversations
    ]
    assert prompts[: len(conversations)] == first
    # A second-turn prompt carries the first turn and the teacher's answer to it.
    answers = [a for shard in shards for a in shard.answers()]
    two = [i for i, c in enumerate(conversations) if len(c.turns) > 1]
    second = encode_chat(
        tokenizer,
        [
            {"role": "user", "content": conversations[two[0]].turns[0]},
            {
                "role": "assistant",
                "content": tokenizer.decode(answers[two[0]], skip_special_tokens=True),
            },
            {"role": "user", "content": conversations[two[0]].turns[1]},
        ],
    )
    assert prompts[len(conversations)] == second


@pytest.mark.slow
@ALL
def test_answered_by_the_shipped_teacher(directory):
    from eaglepangu_jax.models.smollm2 import teacher_fingerprint

    assert distill.read_manifest(directory)["teacher"] == teacher_fingerprint()


@SYNTHESISED
def test_no_prompt_quotes_an_evaluation_suite(directory, least):
    from eaglepangu_jax.runtime import load_renderer

    shards = _corpus(directory)[1]
    tokenizer = load_renderer().tokenizer
    guard = synth.EvalGuard.from_texts(evaluation_texts())
    prompts = [p for shard in shards for p in shard.prompts()]
    quoting = [
        text
        for text in (tokenizer.decode(p, skip_special_tokens=True) for p in prompts)
        if guard.overlaps(text)
    ]
    assert len(prompts) >= least and not quoting, quoting[:3]


def test_train_draft_reads_only_the_first_training_shards_it_is_given(manifest, shards):
    # `train-draft --corpus D --train-shards N`: the first N training shards in manifest
    # order, every held-out shard, and none of the rest (ids only here: no teacher runs).
    parser = argparse.ArgumentParser(prog="train-draft")
    teacher = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=8))
    train, held = _corpus_shards(
        parser, teacher, DEFAULT_DIR, (), manifest["teacher"], None, train_shards=2
    )
    splits = [entry["split"] for entry in manifest["shards"]]
    want_train = [s for s, split in zip(shards, splits) if split == "train"][:2]
    want_held = [s for s, split in zip(shards, splits) if split == "heldout"]
    assert [len(s.offsets) - 1 for s in train] == [len(s) for s in want_train]
    assert [len(s.offsets) - 1 for s in held] == [len(s) for s in want_held]
    for got, want in zip(train + held, want_train + want_held):
        first = [*want.prompts()[0], *want.answers()[0]]
        assert got.tokens[: len(first)].tolist() == first
    with pytest.raises(SystemExit):
        _corpus_shards(
            parser, teacher, DEFAULT_DIR, (), manifest["teacher"], None, train_shards=10**6
        )
