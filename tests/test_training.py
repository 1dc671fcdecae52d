"""Self-distillation data pipeline (content-addressed shards) and the EAGLE-3 training loop."""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglepangu_jax.drafters import checkpoint as checkpoint_lib
from eaglepangu_jax.drafters import eagle3
from eaglepangu_jax.drafters.vocab import build_vocab, token_counts, vocab_over
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params
from eaglepangu_jax.training import data as data_lib
from eaglepangu_jax.training import prompts as prompts_lib
from eaglepangu_jax.training import train as train_lib

FP = "f" * 64


@pytest.fixture(scope="module")
def tiny_teacher():
    cfg = LlamaConfig.tiny()
    return Teacher(cfg, random_params(cfg, jax.random.key(0)))


def test_prompts_are_deterministic_and_mixed():
    a, b = prompts_lib.training_prompts(30), prompts_lib.training_prompts(30)
    assert a == b and len(set(a)) == 30
    assert any(p.startswith("Write a Python function") for p in a)
    assert prompts_lib.training_prompts(30, seed=1) != a
    # Prompt text is hashed into shard keys: no run-dependent object addresses in it.
    assert not any(" at 0x" in p for p in prompts_lib.code_prompts())
    assert prompts_lib.training_prompts(300)[:30] == a  # a prefix of a longer set


def test_code_prompts_are_stored_not_read_from_the_running_python(monkeypatch):
    """The corpus keys hash the prompts: they must not follow the Python version's docstrings
    (Python 3.12 made other shards of the shipped corpus). The stored list is what the
    stdlib gives under the Python it was made with."""
    stored = prompts_lib.code_prompts()
    assert len(stored) > 100 and len(set(stored)) == len(stored)
    assert all(p.startswith("Write a Python function `") for p in stored)
    expected = prompts_lib.training_prompts(60)

    def refuse():
        raise AssertionError("the running Python's docstrings were read")

    monkeypatch.setattr(prompts_lib, "code_prompts_from_stdlib", refuse)
    assert prompts_lib.training_prompts(60) == expected
    assert [p for p in expected if p.startswith("Write a Python")] == [
        p for p in expected if p in set(stored)
    ]


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 11), reason="the stored prompts were made with Python 3.11"
)
def test_stored_code_prompts_equal_the_stdlib_of_the_python_that_made_them():
    assert prompts_lib.code_prompts() == prompts_lib.code_prompts_from_stdlib()


def test_unreadable_stored_code_prompts_are_refused_clearly(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / prompts_lib.CODE_PROMPTS_FILE).write_text('{"prompts": [1, 2]}')
    monkeypatch.setattr(prompts_lib.resources, "files", lambda package: tmp_path)
    with pytest.raises(ValueError, match="unreadable stored code prompts.*not a list of str"):
        prompts_lib.code_prompts()


def test_pipeline_skips_present_shards_and_regenerates_corrupt_ones(
    tiny_teacher, tmp_path, monkeypatch
):
    calls = []
    real = data_lib.greedy_batch

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_lib, "greedy_batch", counting)
    prompts = [[1, 5, 6], [1, 7], [1, 9, 10, 11]]
    settings = data_lib.DataSettings(feature_layers=(0, 2), max_new_tokens=3, shard_size=2)
    keys = data_lib.build_dataset(
        tiny_teacher, prompts, settings, tmp_path, fingerprint=FP, progress=False
    )
    assert len(keys) == 2 and len(calls) == 2
    shard = data_lib.load_dataset(tmp_path, keys)[0]
    seqs = list(shard.sequences())
    assert [int(t) for t in seqs[0][0][:3]] == [1, 5, 6] and seqs[0][2] == 3
    assert seqs[0][1].shape == (len(seqs[0][0]), 2, tiny_teacher.config.hidden_size)

    assert (
        data_lib.build_dataset(
            tiny_teacher, prompts, settings, tmp_path, fingerprint=FP, progress=False
        )
        == keys
    )
    assert len(calls) == 2  # everything cached

    path = tmp_path / f"{keys[1]}.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert data_lib.load_shard(tmp_path, keys[1]) is None
    data_lib.build_dataset(
        tiny_teacher, prompts, settings, tmp_path, fingerprint=FP, progress=False
    )
    assert len(calls) == 3  # only the corrupt shard was redone
    assert data_lib.load_shard(tmp_path, keys[1]) is not None
    # Another teacher or other settings address other shards.
    assert data_lib.shard_key("0" * 64, prompts[:2], settings) != keys[0]
    other = dataclasses.replace(settings, max_new_tokens=4)
    assert data_lib.shard_key(FP, prompts[:2], other) != keys[0]


def _fake_setup(seed=0):
    cfg = LlamaConfig.tiny()
    rng = np.random.default_rng(seed)
    f, h = 3, cfg.hidden_size
    shards = []
    for _ in range(2):
        lens = [12, 9, 15]
        toks = rng.integers(3, 20, size=sum(lens)).astype(np.int32)
        shards.append(
            data_lib.Shard(
                tokens=toks,
                offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                prompt_lens=np.asarray([3, 2, 4], np.int32),
                features=rng.normal(size=(sum(lens), f, h)).astype(np.float16),
            )
        )
    vocab = build_vocab(token_counts((s.tokens for s in shards), cfg.vocab_size), 16)
    head_cfg = eagle3.Eagle3Config.for_teacher(cfg, 16)
    batches = train_lib.make_batches(shards, vocab, 16)
    embed = random_params(cfg, jax.random.key(1))["embed"]
    return head_cfg, vocab, batches, embed


def _one_sequence_shard(tokens, prompt_len):
    toks = np.asarray(tokens, np.int32)
    return data_lib.Shard(
        tokens=toks,
        offsets=np.asarray([0, len(toks)], np.int64),
        prompt_lens=np.asarray([prompt_len], np.int32),
        features=np.arange(len(toks) * 2, dtype=np.float16).reshape(len(toks), 1, 2),
    )


def test_row_starts_literal_cases():
    assert train_lib.row_starts(10, 4, None) == [0]  # cut: one row
    assert train_lib.row_starts(4, 4, 1) == [0]
    assert train_lib.row_starts(5, 4, 1) == [0, 3]
    assert train_lib.row_starts(10, 4, 1) == [0, 3, 6]  # the last row ends at 10
    assert train_lib.row_starts(11, 4, 0) == [0, 4, 8]
    with pytest.raises(ValueError, match="row_overlap"):
        train_lib.row_starts(3, 4, 4)


def test_make_batches_literal_rows():
    # 10 tokens, 2 of them prompt, rows of 4 overlapping by 1; every token is in the vocab.
    shard = _one_sequence_shard(range(3, 13), prompt_len=2)
    vocab = build_vocab(token_counts([shard.tokens], 16), 16)
    cut = train_lib.make_batches([shard], vocab, 4)
    assert cut.tokens.tolist() == [[3, 4, 5, 6]] and cut.prompt_lens.tolist() == [2]
    rows = train_lib.make_batches([shard], vocab, 4, row_overlap=1)
    assert rows.tokens.tolist() == [[3, 4, 5, 6], [6, 7, 8, 9], [9, 10, 11, 12]]
    assert rows.prompt_lens.tolist() == [2, 1, 1] and rows.lengths.tolist() == [4, 4, 4]
    assert (rows.targets >= 0).tolist() == [[False, False, True, True]] + [[False] + [True] * 3] * 2
    assert rows.features[1, :, 0, 0].tolist() == [6.0, 8.0, 10.0, 12.0]  # positions 3..6
    last = train_lib.make_batches([_one_sequence_shard(range(3, 12), 2)], vocab, 4, 1)
    assert last.lengths.tolist() == [4, 4, 3] and last.tokens[2].tolist() == [9, 10, 11, 0]


def _padded_features(shards, seq_len, overlap):
    """The rows' features copied out one by one: what ``RowFeatures`` must read as."""
    rows = []
    for shard in shards:
        for seq, feat, _ in shard.sequences():
            for start in train_lib.row_starts(len(seq), seq_len, overlap):
                row = np.zeros((seq_len,) + feat.shape[1:], np.float16)
                n = min(len(seq) - start, seq_len)
                row[:n] = feat[start : start + n]
                rows.append(row)
    return np.stack(rows)


def test_row_features_read_as_the_padded_rows_and_hold_a_repeated_shard_once():
    _, vocab, _, _ = _fake_setup()
    first, second = _fake_setup(seed=1)[2].features.sources  # two shards of 3 sequences
    shards = [
        data_lib.Shard(
            np.zeros(len(f), np.int32) + 3,
            np.asarray([0, 12, 21, 36]),
            np.asarray([3, 2, 4], np.int32),
            f,
        )
        for f in (first, second)
    ]
    given = [shards[0], shards[1], shards[1]]  # the second shard weighted twice
    rows = train_lib.make_batches(given, vocab, 8, row_overlap=2).features
    want = _padded_features(given, 8, 2)
    assert rows.shape == want.shape and len(rows.sources) == 2
    np.testing.assert_array_equal(np.asarray(rows), want)
    for index in (3, -1, slice(2, 9), slice(None, None, 3), np.asarray([7, 0, 7])):
        np.testing.assert_array_equal(rows[index], want[index])
    # an index of the other axes too, as the soft targets read the highest tap
    np.testing.assert_array_equal(rows[np.arange(4), :, 2], want[np.arange(4), :, 2])
    np.testing.assert_array_equal(rows[5, :3], want[5, :3])


@given(
    length=st.integers(1, 60),
    prompt_len=st.integers(0, 60),
    seq_len=st.integers(2, 16),
    overlap=st.integers(0, 15),
)
def test_rows_make_every_answer_token_a_target_exactly_once(length, prompt_len, seq_len, overlap):
    overlap, prompt_len = overlap % seq_len, min(prompt_len, length)
    shard = _one_sequence_shard(np.arange(length) % 13 + 3, prompt_len)
    vocab = build_vocab(token_counts([shard.tokens], 16), 16)
    rows = train_lib.make_batches([shard], vocab, seq_len, row_overlap=overlap)
    seen = np.zeros(length, np.int32)
    for start, tok, tgt, ctx, n in zip(
        train_lib.row_starts(length, seq_len, overlap),
        rows.tokens,
        rows.targets,
        rows.prompt_lens,
        rows.lengths,
        strict=True,
    ):
        np.testing.assert_array_equal(tok[:n], shard.tokens[start : start + n])
        assert (tgt[:ctx] == -1).all() and (tgt[ctx:n] >= 0).all() and (tgt[n:] == -1).all()
        assert start == 0 or ctx >= overlap  # a continuation row opens with its context
        seen[start + ctx : start + n] += 1
    np.testing.assert_array_equal(seen, np.arange(length) >= prompt_len)


def _reference_rate(step: int, peak: float, warmup: int, steps: int) -> float:
    """The schedule as documented: linear warmup, cosine to 5% of the peak at ``steps``."""
    warm = max(min(warmup, steps - 1), 1)
    if step < warm:
        return peak * step / warm
    frac = min(max((step - warm) / max(steps - warm, 1), 0.0), 1.0)
    return peak * (0.05 + 0.475 * (1.0 + np.cos(np.pi * frac)))


@given(
    steps=st.integers(1, 5000),
    warmup=st.integers(0, 300),
    at=st.floats(0.0, 1.2),
)
def test_lr_schedule_follows_its_formula_and_takes_a_traced_length(steps, warmup, at):
    cfg = train_lib.TrainConfig(steps=steps, warmup_steps=warmup, learning_rate=3e-3)
    step = int(at * steps)
    want = _reference_rate(step, 3e-3, warmup, steps)
    got = float(train_lib.lr_schedule(cfg)(step))
    assert got == pytest.approx(want, rel=1e-5, abs=1e-9)
    # The length as a traced argument (how a schedule fitted mid-run is compiled) gives the
    # same rates as a config of that length.
    other = train_lib.TrainConfig(steps=9999, warmup_steps=warmup, learning_rate=3e-3)
    traced = jax.jit(lambda n, c: train_lib.lr_schedule(other, n)(c))(steps, step)
    assert float(traced) == pytest.approx(got, rel=1e-6, abs=1e-12)


def test_fitted_schedule_steps_literal_cases():
    fit = train_lib.fitted_schedule_steps
    margin = train_lib.FIT_MARGIN
    assert fit(23, 10.0, 100.0, 5000) == 23 + int(10.0 * 100.0 * margin)
    assert fit(23, 10.0, 100.0, 500) == 500  # --steps is the ceiling
    assert fit(23, 10.0, 0.0, 5000) == 24  # out of time: one more step, the last
    assert fit(23, 10.0, -4.0, 5000) == 24
    assert fit(23, 10.0, 100.0, 23) == 23  # already at the ceiling
    with pytest.raises(ValueError, match="steps_per_second must be > 0"):
        fit(23, 0.0, 100.0, 5000)


def test_training_is_deterministic_and_resumes_to_the_same_curve(tmp_path):
    head_cfg, vocab, batches, embed = _fake_setup()
    tc = train_lib.TrainConfig(
        steps=4,
        batch_size=2,
        seq_len=16,
        ttt_steps=2,
        warmup_steps=1,
        learning_rate=1e-2,
        checkpoint_every=2,
    )
    _, a = train_lib.train(batches, head_cfg, vocab, embed, tc, fingerprint=FP, progress=False)
    _, b = train_lib.train(batches, head_cfg, vocab, embed, tc, fingerprint=FP, progress=False)
    assert a == b and all(np.isfinite(a)) and len(a) == 4
    ckpt = tmp_path / "run"
    half = dataclasses.replace(tc, steps=4, checkpoint_every=2)
    # Stop after 2 steps by training a 4-step schedule with a checkpoint, then resume it.
    train_lib.train(
        batches, head_cfg, vocab, embed, half, fingerprint=FP, checkpoint=ckpt, progress=False
    )
    meta_steps = checkpoint_lib.load_checkpoint(ckpt, fingerprint=FP)[3]["step"]
    assert meta_steps == 4
    _, resumed = train_lib.train(
        batches, head_cfg, vocab, embed, half, fingerprint=FP, checkpoint=ckpt, progress=False
    )
    assert resumed == a  # nothing left to do: the stored curve is returned


def test_checkpoint_round_trip_and_refusals(tmp_path):
    head_cfg, vocab, _, _ = _fake_setup()
    head = eagle3.init_head(head_cfg, jax.random.key(3))
    path = tmp_path / "ck"
    checkpoint_lib.save_checkpoint(
        path, head, head_cfg, vocab.d2t, fingerprint=FP, extra={"step": 0, "losses": []}
    )
    cfg2, head2, d2t, meta, _ = checkpoint_lib.load_checkpoint(path, fingerprint=FP)
    assert cfg2 == head_cfg and np.array_equal(d2t, vocab.d2t)
    for k in head:
        np.testing.assert_array_equal(np.asarray(head[k]), np.asarray(head2[k]))
    with pytest.raises(ValueError, match="teacher"):
        checkpoint_lib.load_checkpoint(path, fingerprint="0" * 64)
    wrong = dataclasses.replace(head_cfg, intermediate_size=head_cfg.intermediate_size + 1)
    with pytest.raises(ValueError, match="shape"):
        checkpoint_lib.load_checkpoint(path, fingerprint=FP, config=wrong)


def test_a_new_run_starts_from_a_stored_head_where_the_old_run_ended(tmp_path):
    """``--init-from``: the stored head is the new run's step-0 weights, exactly."""
    head_cfg, vocab, batches, embed = _fake_setup()
    tc = train_lib.TrainConfig(
        steps=4, batch_size=2, seq_len=16, ttt_steps=2, warmup_steps=1, learning_rate=1e-2
    )
    trained, _ = train_lib.train(
        batches, head_cfg, vocab, embed, tc, fingerprint=FP, progress=False
    )
    path = tmp_path / "first"
    checkpoint_lib.save_checkpoint(
        path, trained, head_cfg, vocab.d2t, fingerprint=FP, extra={"step": 4}
    )
    start, provenance = checkpoint_lib.load_starting_head(
        path, config=head_cfg, d2t=vocab.d2t, fingerprint=FP
    )
    assert provenance["step"] == 4 and provenance["path"] == str(path)
    for name in trained:
        np.testing.assert_array_equal(np.asarray(start[name]), np.asarray(trained[name]))
    second = dataclasses.replace(tc, seed=1)
    _, losses = train_lib.train(
        batches, head_cfg, vocab, embed, second, fingerprint=FP, progress=False, initial_head=start
    )
    kind = train_lib.KINDS["eagle3"]
    rows = train_lib.batch_indices(0, batches.tokens.shape[0], second)
    arrays = tuple(jax.numpy.asarray(a) for a in kind.arrays(batches, rows, 0, second, head_cfg))
    expected, _ = kind.loss(trained, head_cfg, jax.numpy.asarray(embed), arrays, second)
    np.testing.assert_allclose(losses[0], float(expected), rtol=1e-5)


def test_a_stored_head_of_another_shape_vocabulary_or_teacher_cannot_start_a_run(tmp_path):
    head_cfg, vocab, _, _ = _fake_setup()
    path = tmp_path / "ck"
    checkpoint_lib.save_checkpoint(
        path, eagle3.init_head(head_cfg, jax.random.key(3)), head_cfg, vocab.d2t, fingerprint=FP
    )
    wider = dataclasses.replace(head_cfg, intermediate_size=head_cfg.intermediate_size + 1)
    with pytest.raises(ValueError, match="another config"):
        checkpoint_lib.load_starting_head(path, config=wider, d2t=vocab.d2t, fingerprint=FP)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        checkpoint_lib.load_starting_head(
            path, config=head_cfg, d2t=vocab.d2t[::-1].copy(), fingerprint=FP
        )
    with pytest.raises(ValueError, match="teacher"):
        checkpoint_lib.load_starting_head(
            path, config=head_cfg, d2t=vocab.d2t, fingerprint="0" * 64
        )


def test_eagle3_evaluation_literal_chains(monkeypatch):
    """Held-out chains on a literal case: a fake head that misses where we say so."""
    depth, vd, t = 2, 16, 8
    targets = np.asarray([[-1, -1, 5, 6, 7, -1, 9, -1]], np.int32)  # slot 5 out of vocab
    batches = train_lib.Batches(
        tokens=np.asarray([[1, 2, 5, 6, 7, 12, 9, 0]], np.int32),
        targets=targets,
        features=np.zeros((1, t, 1, 4), np.float16),
        prompt_lens=np.asarray([2], np.int32),
        lengths=np.asarray([7], np.int32),
    )
    wrong = {(0, 1), (1, 0)}  # (step, start) pairs the fake head gets wrong
    padded = np.concatenate([targets[0], np.full(depth + 2, -1)])
    logits = np.zeros((depth, t, vd), np.float32)
    for i in range(depth):
        for s in range(t):
            tgt = padded[s + i + 2]
            guess = 0 if tgt < 0 else (tgt + 1) % vd if (i, s) in wrong else tgt
            logits[i, s, guess] = 10.0
    monkeypatch.setattr(train_lib.eagle3, "ttt_logits", lambda *a, **k: jax.numpy.asarray(logits))
    report = train_lib.evaluate({}, None, np.zeros((vd, 4)), batches, depth=depth)
    # chains start at s = 0..4 (first draft s + 2 is an answer slot before the end): step 0
    # is right at s = 0, 2, 4 (s = 1 wrong, s = 3 out of vocab); no chain survives step 1.
    np.testing.assert_allclose(report["chain"], [3 / 5, 0.0])
    assert report["chain_accepted_length"] == pytest.approx(1.6)
    assert report["anchors"] == 5
    # step 0 has in-vocabulary targets at s = 0, 1, 2, 4; step 1 at s = 0, 1, 3
    np.testing.assert_allclose(report["accuracy"], [3 / 4, 2 / 3])


def test_eagle3_evaluation_agrees_with_the_training_accuracy():
    """The held-out step accuracies use the same alignment as the training loss."""
    head_cfg, _, batches, embed = _fake_setup()
    head = eagle3.init_head(head_cfg, jax.random.key(5), embed=jax.numpy.asarray(embed))
    report = train_lib.evaluate(head, head_cfg, embed, batches, depth=3, chunk=3)
    _, accs = train_lib.batch_loss(
        head,
        head_cfg,
        jax.numpy.asarray(embed, jax.numpy.float32),
        jax.numpy.asarray(batches.features),
        jax.numpy.asarray(batches.tokens),
        jax.numpy.asarray(batches.targets),
        3,
    )
    np.testing.assert_allclose(report["accuracy"], np.asarray(accs), atol=1e-6)
    chain = np.asarray(report["chain"])
    assert np.all(np.diff(chain) <= 0) and 0 <= chain[0] <= 1
    assert report["chain_accepted_length"] == pytest.approx(1 + chain.sum())


def test_vocab_over_a_stored_vocabulary_literal():
    counts = np.array([0, 0, 4, 0, 1, 3, 0, 2])  # 10 tokens
    stored = np.array([0, 1, 2, 7])  # a head's d2t: specials, then id 7
    vocab = vocab_over(stored, counts)
    assert vocab.d2t.dtype == np.int32 and vocab.d2t.tolist() == [0, 1, 2, 7]
    assert vocab.coverage == 0.6 and vocab.teacher_vocab_size == 8
    # build_vocab is vocab_over its own choice.
    built = build_vocab(counts, 4)
    again = vocab_over(built.d2t, counts)
    assert built.d2t.tolist() == [0, 1, 2, 5] == again.d2t.tolist()
    assert built.coverage == again.coverage == 0.7


def test_several_corpora_fold_into_one_training_set(tmp_path):
    from eaglepangu_jax.cli.train import corpora

    reads = []

    def read(folder):
        reads.append(folder)
        name = folder.rsplit("/", 1)[-1]
        return [f"{name}-train"], [f"{name}-held"]

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train_shards, held, dropped = corpora([a, b, str(tmp_path / "b" / "..") + "/b"], read)
    assert reads == [a, b]  # the same folder, however spelled, is read once
    assert train_shards == ["a-train", "b-train", "b-train"] and held == ["a-held", "b-held"]
    assert dropped == 0


def _literal_shard(seqs):
    """A shard of ``(prompt ids, answer ids)`` sequences; feature row ``i`` holds ``i``."""
    from eaglepangu_jax.training.data import Shard

    tokens = [t for p, a in seqs for t in p + a]
    lengths = [len(p) + len(a) for p, a in seqs]
    return Shard(
        tokens=np.array(tokens, np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        prompt_lens=np.array([len(p) for p, _ in seqs], np.int32),
        features=np.arange(len(tokens), dtype=np.float16).reshape(-1, 1, 1),
    )


def test_unique_prompts_trains_on_a_prompt_once_across_corpora_literal(tmp_path):
    from eaglepangu_jax.cli.train import corpora

    shards = {
        "a": ([_literal_shard([([5, 6], [7]), ([4], [1])])], [_literal_shard([([9], [9])])]),
        # [5, 6] is a training prompt of a too; [5] only shares its prefix; [9] is held out
        # by a (the held-out filter, not this one, leaves it out of b's training).
        "b": ([_literal_shard([([5, 6], [7]), ([5], [2]), ([9], [3])])], []),
        # c repeats b's [5] and a's [4]: filtered against every earlier corpus.
        "c": ([_literal_shard([([5], [2]), ([4], [1]), ([8], [8])])], []),
    }
    folders = {name: str(tmp_path / name) for name in shards}

    def read(folder):
        return shards[folder.rsplit("/", 1)[-1]]

    order = [folders["a"], folders["b"], folders["c"], folders["b"]]
    plain, _, dropped = corpora(order, read)
    assert dropped == 0 and [len(s.prompt_lens) for s in plain] == [2, 3, 3, 3]
    unique, held, dropped = corpora(order, read, unique_prompts=True)
    assert dropped == 3 and len(held) == 1
    # b given twice still counts twice (the weighting a repeated folder asks for).
    assert [s.tokens.tolist() for s in unique] == [
        [5, 6, 7, 4, 1],
        [5, 2, 9, 3],
        [8, 8],
        [5, 2, 9, 3],
    ]


def test_held_out_prompts_leave_every_training_split_literal():
    from eaglepangu_jax.training.data import prompts_of, without_prompts

    shard = _literal_shard
    held = shard([([5, 6], [7]), ([9], [3, 3])])
    assert prompts_of([held]) == {(5, 6), (9,)}
    # [5, 6] is a held-out prompt; [5] and [5, 6, 7] only share a prefix or hold it.
    mixed = shard([([5], [1]), ([5, 6], [8, 8]), ([5, 6, 7], [2])])
    clean = shard([([4], [4, 4])])
    kept, dropped = without_prompts([mixed, clean, shard([([9], [1])])], prompts_of([held]))
    assert dropped == 2 and len(kept) == 2 and kept[1] is clean
    first = kept[0]
    assert first.tokens.tolist() == [5, 1, 5, 6, 7, 2]
    assert first.offsets.tolist() == [0, 2, 6] and first.prompt_lens.tolist() == [1, 3]
    # Each kept token keeps its own feature row (rows 0-1 and 6-9 of the original).
    assert first.features[:, 0, 0].tolist() == [0, 1, 6, 7, 8, 9]


def _eagle3_loss_with(head, head_cfg, embed, batches, *soft, weight=0.0):
    """``batch_loss`` over every row of ``batches`` at 3 steps (``soft``: ids and probs)."""
    return train_lib.batch_loss(
        head,
        head_cfg,
        jax.numpy.asarray(embed, jax.numpy.float32),
        jax.numpy.asarray(batches.features),
        jax.numpy.asarray(batches.tokens),
        jax.numpy.asarray(batches.targets),
        3,
        *(jax.numpy.asarray(a) for a in soft),
        soft_weight=weight,
    )[0]


def test_eagle3_soft_targets_align_with_the_hard_ones():
    """A teacher law that puts all its mass on the greedy token is the hard target: the soft
    loss must read each step's law at the token that step drafts, so it equals the hard loss
    exactly only if the shift is right (a law one position off scores other tokens)."""
    head_cfg, _, batches, embed = _fake_setup()
    head = eagle3.init_head(head_cfg, jax.random.key(5), embed=jax.numpy.asarray(embed))
    n, t = batches.tokens.shape
    # Position p holds the law of token p + 1: [its draft id, another id] with mass [1, 0].
    nxt = np.concatenate([batches.targets[:, 1:], np.full((n, 1), -1)], axis=1)
    soft_ids = np.stack([np.maximum(nxt, 0), (np.maximum(nxt, 0) + 1) % 16], axis=-1)
    one_hot = np.broadcast_to(np.asarray([1.0, 0.0], np.float32), (n, t, 2))
    hard = _eagle3_loss_with(head, head_cfg, embed, batches, soft_ids, one_hot, weight=0.0)
    soft = _eagle3_loss_with(head, head_cfg, embed, batches, soft_ids, one_hot, weight=1.0)
    np.testing.assert_allclose(np.asarray(soft), np.asarray(hard), rtol=1e-6)
    # The same law shifted one position scores other tokens: the loss differs.
    shifted = np.roll(soft_ids, 1, axis=1)
    off = _eagle3_loss_with(head, head_cfg, embed, batches, shifted, one_hot, weight=1.0)
    assert abs(float(off) - float(hard)) > 1e-2
    # Without soft arrays, the loss is the hard one too.
    plain = _eagle3_loss_with(head, head_cfg, embed, batches)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(hard), rtol=1e-6)


def test_eagle3_soft_loss_mixes_linearly_in_its_weight():
    head_cfg, _, batches, embed = _fake_setup(seed=3)
    head = eagle3.init_head(head_cfg, jax.random.key(7), embed=jax.numpy.asarray(embed))
    rng = np.random.default_rng(0)
    n, t = batches.tokens.shape
    soft_ids = rng.integers(0, 16, size=(n, t, 4)).astype(np.int32)
    soft_probs = rng.dirichlet(np.ones(4), size=(n, t)).astype(np.float32)
    at = {
        w: float(_eagle3_loss_with(head, head_cfg, embed, batches, soft_ids, soft_probs, weight=w))
        for w in (0.0, 0.3, 1.0)
    }
    assert at[1.0] != pytest.approx(at[0.0], rel=1e-3)  # a random law is not the hard target
    assert at[0.3] == pytest.approx(0.7 * at[0.0] + 0.3 * at[1.0], rel=1e-5)
    # The training loop's arrays carry the soft targets only when the run weighs them.
    with_soft = dataclasses.replace(batches, soft_ids=soft_ids, soft_probs=soft_probs)
    rows = np.arange(2)
    cfg = train_lib.TrainConfig(soft_weight=0.3)
    kind = train_lib.KINDS["eagle3"]
    assert len(kind.arrays(with_soft, rows, 0, cfg, head_cfg)) == 5
    assert len(kind.arrays(with_soft, rows, 0, train_lib.TrainConfig(), head_cfg)) == 3
    with pytest.raises(ValueError, match="needs batches with soft targets"):
        kind.arrays(batches, rows, 0, cfg, head_cfg)


def test_eagle3_trains_on_soft_targets_through_the_loop():
    head_cfg, vocab, batches, embed = _fake_setup()
    rng = np.random.default_rng(1)
    n, t = batches.tokens.shape
    soft = dataclasses.replace(
        batches,
        soft_ids=rng.integers(0, 16, size=(n, t, 3)).astype(np.int32),
        soft_probs=rng.dirichlet(np.ones(3), size=(n, t)).astype(np.float32),
    )
    tc = train_lib.TrainConfig(
        steps=12, batch_size=2, seq_len=16, ttt_steps=2, warmup_steps=1, learning_rate=3e-2
    )
    hard_run = train_lib.train(batches, head_cfg, vocab, embed, tc, fingerprint=FP, progress=False)
    soft_tc = dataclasses.replace(tc, soft_weight=0.5)
    _, losses = train_lib.train(
        soft, head_cfg, vocab, embed, soft_tc, fingerprint=FP, progress=False
    )
    assert all(np.isfinite(losses)) and len(losses) == 12
    assert losses != hard_run[1]  # the soft term is in the loss the loop minimises
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
