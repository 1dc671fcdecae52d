"""The draft-or-not controller (policy "auto", the default) through the whole engine.

On a tiny random teacher: a drafter that never matches is soon switched off (the drafter
does not even run, apart from rare exploration probes); an oracle drafter speculates every
round; outputs stay equal to plain greedy whatever the latency curve, NaN included; new
values (seed, temperature, top-p, eos id, max_new_tokens, latency curve) reuse the compiled
loop; NaN statistics fall back to plain decoding; sampling stays exact (chi-square against
the teacher's own law, with negative controls).

Compilation dominates the run time, so the tests share a few compiled loops: one teacher,
one tree shape, and one drafter class (:class:`TableDrafter`) whose proposals come from its
``draft_params`` (a traced table), so the never-matching and the oracle drafter are the same
compiled program.
"""

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from eaglepangu_jax import draft_control, engine
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.drafters import NGramDrafter
from eaglepangu_jax.engine import decode as gen
from eaglepangu_jax.engine import step
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.drafter import Proposal, StatelessDrafter
from eaglepangu_jax.evaluation.run import CompileWatch
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.init import random_params

CFG = LlamaConfig.tiny(vocab_size=61, num_layers=1, max_position=256)
BUDGET, DEPTH = 3, 3
NO_EOS = -7  # an id the vocabulary never produces, so runs last max_new_tokens
NEW = 200
WARM_UP = 40  # rounds the controller may spend learning before it is judged
PROMPT = [5, 9, 14, 3, 22, 7, 40, 11]
REPETITIVE = [7, 8, 9] * 5
# One-slot verify 20 ms, a 4-slot bucket 1.6x: a realistic shape.
CURVE = jnp.asarray([1.0, 1.6, 1.6, 1.6], jnp.float32) * 0.02
DRAFT_SECONDS = 0.005


def spec(**kw):
    base = dict(budget=BUDGET, depth=DEPTH, max_new_tokens=NEW, eos_id=NO_EOS)
    return SpecConfig(**{**base, **kw})


def test_auto_is_the_default_policy():
    assert SpecConfig().policy == "auto"
    static = step.StepStatic(teacher=CFG, drafter=NGramDrafter(), spec=SpecConfig(), window=256)
    assert static.controlled


@pytest.fixture(scope="module")
def teacher():
    # Larger-than-default weights so the random teacher's greedy output is not a constant.
    params = random_params(CFG, jax.random.key(3))
    params = jax.tree_util.tree_map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)
    return engine.Teacher(CFG, params)


@pytest.fixture(scope="module")
def greedy(teacher):
    """Plain greedy continuation of a prompt (one compiled loop for every prompt)."""

    @functools.cache
    def run(prompt: tuple[int, ...], new: int = NEW) -> list[int]:
        out = engine.generate(teacher, None, list(prompt), spec(max_new_tokens=new)).tokens
        assert len(out) == new
        return out

    return run


# ------------------------------------------------------------------ a drafter from a table

CALLS: list[int] = []  # context.num_tokens of every TableDrafter.propose that ran


def _record(num_tokens):
    CALLS.append(int(num_tokens))


@dataclasses.dataclass(frozen=True)
class TableDrafter(StatelessDrafter):
    """Proposes a chain of ``depth`` tokens read from its ``draft_params``: a ``[T]`` table
    indexed by the number of tokens generated so far (the oracle: the teacher's own greedy
    continuation; the never-matching drafter: a token greedy never emits). Every chain node
    claims probability 1 (logscore 0): badly calibrated for the never-matching table.
    Each call is recorded on the host (``CALLS``), so a test sees when the drafter ran."""

    prompt_len: int
    budget: int = BUDGET
    depth: int = DEPTH
    name: str = "table"

    def propose(self, params, state, context, key):
        jax.debug.callback(_record, context.num_tokens)
        slots = self.budget + 1
        done = context.num_tokens - self.prompt_len
        chain = jax.lax.dynamic_slice(params, (done,), (self.depth,))
        index = jnp.arange(slots, dtype=jnp.int32)
        tokens = jnp.zeros((slots,), jnp.int32).at[1 : self.depth + 1].set(chain)
        tree = tree_lib.from_parents(
            jnp.maximum(index - 1, 0),
            tokens=tokens,
            valid=index <= self.depth,
            logscore=jnp.zeros((slots,), jnp.float32),
            max_depth=self.depth,
        )
        return Proposal(tree=tree)


TABLE = TableDrafter(prompt_len=len(PROMPT))
TABLE_SIZE = 256  # >= NEW + DEPTH: dynamic_slice never clamps inside a run


def table(tokens):
    out = np.zeros((TABLE_SIZE,), np.int32)
    out[: len(tokens)] = tokens
    return jnp.asarray(out)


def calls_during(run):
    """Run ``run()``; return its result and the drafter calls it made, each as the number of
    tokens generated before the call."""
    CALLS.clear()
    result = run()
    jax.effects_barrier()
    return result, [n - len(PROMPT) for n in CALLS]


def drafted_rounds(result, calls):
    """The rounds of ``result`` in which the drafter ran (``calls`` from :func:`calls_during`)."""
    emitted = np.asarray(result.stats.accepted_per_round) + 1
    starts = (np.cumsum(emitted) - emitted).tolist()  # tokens generated before each round
    assert set(calls) <= set(starts)
    return sorted(starts.index(c) for c in calls)


def speculated(result):
    return [n > 0 for n in result.stats.nodes_per_round]


def only_probes(spec_rounds):
    """True when every round that verified nodes was an exploration probe: it came at least
    ``min_backoff`` plain rounds after the previous one (or after the start)."""
    rounds = [-1] + [i for i, s in enumerate(spec_rounds) if s]
    gap = draft_control.ControlConfig().min_backoff + 1
    return all(b - a >= gap for a, b in zip(rounds, rounds[1:]))


# ------------------------------------------------------------------ 1, 2: never vs oracle


def test_never_matching_drafter_is_switched_off(teacher, greedy):
    plain = greedy(tuple(PROMPT))
    unused = sorted(set(range(CFG.vocab_size)) - set(plain))
    assert unused, "plain greedy emitted every token: no never-matching token"
    never = table([unused[0]] * TABLE_SIZE)

    result, calls = calls_during(
        lambda: engine.generate(
            teacher,
            TABLE,
            PROMPT,
            spec(),
            draft_params=never,
            verify_latency=CURVE,
            draft_seconds=DRAFT_SECONDS,
        )
    )
    assert result.tokens == plain
    assert result.stats.rounds == NEW  # nothing was ever accepted: one token per round
    assert sum(result.stats.accepted_per_round) == 0
    spec_rounds = speculated(result)
    assert spec_rounds[0], "the optimistic start must try the drafter"
    late = spec_rounds[WARM_UP:]
    assert sum(late) < 0.1 * len(late), f"speculated in {sum(late)} of {len(late)} rounds"
    assert sum(late) >= 1, "exploration probes must keep retrying the drafter"
    # Rounds that did not draft did not run the drafter at all (lax.cond): it ran only in
    # the rounds that verified nodes (and maybe a few whose tree the controller emptied).
    drafted = drafted_rounds(result, calls)
    assert {i for i, s in enumerate(spec_rounds) if s} <= set(drafted)
    late_calls = [i for i in drafted if i >= WARM_UP]
    assert len(late_calls) < 0.1 * (NEW - WARM_UP)


def test_oracle_drafter_speculates_every_round(teacher, greedy):
    truth = greedy(tuple(PROMPT), NEW + DEPTH + 1)
    result, calls = calls_during(
        lambda: engine.generate(
            teacher,
            TABLE,
            PROMPT,
            spec(),
            draft_params=table(truth),
            verify_latency=CURVE,
            draft_seconds=DRAFT_SECONDS,
        )
    )
    assert result.tokens == truth[:NEW] == greedy(tuple(PROMPT))
    assert all(speculated(result))
    assert all(a == DEPTH for a in result.stats.accepted_per_round)
    assert result.stats.rounds == math.ceil(NEW / (DEPTH + 1))
    assert drafted_rounds(result, calls) == list(range(result.stats.rounds))


@pytest.mark.parametrize("oracle", [False, True], ids=["never", "oracle"])
def test_free_drafter_proposes_every_round_and_the_budget_decides(teacher, greedy, oracle):
    """Drafting at no cost (the n-gram drafter's lookup is ~1% of a step): the drafter runs in
    every round, so no match is missed by deciding too early. The node budget, on the
    calibrated scores, then decides what is verified: the never-matching drafter still
    verifies nodes only in rare probes, the oracle in every round."""
    assert bool(draft_control.drafts_freely(draft_control.ControlConfig(), CURVE, 0.0))
    truth = greedy(tuple(PROMPT), NEW + DEPTH + 1)
    plain = greedy(tuple(PROMPT))
    unused = sorted(set(range(CFG.vocab_size)) - set(plain))
    params = table(truth) if oracle else table([unused[0]] * TABLE_SIZE)
    result, calls = calls_during(
        lambda: engine.generate(
            teacher, TABLE, PROMPT, spec(), draft_params=params, verify_latency=CURVE
        )
    )
    assert result.tokens == plain
    assert drafted_rounds(result, calls) == list(range(result.stats.rounds))
    spec_rounds = speculated(result)
    if oracle:
        assert all(spec_rounds)
        assert all(a == DEPTH for a in result.stats.accepted_per_round)
    else:
        late = spec_rounds[WARM_UP:]
        assert spec_rounds[0], "the drafter's own scores are trusted at first"
        assert sum(late) < 0.1 * len(late), f"speculated in {sum(late)} of {len(late)} rounds"
        assert sum(late) >= 1, "exploration probes must keep retrying the drafter"


@dataclasses.dataclass(frozen=True)
class EveryRoundTable(TableDrafter):
    """The table drafter declaring that the controller must let it propose every round."""

    proposes_every_round: bool = True


def test_a_costly_drafter_that_proposes_every_round_runs_in_every_round(teacher, greedy):
    """``proposes_every_round`` (the n-gram + head pair): at a drafting cost the gate would
    weigh, the drafter still runs in every round, and the node budget decides what is
    verified: the never-matching table verifies nodes only in rare probes, as the free
    drafter does, where without the flag it would not even run (the first test above)."""
    plain = greedy(tuple(PROMPT))
    unused = sorted(set(range(CFG.vocab_size)) - set(plain))
    drafter = EveryRoundTable(prompt_len=len(PROMPT))
    assert not bool(
        draft_control.drafts_freely(draft_control.ControlConfig(), CURVE, DRAFT_SECONDS)
    )
    result, calls = calls_during(
        lambda: engine.generate(
            teacher,
            drafter,
            PROMPT,
            spec(),
            draft_params=table([unused[0]] * TABLE_SIZE),
            verify_latency=CURVE,
            draft_seconds=DRAFT_SECONDS,
        )
    )
    assert result.tokens == plain
    assert drafted_rounds(result, calls) == list(range(result.stats.rounds))
    late = speculated(result)[WARM_UP:]
    assert sum(late) < 0.1 * len(late), f"speculated in {sum(late)} of {len(late)} rounds"
    assert sum(late) >= 1, "exploration probes must keep retrying the drafter"


def test_a_drafter_that_cannot_pay_even_as_an_oracle_never_runs(teacher, greedy):
    """Drafting that costs more than ``DEPTH`` accepted tokens save (the truncated-teacher
    draft on this machine class): the call decodes plainly and never runs the drafter, not
    even as a probe, though it would be perfect. Just below the threshold it does run."""
    truth = greedy(tuple(PROMPT), NEW + DEPTH + 1)
    latency = np.asarray(CURVE)
    threshold = (1 + DEPTH) * latency[0] - latency[DEPTH]  # the oracle's break-even t_draft
    assert not gen.speculation_hopeless(spec(), CURVE, 0.99 * threshold)
    assert gen.speculation_hopeless(spec(), CURVE, 1.01 * threshold)
    assert not gen.speculation_hopeless(spec(), jnp.full_like(CURVE, jnp.nan), 1.0)
    assert not gen.speculation_hopeless(spec(policy="drafter"), CURVE, 1.0)
    for t_draft, hopeless in [(1.01 * threshold, True), (0.9 * threshold, False)]:
        run = functools.partial(
            engine.generate,
            teacher,
            TABLE,
            PROMPT,
            spec(max_new_tokens=40),
            draft_params=table(truth),
            verify_latency=CURVE,
            draft_seconds=float(t_draft),
        )
        result, calls = calls_during(run)
        assert result.tokens == truth[:40]
        assert (calls == []) == hopeless
        assert any(n > 0 for n in result.stats.nodes_per_round) != hopeless


# ------------------------------------------------------------------ 3: lossless, any curve

NGRAM = NGramDrafter(budget=BUDGET, depth=DEPTH, num_matches=4)
CURVES = {
    "realistic": (CURVE, DRAFT_SECONDS),
    "never-pays": (jnp.asarray([0.02, 10.0, 10.0, 10.0], jnp.float32), DRAFT_SECONDS),
    "always-pays": (jnp.asarray([1.0, 0.01, 0.01, 0.01], jnp.float32), 0.0),
    "nan": (jnp.full((BUDGET + 1,), jnp.nan, jnp.float32), DRAFT_SECONDS),
}


@pytest.mark.parametrize("curve", list(CURVES))
def test_ngram_under_auto_equals_greedy(teacher, greedy, curve):
    latency, t_draft = CURVES[curve]
    result = engine.generate(
        teacher, NGRAM, REPETITIVE, spec(), verify_latency=latency, draft_seconds=t_draft
    )
    assert result.tokens == greedy(tuple(REPETITIVE))
    spec_rounds = speculated(result)
    if curve == "always-pays":
        late = spec_rounds[WARM_UP:]
        assert sum(late) > 0.5 * len(late), "the n-gram drafter matches most rounds"
        assert sum(result.stats.accepted_per_round) > 0, "nothing accepted: a vacuous test"
    if curve == "never-pays":
        # Prohibitive costs: not even an oracle could pay, so not even a probe is made.
        assert gen.speculation_hopeless(spec(), latency, t_draft)
        assert not any(spec_rounds)
    if curve == "nan":
        # Unknown costs: plain rounds, apart from exploration probes.
        assert only_probes(spec_rounds)
        assert any(spec_rounds), "the probes verify the drafter's best nodes"


def test_nan_latency_curve_falls_back_to_plain(teacher, greedy):
    truth = greedy(tuple(PROMPT), NEW + DEPTH + 1)
    result, calls = calls_during(
        lambda: engine.generate(
            teacher,
            TABLE,
            PROMPT,
            spec(),
            draft_params=table(truth),
            verify_latency=CURVES["nan"][0],
            draft_seconds=DRAFT_SECONDS,
        )
    )
    assert result.tokens == greedy(tuple(PROMPT))
    # Unknown costs: plain rounds except the probes, however well the probes go.
    spec_rounds = speculated(result)
    assert only_probes(spec_rounds)
    assert sum(result.stats.accepted_per_round) > 0
    # The drafter ran only in those rounds.
    assert drafted_rounds(result, calls) == [i for i, s in enumerate(spec_rounds) if s]


# ------------------------------------------------------------------ 4: no recompiles


def compile_events(runs):
    """Compilation events recorded while running every thunk in ``runs``: backend compiles
    (``/jax/core/compile/backend_compile_duration``) and also tracing and lowering, which a
    reused loop needs neither."""
    with CompileWatch().active() as watch:
        for run in runs:
            run()
    return len(watch.events)


def assert_values_reuse_the_loop(generate_with, variants):
    generate_with()  # compiles
    assert compile_events([functools.partial(generate_with, **v) for v in variants]) == 0


def test_values_do_not_recompile_greedy(teacher):
    def run(**kw):
        return engine.generate(teacher, None, PROMPT, spec(**{"max_new_tokens": 20, **kw}))

    assert_values_reuse_the_loop(
        run, [dict(seed=5), dict(eos_id=44), dict(max_new_tokens=37), dict(eos_id=None)]
    )


def test_values_do_not_recompile_sampling(teacher):
    def run(**kw):
        values = dict(acceptance="sample", temperature=0.7, max_new_tokens=20)
        return engine.generate(teacher, None, PROMPT, spec(**{**values, **kw}))

    assert_values_reuse_the_loop(
        run,
        [
            dict(seed=5),
            dict(temperature=1.3),
            dict(top_p=0.8),
            dict(eos_id=44),
            dict(max_new_tokens=33, seed=2, temperature=0.2, top_p=0.5),
        ],
    )


def test_values_do_not_recompile_with_drafter_under_auto(teacher):
    def run(latency=CURVE, t_draft=DRAFT_SECONDS, **kw):
        return engine.generate(
            teacher,
            NGRAM,
            REPETITIVE,
            spec(**{"max_new_tokens": 20, **kw}),
            verify_latency=latency,
            draft_seconds=t_draft,
        )

    # The nominal curve's own (eager) arithmetic compiles on first use: not the loop.
    gen.nominal_verify_latency(CFG, spec(), len(REPETITIVE) - 1)
    assert_values_reuse_the_loop(
        run,
        [
            dict(seed=5),
            dict(eos_id=44),
            dict(max_new_tokens=45),
            dict(latency=CURVES["always-pays"][0], t_draft=0.0),
            dict(latency=None),  # the nominal roofline's curve: same shape
        ],
    )


# ------------------------------------------------------------------ 5: NaN statistics


# Jitted exactly as the engine jits it, so JAX reuses the loop generate already compiled.
run_rounds = jax.jit(step.run_rounds, static_argnums=(0,), donate_argnums=(3,))


def rounds_from(teacher, truth, new, **control):
    """Run the oracle drafter's loop (``run_rounds``) from a fresh state whose controller
    statistics have the given fields replaced; return the final state and the drafter calls."""
    run_spec = spec(max_new_tokens=new)
    capacity = gen.cache_slots(len(PROMPT), run_spec, CFG.max_position)
    state = gen.init_state(
        teacher, TABLE, table(truth), PROMPT, run_spec, capacity=capacity, key=jax.random.key(0)
    )
    assert isinstance(state.control, draft_control.AcceptanceStats)
    state = dataclasses.replace(state, control=dataclasses.replace(state.control, **control))
    window = gen.window_for(len(PROMPT) + BUDGET + 1, capacity)
    static = step.StepStatic(teacher=CFG, drafter=TABLE, spec=run_spec, window=window)
    out, calls = calls_during(
        lambda: run_rounds(
            static,
            teacher.params,
            table(truth),
            state,
            jnp.int32(window),
            CURVE,
            jnp.float32(DRAFT_SECONDS),
        )
    )
    assert bool(out.done)
    tokens = np.asarray(out.tokens)[len(PROMPT) : int(out.num_tokens)].tolist()
    assert tokens[:new] == truth[:new]
    return out, calls


def nan_statistics(stats_like):
    # Separate buffers: the loop donates its state.
    return dict(
        trials=jnp.full_like(stats_like.trials, jnp.nan),
        hits=jnp.full_like(stats_like.hits, jnp.nan),
        accepted_ema=jnp.float32(jnp.nan),
        nodes_ema=jnp.float32(jnp.nan),
        top_ema=jnp.float32(jnp.nan),
    )


FRESH = draft_control.AcceptanceStats.create(draft_control.ControlConfig())


@pytest.mark.parametrize("due", [False, True])
def test_nan_statistics_mean_plain_rounds_until_a_probe(teacher, greedy, due):
    """NaN statistics: plain rounds (the drafter idle) until the back-off runs out; the
    probe's observation restarts the statistics, and the oracle then speculates again."""
    truth = greedy(tuple(PROMPT), NEW + DEPTH + 1)
    wait = int(FRESH.backoff)
    out, calls = rounds_from(
        teacher,
        truth,
        40,
        **nan_statistics(FRESH),
        rounds_since_draft=jnp.int32(wait if due else 0),
    )
    rounds = int(out.rounds)
    nodes = np.asarray(out.nodes_log)[:rounds]
    first_probe = 0 if due else wait
    assert (nodes[:first_probe] == 0).all(), "NaN statistics must not speculate"
    assert (nodes[first_probe:] > 0).all(), "the probe restarts the statistics"
    assert min(calls) == first_probe  # the drafter did not run before the probe
    assert len(calls) == rounds - first_probe
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out.control))


def test_an_out_of_range_backoff_still_probes_within_max_backoff(teacher, greedy):
    """A stored back-off beyond ``max_backoff`` (corrupt or hand-made state) is read as
    ``max_backoff``, as :func:`draft_control.should_draft` reads it: the drafter is retried
    within ``max_backoff + 1`` rounds."""
    truth = greedy(tuple(PROMPT), NEW + DEPTH + 1)
    limit = draft_control.ControlConfig().max_backoff
    out, _ = rounds_from(teacher, truth, limit + 20, **nan_statistics(FRESH), backoff=2**30)
    nodes = np.asarray(out.nodes_log)[: int(out.rounds)]
    assert (nodes[: limit + 1] > 0).any()


# ------------------------------------------------------------------ 6: exact sampling

V = 8
SMALL = LlamaConfig.tiny(vocab_size=V, num_layers=1, max_position=256)
# After "1 3" the n-gram drafter proposes 3 and 2, which this teacher samples about half of
# the time: both accepted and rejected drafts are common.
SAMPLE_PROMPT = [1, 3, 3, 1, 3, 2, 1, 3, 3, 1, 3]
SAMPLES = 3000
CHUNK = 100  # streams decoded together; generate_batch of CHUNK prompts reuses the loop
PASS_P = 1e-3
CONTROL_P = 1e-6
MIN_EXPECTED = 5.0  # chi-square cells with a smaller expected count are pooled
SAMPLE_BUDGET = 4
# With drafting costing 6% of a plain step (above the controller's free share, so the gate
# decides): round 1 pays (accepted_ema and top_ema start at 1, nodes_ema at 4: 2 T[0] >
# t_draft + T[4], and > t_draft + T[1]) and keeps up to 3 nodes (one price on this curve);
# after a rejection (accepted_ema and top_ema 0.5) speculation no longer pays, neither the
# average round nor one node (1.5 T[0] < t_draft + T[1]), so round 2 is plain: what the
# controller does depends on what was sampled before. With drafting free, the drafter
# proposes every round instead and the node budget decides.
SAMPLE_CURVE = jnp.asarray([1.0, 1.5, 1.5, 1.5, 1.9], jnp.float32) * 0.01
SAMPLE_GATED_DRAFT = 0.0006
SAMPLE_NGRAM = NGramDrafter(budget=SAMPLE_BUDGET, depth=2, num_matches=4)
SAMPLE_SPEC = SpecConfig(
    budget=SAMPLE_BUDGET,
    depth=2,
    acceptance="sample",
    temperature=1.0,
    max_new_tokens=2,
    eos_id=NO_EOS,
)


@pytest.fixture(scope="module")
def small_params():
    params = random_params(SMALL, jax.random.key(7))
    # Flatter logits (see test_engine_sampling): many two-token cells with real mass.
    return dict(params, final_norm=params["final_norm"] * 0.07)


@jax.jit
def _logits_all(params, tokens):
    """Logits ``[B, T, V]`` of a batch of whole sequences, each from an empty cache."""
    return jax.vmap(lambda seq: llama.forward_sequence(params, seq, config=SMALL)[0])(tokens)


def two_token_law(params, temperature):
    """``[V, V]`` exact law of the first two sampled tokens (float64)."""
    seqs = np.asarray([SAMPLE_PROMPT + [a] for a in range(V)], np.int32)
    logits = np.asarray(_logits_all(params, jnp.asarray(seqs)), np.float64)
    p = len(SAMPLE_PROMPT)

    def softmax(z):
        z = z / temperature
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    return softmax(logits[0, p - 1])[:, None] * softmax(logits[:, p])


def p_value(samples, law):
    """Chi-square p-value of two-token samples against ``law``; rare cells are pooled by
    first token, and what is still rare into one cell."""
    seqs = np.asarray(samples)
    assert seqs.shape == (len(samples), 2)
    cell_of = np.full(law.shape, -1)
    probs = []
    pending = law > 0
    for k in (2, 1, 0):
        groups = collections.defaultdict(list)
        for cell in zip(*np.nonzero(pending)):
            groups[cell[:k]].append(cell)
        for members in groups.values():
            mass = sum(law[c] for c in members)
            if mass * len(samples) >= MIN_EXPECTED or k == 0:
                for c in members:
                    cell_of[c] = len(probs)
                    pending[c] = False
                probs.append(mass)
    probs = np.asarray(probs)
    assert len(probs) > 20, "too few cells for a meaningful test"
    observed = np.bincount(cell_of[tuple(seqs.T)], minlength=len(probs))
    return chisquare(observed, probs / probs.sum() * len(samples)).pvalue


@pytest.mark.parametrize("draft_seconds", [SAMPLE_GATED_DRAFT, 0.0], ids=["gated", "free"])
def test_sampling_under_auto_is_exact(small_params, draft_seconds):
    teacher = engine.Teacher(SMALL, small_params)
    assert SAMPLE_SPEC.policy == "auto"
    costs = dict(verify_latency=SAMPLE_CURVE, draft_seconds=draft_seconds)
    config = draft_control.ControlConfig()
    free = bool(draft_control.drafts_freely(config, SAMPLE_CURVE, draft_seconds))
    assert free == (draft_seconds == 0.0)
    samples = engine.sample_many(
        teacher, SAMPLE_NGRAM, SAMPLE_PROMPT, SAMPLE_SPEC, SAMPLES, chunk=CHUNK, **costs
    )
    # The same streams through generate_batch, for the statistics: drafts were both accepted
    # and rejected, and under the gate the controller mixed speculative and plain rounds.
    runs = engine.generate_batch(
        teacher, SAMPLE_NGRAM, [SAMPLE_PROMPT] * CHUNK, SAMPLE_SPEC, **costs
    )
    assert [r.tokens for r in runs] == samples[:CHUNK]
    assert all(r.stats.nodes_per_round[0] > 0 for r in runs), "round 1 must speculate"
    accepted = [r.stats.accepted_per_round[0] > 0 for r in runs]
    assert 0.1 < np.mean(accepted) < 0.9
    second = [r.stats.nodes_per_round[1:] for r in runs if len(r.stats.nodes_per_round) > 1]
    assert second
    if not free:
        assert all(n == (0,) for n in second), "after a rejection round 2 is plain"

    law = two_token_law(small_params, 1.0)
    assert abs(law.sum() - 1.0) < 1e-9
    assert p_value(samples, law) > PASS_P
    # Negative controls: the same test rejects these samples against the law at another
    # temperature, and i.i.d. draws of that law against the right one.
    wrong = two_token_law(small_params, 0.7)
    assert p_value(samples, wrong) < CONTROL_P
    draws = np.random.default_rng(0).choice(V * V, size=SAMPLES, p=wrong.ravel() / wrong.sum())
    assert p_value(np.stack(np.unravel_index(draws, (V, V)), axis=1), law) < CONTROL_P
    right = np.random.default_rng(0).choice(V * V, size=SAMPLES, p=law.ravel() / law.sum())
    assert p_value(np.stack(np.unravel_index(right, (V, V)), axis=1), law) > PASS_P
