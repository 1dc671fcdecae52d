"""The distilled draft model (kind ``"draft-model"``): a head over part of the vocabulary scores
only those tokens, the teacher-started model is the truncated teacher, training lowers the loss
and is reproducible, the offline chains are exact on a literal case, the checkpoint round-trips
and refuses another kind, and the drafter it makes is lossless (greedy equals plain greedy)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eaglepangu_jax.drafters.checkpoint import (
    load_checkpoint,
    load_starting_head,
    save_checkpoint,
)
from eaglepangu_jax.drafters.draft_target import DraftTargetDrafter, truncated_teacher
from eaglepangu_jax.drafters.draft_target_model import (
    DraftModelConfig,
    draft_model_params,
    init_from_teacher,
)
from eaglepangu_jax.drafters.vocab import DraftVocab
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params
from eaglepangu_jax.training import soft_targets as soft_lib
from eaglepangu_jax.training import train as train_lib
from eaglepangu_jax.training import train_draft_model

CFG = LlamaConfig.tiny(tie_embeddings=False)
PROMPT = [5, 17, 33, 8, 5, 17, 40, 2, 9, 11]
NO_EOS = -7


@pytest.fixture(scope="module")
def teacher():
    return gen.Teacher(CFG, random_params(CFG, jax.random.key(0)))


def forward_all(params, config, tokens):
    logits, _ = llama.forward_sequence(params, jnp.asarray(tokens, jnp.int32), config=config)
    return np.asarray(logits)


def test_a_head_over_part_of_the_vocabulary_scores_only_those_tokens(teacher):
    ids = np.array([3, 0, 50, 7, 96], np.int32)
    # The teacher's [out, in] copies are dropped before its head is replaced (a stale copy of
    # the full head would be refused).
    params = llama.without_transposed_copy(teacher.params)
    with pytest.raises(ValueError, match="without_transposed_copy"):
        forward_all(
            dict(teacher.params, lm_head=params["lm_head"][:, ids], vocab_ids=ids), CFG, PROMPT
        )
    partial = dict(params, lm_head=params["lm_head"][:, ids], vocab_ids=ids)
    full = forward_all(teacher.params, CFG, PROMPT)
    part = forward_all(partial, CFG, PROMPT)
    np.testing.assert_allclose(part[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    others = np.setdiff1d(np.arange(CFG.vocab_size), ids)
    assert np.all(part[:, others] == -np.inf)


def test_the_teacher_started_draft_model_is_the_truncated_teacher(teacher):
    config = DraftModelConfig.for_teacher(CFG, CFG.vocab_size, 2)
    d2t = np.arange(CFG.vocab_size, dtype=np.int32)
    head = init_from_teacher(config, teacher.params, d2t)
    ours = forward_all(
        draft_model_params(head, config, teacher.params["embed"], d2t),
        config.llama_config(),
        PROMPT,
    )
    t_config, t_params = truncated_teacher(teacher.params, CFG, 2)
    np.testing.assert_allclose(ours, forward_all(t_params, t_config, PROMPT), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot start from a 3-layer teacher"):
        init_from_teacher(dataclasses.replace(config, num_layers=4), teacher.params, d2t)


def greedy_rows(teacher, num, length, seed=0):
    """``num`` sequences: a random 4-token prompt and the teacher's greedy continuation."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num):
        prompt = rng.integers(3, CFG.vocab_size, size=4).tolist()
        out = gen.generate(
            teacher, None, prompt, SpecConfig(max_new_tokens=length - 4, eos_id=NO_EOS)
        )
        rows.append(prompt + list(out.tokens))
    return rows


def batches_of(rows, d2t, seq_len, prompt_len=4):
    t2d = np.full(CFG.vocab_size, -1, np.int32)
    t2d[d2t] = np.arange(len(d2t), dtype=np.int32)
    tokens = np.zeros((len(rows), seq_len), np.int32)
    targets = np.full((len(rows), seq_len), -1, np.int32)
    lengths = []
    for i, row in enumerate(rows):
        n = min(len(row), seq_len)
        tokens[i, :n] = row[:n]
        targets[i, :n] = t2d[np.asarray(row[:n])]
        targets[i, :prompt_len] = -1
        lengths.append(n)
    return train_lib.Batches(
        tokens,
        targets,
        np.zeros((len(rows), seq_len, 0, CFG.hidden_size), np.float16),
        np.full(len(rows), prompt_len, np.int32),
        np.asarray(lengths, np.int32),
    )


def test_the_teacher_as_its_own_draft_model_accepts_every_chain_up_to_the_row_end(teacher):
    """Literal chains: with the whole teacher as the draft every drafted token is right, so
    chain ``i`` from root ``r`` is accepted exactly when token ``r + i + 1`` exists."""
    config = DraftModelConfig.for_teacher(CFG, CFG.vocab_size, CFG.num_layers)
    d2t = np.arange(CFG.vocab_size, dtype=np.int32)
    head = init_from_teacher(config, teacher.params, d2t)
    rows = greedy_rows(teacher, 3, 14)
    batches = batches_of(rows, d2t, seq_len=16)  # two padding slots per row
    report = train_draft_model.evaluate(head, config, teacher.params["embed"], batches, depth=4)
    roots = np.arange(3, 13)  # r + 1 in [prompt_len, length)
    expected = [np.mean(roots + i + 1 < 14) for i in range(4)]
    np.testing.assert_allclose(report["chain"], expected)
    assert report["anchors"] == 3 * len(roots)
    assert report["accuracy"] == [1.0]
    assert report["chain_accepted_length"] == pytest.approx(1 + sum(expected))


def train_tiny(teacher, tmp_path, steps, name, soft_weight=0.0):
    """A one-layer draft trained on 12 greedy rows; with ``soft_weight`` also on the teacher's
    soft targets (from its features leaving layer 1: the draft reads none of its own)."""
    rows = greedy_rows(teacher, 12, 24)
    vocab = DraftVocab(np.arange(48, dtype=np.int32) * 2, CFG.vocab_size, coverage=1.0)
    config = DraftModelConfig.for_teacher(CFG, vocab.size, 1)
    cfg = train_lib.TrainConfig(
        steps=steps,
        batch_size=4,
        seq_len=24,
        learning_rate=1e-2,
        warmup_steps=2,
        soft_weight=soft_weight,
    )
    batches = batches_of(rows, vocab.d2t, 24)
    if soft_weight:
        features = np.stack([tapped(teacher, row, (1,))[1] for row in rows]).astype(np.float16)
        ids, probs = soft_lib.soft_targets(features, teacher.params, CFG, (1,), vocab.d2t)
        batches = dataclasses.replace(batches, soft_ids=ids, soft_probs=probs)
    head, losses = train_lib.train(
        batches,
        config,
        vocab,
        teacher.params["embed"],
        cfg,
        fingerprint="tiny",
        checkpoint=tmp_path / name,
        initial_head=init_from_teacher(config, teacher.params, vocab.d2t),
        progress=False,
    )
    return config, vocab, head, losses


def test_training_lowers_the_loss_reproducibly_and_the_checkpoint_round_trips(teacher, tmp_path):
    config, vocab, head, losses = train_tiny(teacher, tmp_path, 30, "a")
    _, _, _, again = train_tiny(teacher, tmp_path, 30, "b")
    assert losses == again
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    save_checkpoint(tmp_path / "export", head, config, vocab.d2t, fingerprint="tiny")
    stored, loaded, d2t, meta, _ = load_checkpoint(tmp_path / "export", fingerprint="tiny")
    assert stored == config and meta["format"] == "eaglepangu-draft-model"
    np.testing.assert_array_equal(d2t, vocab.d2t)
    for name, value in head.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(value))
    with pytest.raises(ValueError, match="not the 'eagle3' asked for"):
        load_checkpoint(tmp_path / "export", fingerprint="tiny", kind="eagle3")


def test_a_trained_draft_model_moves_to_a_wider_vocabulary_keeping_its_columns(teacher, tmp_path):
    """``--init-from`` with another ``--vocab-size``: shared ids keep their trained columns."""
    config, vocab, head, _ = train_tiny(teacher, tmp_path, 6, "narrow")
    save_checkpoint(tmp_path / "narrow_export", head, config, vocab.d2t, fingerprint="tiny")
    # 64 ids in reverse order: shares the even ids from V - 64 up with the trained vocabulary
    # (the 48 even ids from 0), each at another place.
    wide_d2t = np.arange(CFG.vocab_size - 1, -1, -1, dtype=np.int32)[:64]
    wide = dataclasses.replace(config, draft_vocab_size=len(wide_d2t))
    fresh = init_from_teacher(wide, teacher.params, wide_d2t)
    start, provenance = load_starting_head(
        tmp_path / "narrow_export", config=wide, d2t=wide_d2t, fingerprint="tiny", fresh_head=fresh
    )
    old_place = {int(t): i for i, t in enumerate(vocab.d2t)}
    shared = [j for j, t in enumerate(wide_d2t) if int(t) in old_place]
    assert provenance["vocabulary"] == {"kept": len(shared), "new": len(wide_d2t) - len(shared)}
    assert 0 < len(shared) < len(wide_d2t)
    for j, t in enumerate(wide_d2t):
        source = head["lm_head"][:, old_place[int(t)]] if j in shared else fresh["lm_head"][:, j]
        np.testing.assert_array_equal(np.asarray(start["lm_head"][:, j]), np.asarray(source))
    for name in head:
        if name != "lm_head":
            np.testing.assert_array_equal(np.asarray(start[name]), np.asarray(head[name]))
    with pytest.raises(ValueError, match="another draft vocabulary"):  # no fresh columns given
        load_starting_head(
            tmp_path / "narrow_export", config=wide, d2t=wide_d2t, fingerprint="tiny"
        )
    deeper = dataclasses.replace(wide, num_layers=2)
    with pytest.raises(ValueError, match="num_layers=1 there, 2 here"):
        load_starting_head(
            tmp_path / "narrow_export",
            config=deeper,
            d2t=wide_d2t,
            fingerprint="tiny",
            fresh_head=init_from_teacher(deeper, teacher.params, wide_d2t),
        )


@pytest.mark.parametrize(
    "settings", [dict(depth=4, top_k=1, budget=4), dict(depth=3, top_k=2, budget=6)]
)
def test_a_distilled_draft_over_part_of_the_vocabulary_is_lossless(teacher, tmp_path, settings):
    config, vocab, head, _ = train_tiny(teacher, tmp_path, 10, "c")
    drafter = DraftTargetDrafter(config=config.llama_config(), teacher_config=CFG, **settings)
    params = draft_model_params(head, config, teacher.params["embed"], vocab.d2t)
    spec = SpecConfig(budget=drafter.budget, depth=drafter.depth, eos_id=NO_EOS, max_new_tokens=30)
    ours = gen.generate(teacher, drafter, PROMPT, spec, draft_params=params)
    plain = gen.generate(teacher, None, PROMPT, dataclasses.replace(spec, budget=1, depth=1))
    assert ours.tokens == plain.tokens


def test_it_is_registered_as_a_trained_drafter_and_a_method(teacher, tmp_path, monkeypatch):
    from eaglepangu_jax.cli.generate import DRAFTER_CHOICES
    from eaglepangu_jax.drafters import registry
    from eaglepangu_jax.methods import registry as methods

    assert "draft-distilled" in registry.TRAINED and "draft-distilled" in DRAFTER_CHOICES
    assert methods.parse_methods("draft-distilled") == ("greedy", "draft-distilled")
    config, vocab, head, _ = train_tiny(teacher, tmp_path, 2, "d")
    shipped = DraftTargetDrafter(config=config.llama_config(), teacher_config=CFG, depth=4)
    params = draft_model_params(head, config, teacher.params["embed"], vocab.d2t)
    monkeypatch.setattr(methods, "load_shipped", lambda name: (shipped, params))
    default = methods.make_method("draft-distilled", SpecConfig(budget=6), default_depth=True)
    sampled = methods.make_method(
        "draft-distilled",
        SpecConfig(budget=5, depth=3, acceptance="sample", temperature=0.7, top_p=0.9),
    )
    one_chain = methods.make_method("draft-distilled", SpecConfig(budget=8, depth=4), draft_top_k=1)
    # The setting belongs to the draft-target drafters; a method list shares it, others ignore it.
    ngram = methods.make_method("ngram", SpecConfig(budget=8, depth=4), draft_top_k=2)
    assert default.drafter.top_k == shipped.top_k == 2 and one_chain.drafter.top_k == 1
    assert one_chain.drafter.lengths == (4,) and ngram.drafter is not None
    assert one_chain.spec.budget == one_chain.drafter.max_nodes == 4  # one chain of 4 fills 4
    assert (default.spec.depth, default.drafter.depth, default.drafter.budget) == (4, 4, 6)
    assert not default.drafter.sampling and default.draft_params is params
    assert (sampled.drafter.depth, sampled.drafter.budget) == (3, 5)
    assert (sampled.drafter.temperature, sampled.drafter.top_p) == (0.7, 0.9)
    # With the budget left at its default it drafts one node: the root's best child, no
    # draft forward past the one the last update left (measured faster on the dev suite).
    own = methods.make_method(
        "draft-distilled", SpecConfig(budget=8), default_depth=True, default_budget=True
    )
    assert own.spec.budget == methods.DRAFTER_BUDGETS["draft-distilled"] == 1
    assert own.drafter.lengths == (1,) and own.drafter.max_nodes == 1


@pytest.mark.slow
def test_the_shipped_distilled_draft_is_lossless_and_accepts_on_the_real_teacher():
    from eaglepangu_jax.drafters.draft_distilled import load_shipped_draft_distilled
    from eaglepangu_jax.models import chat, smollm2, tokenizer

    cfg, params = smollm2.load_smollm2()
    teacher = gen.Teacher(cfg, llama.prepare_params(params))
    drafter, dparams = load_shipped_draft_distilled(params, budget=4, depth=4)
    tok = tokenizer.load_tokenizer()
    prompt = chat.encode_chat(tok, [{"role": "user", "content": "Give me three tips for sleep."}])
    spec = SpecConfig(policy="drafter", budget=4, depth=4, max_new_tokens=32)
    plain = gen.generate(teacher, None, prompt, spec)
    out = gen.generate(teacher, drafter, prompt, spec, draft_params=dparams)
    assert out.tokens == plain.tokens
    assert out.stats.accepted_length > 1.0


# ------------------------------------------------------------------------- soft targets


def tapped(teacher, tokens, layers):
    """The teacher's logits and the features leaving ``layers`` on one causal sequence."""
    logits, features = llama.forward_sequence(
        teacher.params, jnp.asarray(tokens, jnp.int32), config=CFG, feature_layers=layers
    )
    return np.asarray(logits), np.asarray(features)


def test_the_teachers_top_layers_on_its_tapped_features_give_its_own_logits(teacher):
    d2t = np.array([3, 0, 50, 7, 96, 11], np.int32)
    for below in range(CFG.num_layers):  # the last one leaves only the final norm and head
        logits, features = tapped(teacher, PROMPT, (below,))
        top, config = soft_lib.teacher_top(teacher.params, CFG, below, d2t)
        assert len(top["layers"]) == CFG.num_layers - 1 - below
        ours = soft_lib.top_logits(top, config, jnp.asarray(features[:, 0]))
        np.testing.assert_allclose(ours, logits[:, d2t], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layer 3 is not one of the teacher's 3"):
        soft_lib.teacher_top(teacher.params, CFG, 3, d2t)


def test_soft_targets_are_the_teachers_renormalised_top_k_over_the_draft_vocabulary(teacher):
    d2t = np.arange(0, 96, 2, dtype=np.int32)  # 48 draft ids
    rows = greedy_rows(teacher, 3, 12)
    layers = (0, 1)  # the highest tap (1) is the one used
    features = np.stack([tapped(teacher, row, layers)[1] for row in rows]).astype(np.float16)
    ids, probs = soft_lib.soft_targets(
        features, teacher.params, CFG, layers, d2t, top_k=4, chunk=2
    )  # chunk 2 of 3 rows: the last chunk is padded
    assert ids.shape == probs.shape == (3, 12, 4)
    for i, row in enumerate(rows):
        logits = tapped(teacher, row, layers)[0][:, d2t].astype(np.float64)
        law = np.exp(logits - logits.max(-1, keepdims=True))
        law /= law.sum(-1, keepdims=True)
        best = np.argsort(-law, axis=-1)[:, :4]
        np.testing.assert_array_equal(ids[i], best)
        kept = np.take_along_axis(law, best, axis=-1)
        # float16 features: the teacher's law up to that rounding
        np.testing.assert_allclose(probs[i], kept / kept.sum(-1, keepdims=True), atol=2e-3)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    with pytest.raises(ValueError, match="top_k must be in"):
        soft_lib.soft_targets(features, teacher.params, CFG, layers, d2t, top_k=49)
    with pytest.raises(ValueError, match="features must be"):
        soft_lib.soft_targets(features, teacher.params, CFG, (1,), d2t)


def test_the_soft_loss_mixes_with_the_hard_one_as_documented(teacher):
    vocab = DraftVocab(np.arange(48, dtype=np.int32) * 2, CFG.vocab_size, coverage=1.0)
    config = DraftModelConfig.for_teacher(CFG, vocab.size, 1)
    head = init_from_teacher(config, teacher.params, vocab.d2t)
    batches = batches_of(greedy_rows(teacher, 2, 12), vocab.d2t, 12)
    embed = teacher.params["embed"]
    hard = train_lib.TrainConfig(seq_len=12)
    tokens, targets = train_draft_model.train_arrays(batches, np.arange(2), 0, hard, config)
    hard_loss, hard_acc = train_draft_model.loss(head, config, embed, (tokens, targets), hard)
    nxt = np.concatenate([targets[:, 1:], np.full((2, 1), -1)], axis=1)
    # One-hot soft targets on the hard ones: the soft loss is the hard loss.
    one_hot_ids = np.zeros((2, 12, 3), np.int32)
    one_hot_ids[..., 0] = np.maximum(nxt, 0)
    one_hot = np.zeros((2, 12, 3), np.float32)
    one_hot[..., 0] = 1.0
    soft_only = train_lib.TrainConfig(seq_len=12, soft_weight=1.0)
    loss, acc = train_draft_model.loss(
        head, config, embed, (tokens, targets, one_hot_ids, one_hot), soft_only
    )
    np.testing.assert_allclose(loss, hard_loss, rtol=1e-6)
    np.testing.assert_array_equal(acc, hard_acc)
    # Any soft targets at weight 1/4: (3/4) hard + (1/4) soft, the soft term by hand.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab.size, size=(2, 12, 3)).astype(np.int32)
    probs = rng.dirichlet(np.ones(3), size=(2, 12)).astype(np.float32)
    mixed = train_lib.TrainConfig(seq_len=12, soft_weight=0.25)
    loss, _ = train_draft_model.loss(head, config, embed, (tokens, targets, ids, probs), mixed)
    logits = np.stack(
        [np.asarray(train_draft_model.sequence_logits(head, config, embed, tk)) for tk in tokens]
    ).astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    valid = nxt >= 0
    soft = -(probs * np.take_along_axis(logp, ids, -1)).sum(-1)[valid].sum() / valid.sum()
    np.testing.assert_allclose(loss, 0.75 * hard_loss + 0.25 * soft, rtol=1e-5)
    with pytest.raises(ValueError, match="needs batches with soft targets"):
        train_draft_model.train_arrays(batches, np.arange(2), 0, mixed, config)
    with pytest.raises(ValueError, match="soft_weight must be in"):
        train_lib.TrainConfig(soft_weight=1.5)


def test_training_on_soft_targets_moves_the_draft_toward_the_teachers_law(teacher, tmp_path):
    _, _, _, losses = train_tiny(teacher, tmp_path, 30, "soft", soft_weight=1.0)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
