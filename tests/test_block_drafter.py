"""Block (DFlash-style) drafter: marginals, context window, losslessness in the engine,
training objective, checkpoints, shipped weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglepangu_jax.calibration import curve as cal_curve
from eaglepangu_jax.drafters import DRAFTERS, block, eagle3, make_drafter
from eaglepangu_jax.drafters import checkpoint as checkpoint_lib
from eaglepangu_jax.drafters.vocab import build_vocab, token_counts
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import Teacher, generate
from eaglepangu_jax.engine.drafter import DraftContext
from eaglepangu_jax.methods.registry import Method
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params
from eaglepangu_jax.training import data as data_lib
from eaglepangu_jax.training import train as train_lib
from eaglepangu_jax.training import train_block

FP = "f" * 64
CFG = LlamaConfig.tiny()
CAPACITY = 32


@pytest.fixture(scope="module")
def tiny():
    params = random_params(CFG, jax.random.key(0))
    cfg = block.BlockConfig.for_teacher(CFG, 24, block_size=4, num_layers=2)
    d2t = jnp.asarray((np.arange(24) * 4) % CFG.vocab_size, jnp.int32)
    head = _with_injection(
        block.init_head(
            cfg, jax.random.key(1), embed=params["embed"], d2t=d2t, final_norm=params["final_norm"]
        )
    )
    return params, cfg, block.make_params(head, params["embed"], d2t)


def _with_injection(head):
    """``w_last`` starts at zero; a random one exercises the injected-context path too."""
    w = head["w_last"]
    return {
        **head,
        "w_last": jax.random.normal(jax.random.key(9), w.shape, jnp.float32)
        / jnp.float32(np.sqrt(w.shape[0])),
    }


def _context(cfg, num_tokens=12, num_features=11, start=0, seed=5):
    tokens = jnp.asarray(np.arange(CAPACITY) % 50 + 3, jnp.int32)
    feats = jax.random.normal(
        jax.random.key(seed), (num_features, len(cfg.feature_layers), cfg.hidden_size), jnp.float32
    )
    return DraftContext(
        tokens=tokens,
        num_tokens=jnp.int32(num_tokens),
        features=feats,
        num_features=jnp.int32(num_features),
        start=jnp.int32(start),
    )


def _marginals(drafter, params, ctx):
    state = drafter.init_state(params, ctx)
    return drafter.propose(params, state, ctx, jax.random.key(0)).marginals


def test_config_shapes_and_validation(tiny):
    _, cfg, params = tiny
    assert cfg.feature_layers == eagle3.Eagle3Config.for_teacher(CFG, 24).feature_layers
    # The drafting layout: decoder weights per layer, everything else as stored.
    prepared, shapes = params["head"], cfg.head_shapes()
    assert len(prepared["layers"]) == cfg.num_layers
    for layer in prepared["layers"]:
        assert {k: tuple(v.shape) for k, v in layer.items()} == {
            k: shapes[k][1:] for k in block.DECODER_KEYS
        }
    rest = {k: tuple(v.shape) for k, v in prepared.items() if k != "layers"}
    assert rest == {k: v for k, v in shapes.items() if k not in block.DECODER_KEYS}
    assert cfg.head_shapes()["wq"] == (2, 32, 32) and cfg.head_shapes()["ctx_wk"] == (2, 32, 16)
    assert block.BlockConfig.from_json(cfg.to_json()) == cfg
    drafter = block.BlockDrafter(config=cfg)
    assert drafter.max_depth == 4 and drafter.feature_layers == cfg.feature_layers
    assert DRAFTERS["block"] is block.BlockDrafter
    assert make_drafter("block", config=cfg, depth=2).max_depth == 2
    with pytest.raises(ValueError, match="depth"):
        block.BlockDrafter(config=cfg, depth=5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(cfg, num_kv_heads=3)
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(cfg, block_size=0)


@pytest.mark.parametrize("poison", ["none", "lm_head_column", "everything"])
def test_marginals_are_log_probs_on_draft_ids_and_never_nan(tiny, poison):
    _, cfg, params = tiny
    head = dict(params["head"])
    if poison == "lm_head_column":
        head["lm_head"] = head["lm_head"].at[:, 5].set(jnp.nan)
    elif poison == "everything":
        head = jax.tree.map(lambda v: jnp.full_like(v, jnp.nan), head)
    params = {**params, "head": head}
    drafter = block.BlockDrafter(config=cfg, depth=3)
    m = np.asarray(jax.jit(lambda p, c: _marginals(drafter, p, c))(params, _context(cfg)))
    assert m.shape == (3, CFG.vocab_size) and m.dtype == np.float32
    assert not np.isnan(m).any()
    on = np.zeros(CFG.vocab_size, bool)
    on[np.asarray(params["d2t"])] = True
    assert np.all(m[:, ~on] == -np.inf)
    if poison == "none":
        assert np.all(np.isfinite(m[:, on]))
        np.testing.assert_allclose(jax.scipy.special.logsumexp(m, axis=-1), 0.0, atol=1e-5)
    else:
        assert np.all(m == -np.inf)  # a NaN anywhere in a row poisons its whole softmax


def test_a_smaller_depth_returns_the_first_rows_of_the_same_marginals(tiny):
    """The block runs at its trained size whatever ``depth`` is, so depth 1 (its default
    depth at its default budget of one node, methods.make_method) is the full run's first
    row (and a best-first tree of one node reads no other: tests/test_scoring.py)."""
    _, cfg, params = tiny
    ctx = _context(cfg)
    full, first = (
        np.asarray(_marginals(block.BlockDrafter(config=cfg, depth=d), params, ctx))
        for d in (cfg.block_size, 1)
    )
    assert first.shape == (1, CFG.vocab_size)
    np.testing.assert_array_equal(first, full[:1])


def _stacked_and_prepared(cfg, embed, d2t, seed=1):
    head = _with_injection(block.init_head(cfg, jax.random.key(seed)))
    head = {k: v + 0.01 * jax.random.normal(jax.random.key(7), v.shape) for k, v in head.items()}
    return eagle3.make_params(head, embed, d2t), block.make_params(head, embed, d2t)


def test_prepared_head_drafts_exactly_as_the_stacked_one(tiny):
    """The drafting layout changes where the weights live, not one bit of the marginals; the
    training functions read either layout."""
    params, cfg, _ = tiny
    d2t = jnp.asarray((np.arange(24) * 4) % CFG.vocab_size, jnp.int32)
    stacked, prepared = _stacked_and_prepared(cfg, params["embed"], d2t)
    assert "layers" not in stacked["head"]
    assert block.prepare_head(prepared["head"]) is prepared["head"]  # idempotent
    drafter = block.BlockDrafter(config=cfg)
    ctx = _context(cfg)
    run = jax.jit(lambda p, c: _marginals(drafter, p, c))
    np.testing.assert_array_equal(np.asarray(run(prepared, ctx)), np.asarray(run(stacked, ctx)))
    eager = [np.asarray(_marginals(drafter, p, ctx)) for p in (prepared, stacked)]
    np.testing.assert_array_equal(*eager)


def test_prepared_head_reads_its_layer_weights_in_place():
    """Drafting from the stacked layout, XLA on CPU copies every layer's weight slice into
    the call's temporaries (28 MB a round for the shipped head); from the prepared one the
    temporaries stay far below the layer weights' size."""
    teacher_cfg = dataclasses.replace(
        CFG, hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=2, head_dim=64
    )
    cfg = block.BlockConfig.for_teacher(teacher_cfg, 64, block_size=4, num_layers=2)
    embed = jax.random.normal(jax.random.key(0), (CFG.vocab_size, 256), jnp.float32)
    d2t = jnp.arange(64, dtype=jnp.int32)
    stacked, prepared = _stacked_and_prepared(cfg, embed, d2t)
    layer_bytes = sum(
        v.size * v.dtype.itemsize for layer in prepared["head"]["layers"] for v in layer.values()
    )
    drafter = block.BlockDrafter(config=cfg)
    ctx = _context(cfg)
    state = drafter.init_state(prepared, ctx)

    def temp_bytes(params):
        compiled = (
            jax.jit(lambda p, s, c: drafter.propose(p, s, c, None).marginals)
            .lower(params, state, ctx)
            .compile()
        )
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(prepared) < layer_bytes / 4, (temp_bytes(prepared), layer_bytes)


def test_the_drafting_cost_key_names_the_block_drafters_cost_revision(tiny):
    """A calibration's block cost measured before the layers were read in place (twice the
    cost) is not read: the key names the revision, so the next controlled run measures it."""
    _, cfg, params = tiny
    spec = SpecConfig(policy="auto", budget=8, depth=4)
    method = Method(name="block", spec=spec, drafter=block.BlockDrafter(config=cfg))
    assert block.BlockDrafter.cost_revision == 1
    assert cal_curve.draft_cost_key(method) == "block:budget=8,depth=4,rev=1"


def test_jit_equals_eager(tiny):
    _, cfg, params = tiny
    drafter = block.BlockDrafter(config=cfg)
    ctx = _context(cfg)
    eager = _marginals(drafter, params, ctx)
    jitted = jax.jit(lambda p, c: _marginals(drafter, p, c))(params, ctx)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_incremental_updates_equal_one_init(tiny):
    """Features fed over several rounds give the same state as all of them at once."""
    _, cfg, params = tiny
    drafter = block.BlockDrafter(config=cfg)
    full = _context(cfg, num_tokens=12, num_features=11)
    first = dataclasses.replace(
        full, num_tokens=jnp.int32(8), features=full.features[:7], num_features=jnp.int32(7)
    )
    state = drafter.init_state(params, first)
    # Round: 4 accepted tokens; the rows of the last round's path are padded to depth + 1.
    feats = jnp.zeros((5,) + full.features.shape[1:], jnp.float32).at[:4].set(full.features[7:])
    state = drafter.update(
        params, state, dataclasses.replace(full, features=feats, num_features=jnp.int32(4))
    )
    once = drafter.init_state(params, full)
    np.testing.assert_allclose(np.asarray(state.k[:, :11]), np.asarray(once.k[:, :11]), atol=1e-6)
    assert int(state.length) == int(once.length) == 11 and int(state.first) == 0
    np.testing.assert_allclose(
        np.asarray(drafter.propose(params, state, full, None).marginals),
        np.asarray(drafter.propose(params, once, full, None).marginals),
        atol=1e-5,
    )


@given(st.integers(1, 11), st.integers(0, 10_000))
@settings(max_examples=15, deadline=None)
def test_start_hides_old_context(start, seed):
    """With ``start``, positions before it cannot change the marginals; visible ones can
    (context positions are 0..10, the root is at 11: ``start = 11`` hides them all)."""
    params = random_params(CFG, jax.random.key(0))
    cfg = block.BlockConfig.for_teacher(CFG, 24, block_size=4, num_layers=2)
    d2t = jnp.asarray((np.arange(24) * 4) % CFG.vocab_size, jnp.int32)
    dparams = block.make_params(
        _with_injection(block.init_head(cfg, jax.random.key(1))), params["embed"], d2t
    )
    drafter = block.BlockDrafter(config=cfg)
    run = _jitted_marginals(drafter)
    ctx = _context(cfg, start=start)
    noise = jax.random.normal(jax.random.key(seed), ctx.features.shape, jnp.float32)
    hidden = jnp.arange(ctx.features.shape[0])[:, None, None] < start
    changed_old = dataclasses.replace(ctx, features=jnp.where(hidden, noise, ctx.features))
    changed_new = dataclasses.replace(ctx, features=jnp.where(hidden, ctx.features, noise))
    base = np.asarray(run(dparams, ctx))
    np.testing.assert_allclose(np.asarray(run(dparams, changed_old)), base, atol=1e-5)
    new = np.asarray(run(dparams, changed_new))
    if start <= 10:
        assert not np.allclose(new, base, atol=1e-4)
    else:
        np.testing.assert_allclose(new, base, atol=1e-5)
    # Without the window the old positions are seen again.
    seen = dataclasses.replace(changed_old, start=jnp.int32(0))
    assert not np.allclose(np.asarray(run(dparams, seen)), base, atol=1e-4)


_JITTED = {}


def _jitted_marginals(drafter):
    if drafter not in _JITTED:
        _JITTED[drafter] = jax.jit(lambda p, c: _marginals(drafter, p, c))
    return _JITTED[drafter]


# -------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def teacher():
    # Scaled weights make the random teacher's argmax depend on the context (not one token).
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return Teacher(CFG, params)


@pytest.mark.parametrize("policy", ["best_first", "auto"])
def test_generation_with_block_drafter_equals_greedy(teacher, tiny, policy):
    _, cfg, dparams = tiny
    dparams = {**dparams, "embed": teacher.params["embed"]}
    drafter = block.BlockDrafter(config=cfg, depth=3)
    spec = SpecConfig(policy=policy, budget=6, depth=3, max_new_tokens=20)
    for prompt in ([5, 9, 13, 17, 21, 25, 29], [7]):
        latency = cal_curve.auto_verify_latency(teacher.config, spec, len(prompt))
        plain = generate(teacher, None, prompt, spec)
        out = generate(teacher, drafter, prompt, spec, draft_params=dparams, verify_latency=latency)
        assert out.tokens == plain.tokens
        assert out.stats.rounds <= plain.stats.rounds
        assert max(out.stats.nodes_per_round) <= spec.budget


# ------------------------------------------------------------------------------ training


def _fake_setup(seed=0, block_size=3):
    rng = np.random.default_rng(seed)
    f, h = 3, CFG.hidden_size
    shards = []
    for _ in range(2):
        lens = [14, 11, 16]
        # A learnable rule: the answer counts up, so every depth's target follows the root.
        toks = np.concatenate(
            [
                np.concatenate(
                    [rng.integers(3, 9, size=3), 3 + (np.arange(n - 3) + rng.integers(0, 5)) % 14]
                )
                for n in lens
            ]
        ).astype(np.int32)
        shards.append(
            data_lib.Shard(
                tokens=toks,
                offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                prompt_lens=np.asarray([3, 3, 3], np.int32),
                features=rng.normal(size=(sum(lens), f, h)).astype(np.float16),
            )
        )
    vocab = build_vocab(token_counts((s.tokens for s in shards), CFG.vocab_size), 20)
    cfg = block.BlockConfig.for_teacher(CFG, 20, block_size=block_size, num_layers=1)
    batches = train_lib.make_batches(shards, vocab, 16)
    embed = random_params(CFG, jax.random.key(1))["embed"]
    return cfg, vocab, batches, embed


def test_anchors_lie_in_the_answer_region_and_targets_follow_them():
    prompt_lens, lengths = np.asarray([3, 5, 4]), np.asarray([10, 6, 4])
    anchors, ok = train_block.sample_anchors(prompt_lens, lengths, 4, np.random.default_rng(0))
    for i in range(3):
        lo, hi = train_block.anchor_range(int(prompt_lens[i]), int(lengths[i]))
        picked = anchors[i][ok[i]]
        assert len(picked) == min(4, hi - lo) and len(set(picked.tolist())) == len(picked)
        assert np.all((picked >= lo) & (picked < hi))
    assert ok.sum(axis=1).tolist() == [4, 1, 0]  # a prompt-only row has no anchor
    since = train_block.sample_windows(anchors, 3, np.random.default_rng(1))
    assert np.all((since == 0) | ((since >= anchors - 3) & (since < anchors)))
    assert np.all(train_block.sample_windows(anchors, 0, np.random.default_rng(1)) == 0)
    targets = jnp.asarray([-1, -1, 7, 8, 9, -1], jnp.int32)
    tg = train_block.block_targets(targets, jnp.asarray([1, 4], jnp.int32), 3)
    assert tg.tolist() == [[7, 8, 9], [-1, -1, -1]]


def test_a_time_limit_ends_the_run_at_an_evaluated_checkpoint_that_resumes(tmp_path):
    """--time-limit: the step that passes the limit is the last; it is evaluated and
    checkpointed as the end of a run is, and resuming continues the same curve."""
    cfg, vocab, batches, embed = _fake_setup()
    tc = train_lib.TrainConfig(
        steps=12, batch_size=3, seq_len=16, anchors=6, warmup_steps=2, checkpoint_every=5
    )
    _, full = train_lib.train(batches, cfg, vocab, embed, tc, fingerprint=FP, progress=False)
    ckpt, seen = tmp_path / "run", []
    _, cut = train_lib.train(
        batches,
        cfg,
        vocab,
        embed,
        tc,
        fingerprint=FP,
        checkpoint=ckpt,
        progress=False,
        monitor=lambda step, head: seen.append(step),
        monitor_every=5,
        time_limit=1e-9,  # passed by the first step
    )
    assert len(cut) == 1 and seen == [1]
    assert checkpoint_lib.load_checkpoint(ckpt, fingerprint=FP)[3]["step"] == 1
    _, resumed = train_lib.train(
        batches, cfg, vocab, embed, tc, fingerprint=FP, checkpoint=ckpt, progress=False
    )
    np.testing.assert_allclose(resumed, full, rtol=1e-5)
    with pytest.raises(ValueError, match="time_limit must be > 0"):
        train_lib.train(batches, cfg, vocab, embed, tc, fingerprint=FP, time_limit=0.0)


class _Clock:
    """A stand-in for ``time`` in the training loop: each reading is one second later."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now


def test_a_schedule_fitted_to_the_time_limit_is_the_run_of_that_length(tmp_path, monkeypatch):
    """--fit-schedule: steps FIT_SKIP..FIT_SKIP+FIT_PROBE are timed (here one step a second),
    the schedule is shortened to end at the time limit, and since the probe lies inside the
    warmup (which does not depend on the length) the run equals a plain run of the fitted
    length; the length is checkpointed and a resume keeps it."""
    cfg, vocab, batches, embed = _fake_setup()
    tc = train_lib.TrainConfig(
        steps=200, batch_size=3, seq_len=16, anchors=6, warmup_steps=25, checkpoint_every=50
    )
    monkeypatch.setattr(train_lib, "time", _Clock())
    fits = []
    ckpt = tmp_path / "run"
    _, fitted = train_lib.train(
        batches,
        cfg,
        vocab,
        embed,
        tc,
        fingerprint=FP,
        checkpoint=ckpt,
        progress=False,
        time_limit=40.0,
        fit_schedule=True,
        on_fit=lambda n, rate: fits.append((n, rate)),
        until=30,
    )
    # At step 23, 23 s have passed at 1 step/s: 17 s left, FIT_MARGIN of them planned.
    probe_end = train_lib.FIT_SKIP + train_lib.FIT_PROBE
    expected = probe_end + int(1.0 * (40.0 - probe_end) * train_lib.FIT_MARGIN)
    assert fits == [(expected, pytest.approx(1.0))] and expected == 38
    assert len(fitted) == 30  # until= still stops the run early
    meta = checkpoint_lib.load_checkpoint(ckpt, fingerprint=FP)[3]
    assert meta["step"] == 30 and meta["schedule_steps"] == expected
    _, resumed = train_lib.train(
        batches, cfg, vocab, embed, tc, fingerprint=FP, checkpoint=ckpt, progress=False
    )
    _, plain = train_lib.train(
        batches,
        cfg,
        vocab,
        embed,
        dataclasses.replace(tc, steps=expected),
        fingerprint=FP,
        progress=False,
    )
    assert len(resumed) == len(plain) == expected
    np.testing.assert_allclose(fitted, plain[:30], rtol=1e-5)
    np.testing.assert_allclose(resumed, plain, rtol=1e-5)
    with pytest.raises(ValueError, match="fit_schedule needs a time_limit"):
        train_lib.train(batches, cfg, vocab, embed, tc, fingerprint=FP, fit_schedule=True)


def test_training_learns_is_deterministic_and_resumes_to_the_same_curve(tmp_path):
    cfg, vocab, batches, embed = _fake_setup()
    tc = train_lib.TrainConfig(
        steps=24,
        batch_size=3,
        seq_len=16,
        anchors=6,
        warmup_steps=2,
        learning_rate=1e-2,
        checkpoint_every=4,
        context_window=4,
    )
    _, a = train_lib.train(batches, cfg, vocab, embed, tc, fingerprint=FP, progress=False)
    _, b = train_lib.train(batches, cfg, vocab, embed, tc, fingerprint=FP, progress=False)
    assert a == b and len(a) == 24 and all(np.isfinite(a))
    assert np.mean(a[-4:]) < 0.7 * np.mean(a[:4])
    ckpt = tmp_path / "run"
    _, first = train_lib.train(
        batches, cfg, vocab, embed, tc, fingerprint=FP, checkpoint=ckpt, progress=False, until=10
    )
    assert first == a[:10]
    assert checkpoint_lib.load_checkpoint(ckpt, fingerprint=FP)[3]["step"] == 10
    _, resumed = train_lib.train(
        batches, cfg, vocab, embed, tc, fingerprint=FP, checkpoint=ckpt, progress=False
    )
    np.testing.assert_allclose(resumed, a, rtol=1e-5)
    with pytest.raises(ValueError, match="other settings.*anchors=6"):
        train_lib.train(
            batches,
            cfg,
            vocab,
            embed,
            dataclasses.replace(tc, anchors=5),
            fingerprint=FP,
            checkpoint=ckpt,
            progress=False,
        )
    other = dataclasses.replace(tc, seed=1, steps=4)
    assert (
        train_lib.train(batches, cfg, vocab, embed, other, fingerprint=FP, progress=False)[1]
        != a[:4]
    )


def test_evaluate_reports_per_depth_accuracy():
    cfg, vocab, batches, embed = _fake_setup()
    head = block.init_head(cfg, jax.random.key(0), embed=embed, d2t=vocab.d2t)
    report = train_block.evaluate(head, cfg, embed, batches, chunk=4)
    assert len(report["accuracy"]) == 3 and all(0 <= a <= 1 for a in report["accuracy"])
    chain = report["chain"]
    assert all(chain[i + 1] <= chain[i] <= report["accuracy"][0] + 1e-9 for i in range(2))
    assert report["chain_accepted_length"] == pytest.approx(1 + sum(chain))
    lo_hi = [
        train_block.anchor_range(int(p), int(n))
        for p, n in zip(batches.prompt_lens, batches.lengths)
    ]
    assert report["anchors"] == sum(hi - lo for lo, hi in lo_hi)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    cfg, vocab, _, _ = _fake_setup()
    head = block.init_head(cfg, jax.random.key(3))
    path = tmp_path / "ck"
    checkpoint_lib.save_checkpoint(path, head, cfg, vocab.d2t, fingerprint=FP, extra={"step": 0})
    cfg2, head2, d2t, meta, _ = checkpoint_lib.load_checkpoint(path, fingerprint=FP, kind="block")
    assert cfg2 == cfg and meta["format"] == "eaglepangu-block"
    assert np.array_equal(d2t, vocab.d2t)
    for k in head:
        np.testing.assert_array_equal(np.asarray(head[k]), np.asarray(head2[k]))
    with pytest.raises(ValueError, match="teacher"):
        checkpoint_lib.load_checkpoint(path, fingerprint="0" * 64)
    wrong = dataclasses.replace(cfg, num_layers=2)
    with pytest.raises(
        ValueError,
        match=r"'attn_norm' has shape \(1, 32\), the head needs "
        r"\(2, 32\)",
    ):
        checkpoint_lib.load_checkpoint(path, fingerprint=FP, config=wrong)
    with pytest.raises(ValueError, match="kind 'block', not the 'eagle3'"):
        checkpoint_lib.load_checkpoint(path, fingerprint=FP, kind="eagle3")
    with pytest.raises(ValueError, match="kind 'block', not the 'eagle3'"):
        checkpoint_lib.load_checkpoint(
            path, fingerprint=FP, config=eagle3.Eagle3Config.for_teacher(CFG, 20)
        )


# ------------------------------------------------------------------------------ shipped


@pytest.mark.slow
def test_shipped_block_drafter_on_real_teacher_is_lossless():
    from eaglepangu_jax.models import chat, llama, smollm2, tokenizer

    cfg, params = smollm2.load_smollm2()
    teacher = Teacher(cfg, llama.prepare_params(params))
    drafter, dparams = block.load_shipped_block(params, budget=8)
    assert drafter.max_depth == drafter.config.block_size
    tok = tokenizer.load_tokenizer()
    prompt = chat.encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])
    spec = SpecConfig(policy="best_first", budget=8, depth=drafter.max_depth, max_new_tokens=20)
    plain = generate(teacher, None, prompt, spec)
    out = generate(teacher, drafter, prompt, spec, draft_params=dparams)
    assert out.tokens == plain.tokens
    assert out.stats.accepted_length > 1.0


# ------------------------------------------------------------------ per-depth calibration


def test_depth_temperature_rescales_marginals_and_keeps_the_argmax(tiny):
    _, cfg, params = tiny
    drafter = block.BlockDrafter(config=cfg)
    ctx = _context(cfg)
    raw = np.asarray(_marginals(drafter, params, ctx))
    temperature = np.asarray([1.0, 2.0, 0.5, 3.0], np.float32)
    scaled = np.asarray(
        _marginals(drafter, block.with_depth_temperature(params, cfg, temperature), ctx)
    )
    d2t = np.asarray(params["d2t"])
    for i, t in enumerate(temperature):
        # raw[i] at the draft ids is log_softmax(z); log_softmax(z / t) follows from it alone
        z = raw[i, d2t] / t
        expected = z - np.logaddexp.reduce(z)
        np.testing.assert_allclose(scaled[i, d2t], expected, atol=1e-5)
        assert np.argmax(scaled[i]) == np.argmax(raw[i])
    with pytest.raises(ValueError, match="one entry per block slot"):
        block.with_depth_temperature(params, cfg, [1.0, 2.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        block.with_depth_temperature(params, cfg, [1.0, 0.0, 1.0, 1.0])


def test_temperature_fit_recovers_known_temperatures():
    """Targets sampled from softmax(z / T) with T = 1 and 2.5: the held-out NLL over the
    grid is lowest within ~10% of the true inverse temperature."""
    rng = np.random.default_rng(0)
    n, v = 4000, 12
    true_t = np.asarray([1.0, 2.5])
    logits = rng.normal(0.0, 2.0, size=(n, 2, v)).astype(np.float32)
    p = np.exp(logits / true_t[None, :, None])
    p /= p.sum(-1, keepdims=True)
    targets = np.stack([[rng.choice(v, p=p[k, i]) for i in range(2)] for k in range(n)]).astype(
        np.int32
    )
    valid = np.ones((n, 2), bool)
    betas = jnp.asarray(train_block.INVERSE_TEMPERATURES, jnp.float32)
    nll, confidence, hit = train_block.temperature_statistics(
        jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(valid), betas
    )
    best = train_block.INVERSE_TEMPERATURES[np.argmin(np.asarray(nll), axis=0)]
    np.testing.assert_allclose(1.0 / best, true_t, rtol=0.1)
    assert confidence.shape == (len(betas), n, 2) and hit.shape == (n, 2)


def test_calibration_error_literal():
    # bin 0.9: accuracy 0.5 vs confidence 0.9; bin 0.1: accuracy 0 vs 0.1; each half the mass
    err = train_block.calibration_error(np.asarray([0.9, 0.9, 0.1, 0.1]), np.asarray([1, 0, 0, 0]))
    assert err == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    assert train_block.calibration_error(np.asarray([0.25, 0.75]), np.asarray([0, 1])) == (
        pytest.approx(0.25)
    )


def test_fit_depth_temperatures_never_worsens_the_held_out_nll():
    cfg, vocab, batches, embed = _fake_setup()
    head = block.init_head(cfg, jax.random.key(0), embed=embed, d2t=vocab.d2t)
    report = train_block.fit_depth_temperatures(head, cfg, embed, batches)
    assert len(report["depth_temperature"]) == cfg.block_size
    assert all(t > 0 and np.isfinite(t) for t in report["depth_temperature"])
    # beta = 1 is on the grid, so the fitted NLL is at most the raw one at every depth
    assert all(a <= b + 1e-6 for a, b in zip(report["nll_after"], report["nll_before"]))
    assert report["predictions"] > 0
    block.with_depth_temperature(
        block.make_params(head, embed, vocab.d2t), cfg, report["depth_temperature"]
    )


def test_after_right_chain_literal():
    hit = jnp.asarray(
        [[True, True, False, True], [False, True, True, True], [True, False, True, False]]
    )
    want = np.asarray(
        [[True, True, True, False], [True, False, False, False], [True, True, False, False]]
    )
    np.testing.assert_array_equal(np.asarray(train_block.after_right_chain(hit)), want)


def test_fit_given_chain_counts_only_predictions_after_a_right_chain():
    cfg, vocab, batches, embed = _fake_setup()
    head = block.init_head(cfg, jax.random.key(0), embed=embed, d2t=vocab.d2t)
    plain = train_block.fit_depth_temperatures(head, cfg, embed, batches)
    chain = train_block.fit_depth_temperatures(head, cfg, embed, batches, given_chain=True)
    # depth 1 has no shallower slot: the same predictions, so the same fit
    assert chain["depth_temperature"][0] == plain["depth_temperature"][0]
    assert chain["nll_before"][0] == pytest.approx(plain["nll_before"][0])
    assert 0 < chain["predictions"] < plain["predictions"]
    assert chain["predictions"] == sum(chain["predictions_by_depth"])
    for seen, t in zip(chain["predictions_by_depth"], chain["depth_temperature"]):
        assert seen > 0 or t == 1.0  # no prediction reached: no evidence, unscaled
    assert all(a <= b + 1e-6 for a, b in zip(chain["nll_after"], chain["nll_before"]))


def test_depth_decay_weighs_each_depths_mean_nll():
    """The loss is ``sum_i decay**i * nll_i``, each ``nll_i`` a mean over depth ``i``'s valid
    targets; the decay reaches the loss through ``TrainConfig.depth_decay``."""
    cfg, vocab, batches, embed = _fake_setup()
    head = block.init_head(cfg, jax.random.key(3), embed=embed, d2t=vocab.d2t)
    rows = np.arange(3)
    tc = train_lib.TrainConfig(steps=1, batch_size=3, seq_len=16, anchors=6, context_window=4)
    arrays = train_block.train_arrays(batches, rows, 0, tc, cfg)
    picked, _, valid = jax.vmap(
        lambda f, tk, tg, an, k, w: train_block.sequence_scores(
            head, cfg, embed, f, tk, tg, an, k, w
        )
    )(*arrays)
    nll = -np.asarray(picked).sum(axis=(0, 1)) / np.asarray(valid).sum(axis=(0, 1))
    assert nll.shape == (cfg.block_size,) and np.all(np.asarray(valid).sum(axis=(0, 1)) > 0)
    for decay in (1.0, 0.8, 0.3):
        got, _ = train_block.loss(
            head, cfg, embed, arrays, dataclasses.replace(tc, depth_decay=decay)
        )
        want = sum(decay**i * nll[i] for i in range(cfg.block_size))
        np.testing.assert_allclose(float(got), want, rtol=1e-5)


@pytest.mark.parametrize("decay", [0.0, -0.5, 1.5, float("nan")])
def test_depth_decay_outside_zero_one_is_refused(decay):
    with pytest.raises(ValueError, match="depth_decay"):
        train_lib.TrainConfig(depth_decay=decay)


def test_all_roots_nll_is_the_mean_depth1_loss_of_a_one_slot_block_at_every_root():
    """Every position is a root that sees only the context before it: scoring a row at once
    equals scoring each root on its own with everything after it replaced by other tokens
    and features (nothing later leaks in), and the positions whose next token is no target
    (the prompt, the padding) are left out."""
    cfg, vocab, batches, embed = _fake_setup()
    head = block.init_head(cfg, jax.random.key(4), embed=embed, d2t=vocab.d2t)
    one = dataclasses.replace(cfg, block_size=1)
    rows = np.arange(3)
    feats, toks, tgts = (
        jnp.asarray(batches.features[rows]),
        jnp.asarray(batches.tokens[rows]),
        jnp.asarray(batches.targets[rows]),
    )
    rng = np.random.default_rng(0)
    # One shape for every root (one compilation): the row at full length, but past the
    # root's target, other tokens, other features and no targets.
    score = jax.jit(
        lambda f, tk, tg, p: train_block.sequence_scores(
            head, one, embed, f, tk, tg, p[None], jnp.asarray([True]), jnp.asarray([0], jnp.int32)
        )
    )
    total, count = 0.0, 0
    for r in rows:
        lo, hi = train_block.anchor_range(int(batches.prompt_lens[r]), int(batches.lengths[r]))
        for p in range(lo, hi):
            if int(tgts[r, p + 1]) < 0:  # next token outside the draft vocabulary
                continue
            later = np.arange(toks.shape[1]) > p + 1
            other_toks = rng.integers(0, embed.shape[0], toks.shape[1])
            other_feats = rng.standard_normal(feats.shape[1:]).astype(feats.dtype)
            picked, _, valid = score(
                jnp.where(later[:, None, None], other_feats, feats[r]),
                jnp.where(later, other_toks, toks[r]).astype(toks.dtype),
                jnp.where(later, -1, tgts[r]).astype(tgts.dtype),
                jnp.int32(p),
            )
            assert bool(valid[0, 0])
            total -= float(picked[0, 0])
            count += 1
    assert count > 20
    got = train_block.all_roots_nll(head, cfg, embed, feats, toks, tgts)
    np.testing.assert_allclose(float(got), total / count, rtol=1e-5)


def test_all_roots_weight_adds_its_weighted_loss_and_leaves_accuracies_alone():
    cfg, vocab, batches, embed = _fake_setup()
    head = block.init_head(cfg, jax.random.key(5), embed=embed, d2t=vocab.d2t)
    tc = train_lib.TrainConfig(steps=1, batch_size=3, seq_len=16, anchors=6)
    arrays = train_block.train_arrays(batches, np.arange(3), 0, tc, cfg)
    base, base_acc = train_block.loss(head, cfg, embed, arrays, tc)
    roots = train_block.all_roots_nll(head, cfg, embed, *(jnp.asarray(a) for a in arrays[:3]))
    got, acc = train_block.loss(
        head, cfg, embed, arrays, dataclasses.replace(tc, all_roots_weight=0.5)
    )
    np.testing.assert_allclose(float(got), float(base) + 0.5 * float(roots), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(acc), np.asarray(base_acc))


@pytest.mark.parametrize("weight", [-0.1, float("nan")])
def test_all_roots_weight_below_zero_is_refused(weight):
    with pytest.raises(ValueError, match="all_roots_weight"):
        train_lib.TrainConfig(all_roots_weight=weight)


def test_a_block_head_goes_on_with_another_block_size_but_no_other_change(tmp_path):
    """``--init-from`` with another ``--block-size``: the same weights (none has a slot axis),
    the change recorded in the provenance; any other config change is still refused."""
    cfg, vocab, _, embed = _fake_setup(block_size=1)
    head = block.init_head(cfg, jax.random.key(6), embed=embed, d2t=vocab.d2t)
    path = tmp_path / "one_slot"
    checkpoint_lib.save_checkpoint(path, head, cfg, vocab.d2t, fingerprint="f" * 64)
    wider = dataclasses.replace(cfg, block_size=4)
    start, provenance = checkpoint_lib.load_starting_head(
        path, config=wider, d2t=vocab.d2t, fingerprint="f" * 64
    )
    assert provenance["block_size"] == {"stored": 1, "now": 4}
    for name in head:
        np.testing.assert_array_equal(np.asarray(start[name]), np.asarray(head[name]))
    other = dataclasses.replace(wider, intermediate_size=cfg.intermediate_size + 1)
    with pytest.raises(ValueError, match="another config"):
        checkpoint_lib.load_starting_head(path, config=other, d2t=vocab.d2t, fingerprint="f" * 64)
    _, same = checkpoint_lib.load_starting_head(
        path, config=cfg, d2t=vocab.d2t, fingerprint="f" * 64
    )
    assert "block_size" not in same


def test_a_deeper_block_head_starts_as_the_stored_one_and_its_new_layer_learns(tmp_path):
    """``--init-from`` with more ``--block-layers``: the stored layers are kept, the new one is
    appended with zero output projections, so the deeper head's loss and accuracies equal the
    stored head's, and the gradient reaches the new layer's output projections."""
    cfg, vocab, batches, embed = _fake_setup()
    head = block.init_head(cfg, jax.random.key(7), embed=embed, d2t=vocab.d2t)
    path = tmp_path / "shallow"
    checkpoint_lib.save_checkpoint(path, head, cfg, vocab.d2t, fingerprint="f" * 64)
    deeper = dataclasses.replace(cfg, num_layers=cfg.num_layers + 1)
    fresh = block.init_head(deeper, jax.random.key(8), embed=embed, d2t=vocab.d2t)
    with pytest.raises(ValueError, match="fresh head"):
        checkpoint_lib.load_starting_head(path, config=deeper, d2t=vocab.d2t, fingerprint="f" * 64)
    start, provenance = checkpoint_lib.load_starting_head(
        path, config=deeper, d2t=vocab.d2t, fingerprint="f" * 64, fresh_head=fresh
    )
    assert provenance["num_layers"] == {"stored": 1, "now": 2}
    for name in block.LAYER_KEYS:
        np.testing.assert_array_equal(np.asarray(start[name][0]), np.asarray(head[name][0]))
        want = np.zeros_like(fresh[name][1]) if name in ("wo", "w_down") else fresh[name][1]
        np.testing.assert_array_equal(np.asarray(start[name][1]), np.asarray(want))
    tc = train_lib.TrainConfig(steps=1, batch_size=3, seq_len=16, anchors=6)
    arrays = train_block.train_arrays(batches, np.arange(3), 0, tc, cfg)
    loss, acc = train_block.loss(head, cfg, embed, arrays, tc)
    grown_loss, grown_acc = train_block.loss(start, deeper, embed, arrays, tc)
    np.testing.assert_allclose(float(grown_loss), float(loss), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grown_acc), np.asarray(acc))
    grads = jax.grad(lambda h: train_block.loss(h, deeper, embed, arrays, tc)[0])(start)
    for name in ("wo", "w_down"):
        assert float(jnp.abs(grads[name][1]).max()) > 0.0
