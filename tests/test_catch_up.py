"""Deferred drafter updates under the controller: a stateful drafter does not run in plain
rounds, keeps the teacher features in a backlog, and catches up exactly when it drafts.

On a tiny random teacher with a random EAGLE-3 head and the teacher itself as a draft-target
draft, under policy "auto" with a latency curve that makes speculation look ruinous (so most
rounds are plain steps and only exploration probes draft):

* a plain round leaves the drafter's state untouched (the drafter did not run);
* after every round, catching up gives the drafter state built from scratch on the committed
  tokens (EAGLE-3: from a fresh prefill's features; draft-target: from a fresh prefill);
* the backlog filled up and was flushed (a catch-up longer than one round's ``D + 1`` rows),
  and the output equals plain greedy decoding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_eagle3_head

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import draft_control, engine
from eaglepangu_jax.drafters import draft_target, eagle3
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.step import StepStatic, catch_up, feature_rows, speculative_step
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, num_layers=2, max_position=256)
BUDGET, DEPTH, NEW = 4, 3, 40
PROMPT = [5, 9, 14, 3, 22, 7, 40, 11, 5, 9]
# One-slot verify 20 ms, anything wider ruinous: only exploration probes draft.
RUINOUS = jnp.asarray([0.02] + [1e3] * BUDGET, jnp.float32)
# Drafting at a quarter of a plain step: not free, so the controller's gate decides (a free
# drafter would propose, and so catch up, every round).
DRAFT_COST = jnp.float32(0.005)
# A small backlog so that a run of plain rounds fills it and forces a flush.
CONTROL = draft_control.ControlConfig(backlog_rows=8)


@pytest.fixture(scope="module")
def teacher():
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return engine.Teacher(CFG, params)


def eagle3_drafter(teacher):
    head_cfg, head_params = random_eagle3_head(CFG, teacher.params["embed"], stride=5)
    drafter = eagle3.Eagle3Drafter(config=head_cfg, budget=BUDGET, depth=DEPTH, top_k=2)
    return drafter, head_params


def draft_target_drafter(teacher):
    drafter = draft_target.DraftTargetDrafter(
        config=CFG, teacher_config=CFG, budget=BUDGET, depth=DEPTH, top_k=1
    )
    return drafter, teacher.params


def rebuilt_eagle3(teacher, drafter, params, state, spec):
    """The head's state built from scratch: a fresh prefill's features of every committed
    position, handed to init_state."""
    n = int(state.num_tokens)
    tokens = np.asarray(state.tokens[: n - 1])
    kv = cache_lib.init(CFG.num_layers, 128, CFG.num_kv_heads, CFG.head_dim)
    _, features = gen.prefill(
        teacher.params, CFG, tokens, kv, feature_layers=drafter.feature_layers
    )
    context = state.context(spec.draft_window)
    context = type(context)(
        tokens=context.tokens,
        num_tokens=context.num_tokens,
        features=features,
        num_features=jnp.int32(n - 1),
        start=context.start,
    )
    return jax.jit(drafter.init_state)(params, context)


def assert_same_drafter_state(kind, ours, fresh, n):
    # The rebuilt state reads features from a prefill, ours from the verify forwards: the
    # same values up to float32 summation order (activations reach ~1e3 with these weights,
    # so the tolerance is relative). A wrong or missing row differs by O(1) relatively.
    if kind == "eagle3":
        first, length = int(fresh.first), int(fresh.length)
        assert int(ours.length) == length == n - 1
        close = dict(rtol=2e-3, atol=1e-2)
        np.testing.assert_allclose(ours.k[first:length], fresh.k[first:length], **close)
        np.testing.assert_allclose(ours.v[first:length], fresh.v[first:length], **close)
        np.testing.assert_allclose(ours.last_hidden, fresh.last_hidden, **close)
    else:
        assert int(ours.cache.length) == int(fresh.cache.length) == n
        np.testing.assert_allclose(ours.cache.k[:, :n], fresh.cache.k[:, :n], rtol=2e-3, atol=1e-2)
        np.testing.assert_allclose(ours.logits, fresh.logits, rtol=2e-3, atol=1e-2)


@pytest.mark.parametrize("kind", ["eagle3", "draft-target"])
def test_plain_rounds_defer_the_update_and_catching_up_is_exact(teacher, kind):
    make = eagle3_drafter if kind == "eagle3" else draft_target_drafter
    drafter, params = make(teacher)
    spec = SpecConfig(budget=BUDGET, depth=DEPTH, max_new_tokens=NEW, eos_id=-7, control=CONTROL)
    capacity = gen.cache_slots(len(PROMPT), spec, CFG.max_position)
    state = gen.init_state(
        teacher, drafter, params, PROMPT, spec, capacity=capacity, key=jax.random.key(0)
    )
    static = StepStatic(teacher=CFG, drafter=drafter, spec=spec, window=capacity)
    # The engine sizes the feature buffer from the spec's ControlConfig (this test's smaller
    # backlog).
    assert state.features.shape[0] == feature_rows(spec, True, CONTROL)
    step = jax.jit(speculative_step, static_argnums=0)
    settle = jax.jit(catch_up, static_argnums=0)
    plain = flushes = 0
    while not bool(state.done):
        before = state
        state, info = step(static, teacher.params, params, state, RUINOUS, DRAFT_COST)
        pending = int(state.num_features)
        if int(info.num_nodes) == 0 and pending > int(before.num_features):
            # A plain round that did not flush: the drafter's state is bit-for-bit the same.
            plain += 1
            jax.tree.map(np.testing.assert_array_equal, before.drafter_state, state.drafter_state)
        elif int(info.num_nodes) == 0:
            flushes += 1  # the backlog was full: a catch-up longer than D + 1 rows ran
        ours = settle(static, params, state).drafter_state
        n = int(state.num_tokens)
        if kind == "eagle3":
            fresh = rebuilt_eagle3(teacher, drafter, params, state, spec)
        else:
            fresh = jax.jit(drafter.init_state)(params, state.context(spec.draft_window))
        assert_same_drafter_state(kind, ours, fresh, n)
    assert plain > 10, plain
    assert flushes >= 1, "the backlog never filled up"
    reference = engine.generate(teacher, None, PROMPT, spec).tokens
    tokens = np.asarray(state.tokens[len(PROMPT) : int(state.num_tokens)]).tolist()
    assert tokens[:NEW] == reference
