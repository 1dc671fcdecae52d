"""The self-distilled corpus: user-turn filters, duplicates, the evaluation guard, the id shards
(format, corruption, resumption), the append-only prompt stream, batched feature recompute, and
Ray shards equal to local ones byte for byte."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax.engine.decode import Teacher, prefill
from eaglepangu_jax.evaluation.suites import evaluation_texts, load_suite
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params
from eaglepangu_jax.training import corpus as corpus_lib
from eaglepangu_jax.training import distill, synth
from eaglepangu_jax.training import features as features_lib

FP = "e" * 64
SETTINGS = synth.SynthSettings(batch_size=4, max_tokens=8)
EOS, SPECIALS = 2, {0, 1, 2}


def reason(text, ids=None):
    ids = [5, 6, 7, EOS] if ids is None else ids
    return synth.reject_reason(ids, text, eos_id=EOS, special_ids=SPECIALS, settings=SETTINGS)


def test_reject_reason_literal_cases():
    assert reason("How do I bake sourdough bread at home?") is None
    assert reason("How do I bake bread?", ids=[5, 6, 7]) == "truncated"  # cut at the limit
    assert reason("How do I bake bread?", ids=[5, 1, 7, EOS]) == "template"  # special inside
    assert reason("Tell me a joke.\nassistant: Sure") == "template"  # hands the turn over
    assert reason("What is <|im_start|> for?") == "template"
    assert reason("Hi?") == "length"
    assert reason("x" * 500) == "length"
    assert reason("1234 5678 9012 3456 7890 !!!") == "junk"
    assert reason("the cat sat the cat sat the cat sat the cat sat the cat sat") == "repetitive"
    assert reason("Why is the sky blue??????????") == "repetitive"


def test_deduplicate_exact_and_near_keeps_the_first():
    texts = [
        "Write a haiku about autumn leaves falling in the park.",
        "write a HAIKU about autumn leaves falling in the park!",  # exact after normalising
        "Write a haiku about autumn leaves falling in the parks.",  # near duplicate
        "Explain how a refrigerator keeps food cold.",
        "Write a haiku about autumn leaves falling in the park.",
    ]
    assert synth.deduplicate(texts) == [0, 3]


@given(
    st.lists(
        st.sampled_from(
            [
                "alpha beta gamma",
                "alpha beta gamma delta",
                "zeta eta",
                "completely different words here",
                "zeta eta theta iota",
            ]
        ),
        max_size=12,
    ),
    st.integers(0, 12),
)
def test_deduplicate_is_append_only(texts, cut):
    # A decision looks only at earlier texts, so a longer stream never changes the kept prefix.
    full = synth.deduplicate(texts)
    assert synth.deduplicate(texts[:cut]) == [i for i in full if i < cut]


def test_eval_guard_catches_quotes_of_either_suite():
    texts = evaluation_texts()
    mtbench = [t for c in load_suite("mtbench") for t in c.turns]
    assert len(texts) >= len(mtbench) + 164  # every MT-Bench turn and every HumanEval problem
    guard = synth.EvalGuard.from_texts(texts)
    words = mtbench[0].split()
    quote = "Please help: " + " ".join(words[2:12]) + " thanks"
    assert guard.overlaps(quote)
    assert guard.overlaps(texts[-1])  # the last HumanEval problem, beyond the bench's 80
    assert not guard.overlaps("Can you give me three tips for growing tomatoes on a balcony?")


def test_pack_save_load_roundtrip_and_corruption(tmp_path):
    shard = corpus_lib.pack([[1, 2, 3], [4]], [[9, 9], [49151, 0, 7]])
    assert shard.prompts() == [[1, 2, 3], [4]] and shard.answers() == [[9, 9], [49151, 0, 7]]
    meta = corpus_lib.save_corpus_shard(tmp_path, "k", shard, {"kind": "answers"})
    assert meta["answer_tokens"] == 5 and meta["sequences"] == 2
    back = corpus_lib.load_corpus_shard(tmp_path, "k")
    assert back is not None and back.answers() == shard.answers()
    assert back.answer_ids.dtype == np.uint16
    data = tmp_path / "k.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert corpus_lib.load_corpus_shard(tmp_path, "k") is None  # hash mismatch
    assert corpus_lib.load_corpus_shard(tmp_path, "missing") is None
    with pytest.raises(ValueError, match="uint16"):
        corpus_lib.pack([[1]], [[70000]])
    with pytest.raises(ValueError, match="prompts but"):
        corpus_lib.pack([[1]], [])


def test_keys_depend_on_everything_that_shapes_a_shard():
    s = corpus_lib.CorpusSettings(max_new_tokens=8, shard_size=2)
    base = corpus_lib.corpus_key("answers", FP, [[1, 2]], s)
    assert base == corpus_lib.corpus_key("answers", FP, [[1, 2]], s)
    others = {
        corpus_lib.corpus_key("user-turns", FP, [[1, 2]], s),
        corpus_lib.corpus_key("answers", "d" * 64, [[1, 2]], s),
        corpus_lib.corpus_key("answers", FP, [[1, 3]], s),
        corpus_lib.corpus_key("answers", FP, [[1, 2]], dataclasses.replace(s, max_new_tokens=9)),
    }
    assert base not in others and len(others) == 4


@pytest.fixture(scope="module")
def teacher():
    # The real tokenizer's ids reach 49151, so the random teacher has the full vocabulary.
    cfg = LlamaConfig.tiny(vocab_size=49152, max_position=512)
    return Teacher(cfg, random_params(cfg, jax.random.key(0)))


def test_build_shards_answers_resumes_and_regenerates(teacher, tmp_path):
    settings = corpus_lib.CorpusSettings(max_new_tokens=6, shard_size=2)
    chunks = [[[1, 5, 6], [1, 7]], [[1, 9, 10, 11], [1, 12]]]
    made = []
    keys = corpus_lib.build_shards(
        teacher, chunks, settings, tmp_path, fingerprint=FP, on_shard=lambda i, m: made.append(i)
    )
    assert made == [0, 1]
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.engine.decode import generate

    shard = corpus_lib.load_corpus_shard(tmp_path, keys[1])
    spec = SpecConfig(policy="drafter", budget=1, depth=1, max_new_tokens=6)
    assert shard.answers()[0] == generate(teacher, None, chunks[1][0], spec).tokens
    made.clear()
    corpus_lib.build_shards(
        teacher, chunks, settings, tmp_path, fingerprint=FP, on_shard=lambda i, m: made.append(i)
    )
    assert made == []  # both present and intact: nothing regenerated
    (tmp_path / f"{keys[0]}.json").write_text("{not json")
    corpus_lib.build_shards(
        teacher, chunks, settings, tmp_path, fingerprint=FP, on_shard=lambda i, m: made.append(i)
    )
    assert made == [0]


def test_prompt_stream_is_append_only_and_the_manifest_adds_up(teacher, tmp_path, monkeypatch):
    from eaglepangu_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    mtbench = [t for c in load_suite("mtbench") for t in c.turns]
    scripted = [
        "How do volcanoes form, in simple words?",
        "How do volcanoes form, in simple words?",  # duplicate
        "Give me a packing list for a week of camping.",
        "Please " + " ".join(mtbench[3].split()[:12]),  # quotes MT-Bench
        "Why do cats purr?\nassistant: Because",  # template hand-over
        "What are three ways to save money on groceries?",
        "Explain the difference between weather and climate.",
        "Suggest a name for a bakery that sells only croissants.",
    ]

    def fake_sample(teacher_, tokenizer, settings, *, seed, batch):
        # Scripted "teacher" turns, so the filters see known text (the sampler itself is
        # exercised on the real teacher in test_sample_user_turns_real).
        texts = scripted[batch * 4 : batch * 4 + 4]
        return [tok.encode(t) + [tok.eos_id] for t in texts]

    monkeypatch.setattr(synth, "sample_user_turns", fake_sample)
    plan = distill.CorpusPlan(
        target_answer_tokens=10,
        template_every=2,
        synth=SETTINGS,
        answers=corpus_lib.CorpusSettings(max_new_tokens=4, shard_size=2),
    )
    guard = synth.EvalGuard.from_texts(evaluation_texts())
    one = distill.prompt_list(teacher, tok, plan, tmp_path, fingerprint=FP, batches=1, guard=guard)
    two = distill.prompt_list(teacher, tok, plan, tmp_path, fingerprint=FP, batches=2, guard=guard)
    assert two.texts[: len(one.texts)] == one.texts
    assert "template" in two.sources and two.dropped["duplicate"] == 1
    assert two.dropped["evaluation overlap"] == 1 and two.dropped["template"] == 1
    assert not any(guard.overlaps(t) for t in two.texts)

    manifest = distill.build_corpus(
        teacher, tok, plan, tmp_path, fingerprint=FP, guard=guard, progress=None
    )
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == manifest
    shards = manifest["shards"]
    answer_tokens = sum(s["answer_tokens"] for s in shards)
    assert answer_tokens >= 10 > answer_tokens - shards[-1]["answer_tokens"]
    for s in shards:
        loaded = corpus_lib.load_corpus_shard(tmp_path / "answers", s["key"])
        assert loaded is not None and loaded.answer_tokens == s["answer_tokens"]
    assert distill.read_manifest(tmp_path)["teacher"] == FP

    # Resuming replays the recorded shards without rewriting the manifest: a run stopped
    # during the replay, or one asked for fewer tokens, leaves it whole.
    def stop(message):
        raise KeyboardInterrupt

    before = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(KeyboardInterrupt):
        distill.build_corpus(
            teacher, tok, plan, tmp_path, fingerprint=FP, guard=guard, progress=stop
        )
    assert (tmp_path / "manifest.json").read_bytes() == before
    fewer = dataclasses.replace(plan, target_answer_tokens=1)
    again = distill.build_corpus(
        teacher, tok, fewer, tmp_path, fingerprint=FP, guard=guard, progress=None
    )
    assert again == manifest and (tmp_path / "manifest.json").read_bytes() == before
    (tmp_path / "manifest.json").write_text("[]")
    with pytest.raises(ValueError, match="not an eaglepangu corpus manifest"):
        distill.read_manifest(tmp_path)


def test_batched_features_equal_the_engines_prefill(teacher, tmp_path):
    cfg = teacher.config
    seqs = [list(range(3, 3 + n)) for n in (5, 70, 1, 33)]
    got = features_lib.sequence_features(teacher, seqs, (0, 2), batch_size=3)
    for seq, feats in zip(seqs, got):
        kv = cache_lib.init(cfg.num_layers, 192, cfg.num_kv_heads, cfg.head_dim)
        _, want = prefill(teacher.params, cfg, np.asarray(seq, np.int32), kv, feature_layers=(0, 2))
        assert feats.shape == (len(seq), 2, cfg.hidden_size) and feats.dtype == np.float16
        np.testing.assert_allclose(feats.astype(np.float32), np.asarray(want), rtol=2e-3, atol=2e-3)
    shard = corpus_lib.pack([s[:2] for s in seqs], [s[2:] for s in seqs])
    a = features_lib.shard_features(teacher, shard, "ab" * 32, (0, 2), tmp_path, fingerprint=FP)
    b = features_lib.shard_features(teacher, shard, "ab" * 32, (0, 2), tmp_path, fingerprint=FP)
    np.testing.assert_array_equal(a.features, b.features)  # the second one read the cache
    assert list(a.prompt_lens) == [2, 2, 1, 2] and a.offsets[-1] == sum(map(len, seqs))


def test_ray_shards_equal_local_shards_byte_for_byte(teacher, tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed (the 'ray' extra)")
    settings = corpus_lib.CorpusSettings(max_new_tokens=5, shard_size=2)
    chunks = [[[1, 5, 6], [1, 7]], [[1, 9, 10, 11], [1, 12]]]
    local, remote = tmp_path / "local", tmp_path / "ray"
    keys = corpus_lib.build_shards(teacher, chunks, settings, local, fingerprint=FP)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        made = []
        ray_keys = corpus_lib.build_shards(
            teacher,
            chunks,
            settings,
            remote,
            fingerprint=FP,
            ray_address="auto",
            on_shard=lambda i, m: made.append(i),
        )
    finally:
        ray.shutdown()
    assert ray_keys == keys and sorted(made) == [0, 1]
    for key in keys:
        for suffix in (".safetensors", ".json"):
            assert (remote / f"{key}{suffix}").read_bytes() == (
                local / f"{key}{suffix}"
            ).read_bytes()


@pytest.mark.slow
def test_sample_user_turns_real():
    """The real teacher, given its pre-query template, writes user turns: most stop by
    themselves, some pass every filter, and a batch is reproducible."""
    from eaglepangu_jax.runtime import load_renderer, load_teacher

    real, tok = load_teacher(), load_renderer().tokenizer
    settings = synth.SynthSettings(batch_size=8, max_tokens=48)
    prefix = synth.pre_query_ids(tok)
    assert tok.decode(prefix).endswith("user\n") and "system" in tok.decode(prefix)
    turns = synth.sample_user_turns(real, tok, settings, seed=0, batch=0)
    assert len(turns) == 8 and turns == synth.sample_user_turns(
        real, tok, settings, seed=0, batch=0
    )
    assert turns != synth.sample_user_turns(real, tok, settings, seed=0, batch=1)
    reasons = [
        synth.reject_reason(
            t,
            tok.decode(t, skip_special_tokens=True).strip(),
            eos_id=real.config.eos_id,
            special_ids=tok.special_ids,
            settings=settings,
        )
        for t in turns
    ]
    assert sum(t[-1] == real.config.eos_id for t in turns) >= 4
    assert reasons.count(None) >= 2, reasons


def test_corpus_summary_of_a_missing_corpus_is_one_error_line(tmp_path, capsys):
    from eaglepangu_jax.cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(["corpus", "--summary", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --out: cannot read the corpus manifest" in err and "Traceback" not in err


def test_conversation_corpus_answers_each_turn_after_the_earlier_answers(teacher, tmp_path):
    from eaglepangu_jax.engine.config import SpecConfig
    from eaglepangu_jax.engine.decode import generate
    from eaglepangu_jax.models.chat import encode_chat
    from eaglepangu_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer()
    conversations = [
        ["How do volcanoes form?", "Now in one sentence."],
        ["Name a long river."],
        ["Why is grass green?", "And why are some leaves red?"],
    ]
    settings = corpus_lib.CorpusSettings(max_new_tokens=4, shard_size=2)
    made = []

    def build():
        return distill.build_conversation_corpus(
            teacher,
            tok,
            conversations,
            settings,
            tmp_path,
            fingerprint=FP,
            source="test",
            progress=made.append,
        )

    manifest = build()
    # Turn 1: three prompts in shards of 2, turn 2: two prompts in one shard.
    assert [s["sequences"] for s in manifest["shards"]] == [2, 1, 2] and len(made) == 3
    assert manifest["totals"]["train"]["sequences"] == 5
    assert manifest["plan"]["turns"] == 5 and manifest["prompts"]["source"] == "test"
    assert distill.read_manifest(tmp_path) == manifest
    shards = [
        corpus_lib.load_corpus_shard(tmp_path / "answers", s["key"]) for s in manifest["shards"]
    ]
    spec = SpecConfig(policy="drafter", budget=1, depth=1, max_new_tokens=4)
    first_answer = shards[0].answers()[0]
    assert first_answer == generate(teacher, None, shards[0].prompts()[0], spec).tokens
    # The third conversation's second turn follows the teacher's own answer to its first,
    # sent back as text, exactly as the benchmark builds a later turn.
    history = [
        {"role": "user", "content": conversations[2][0]},
        {"role": "assistant", "content": tok.decode(shards[1].answers()[0], True)},
        {"role": "user", "content": conversations[2][1]},
    ]
    assert shards[2].prompts()[1] == encode_chat(tok, history)
    assert shards[2].answers()[1] == generate(teacher, None, encode_chat(tok, history), spec).tokens

    # Resumable: nothing is made again, and a corrupt first-turn shard is remade identically,
    # so the later turns' prompts (and keys) stay the same.
    made.clear()
    assert build() == manifest
    assert made == []
    (tmp_path / "answers" / f"{manifest['shards'][1]['key']}.safetensors").write_bytes(b"junk")
    again = build()
    assert again == manifest and len(made) == 1
    with pytest.raises(ValueError, match="at least one user turn"):
        distill.build_conversation_corpus(
            teacher, tok, [["Hi there."], []], settings, tmp_path, fingerprint=FP, source="t"
        )


def test_corpus_command_refuses_given_conversations_it_must_not_answer(tmp_path, capsys):
    from eaglepangu_jax.cli.app import main

    def error(argv):
        with pytest.raises(SystemExit) as exit_info:
            main(["corpus", *argv])
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    quoting = tmp_path / "quoting.jsonl"
    mtbench = load_suite("mtbench")[0].turns[0]
    quoting.write_text(json.dumps({"id": "q", "turns": ["Hello.", mtbench]}) + "\n")
    assert "--conversations needs --out" in error(["--conversations", str(quoting)])
    err = error(["--conversations", str(quoting), "--out", str(tmp_path / "c")])
    assert "share a run of 8 words with MT-Bench or HumanEval (first: 'q')" in err
    # A folder that holds the synthesised corpus is never overwritten by given conversations.
    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"id": "c", "prompt": "Name a mountain."}) + "\n")
    synthesised = tmp_path / "synth"
    plan = distill.CorpusPlan()
    distill.write_manifest(synthesised, plan, FP, distill.PromptList([], [], {}, 0, 0), shards=[])
    err = error(["--conversations", str(clean), "--out", str(synthesised)])
    assert "holds a corpus of synthesised prompts; give another folder" in err
