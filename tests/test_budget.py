"""Roofline costs, calibration, the budget stopping rule and the online correction."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from eaglepangu_jax import budget as B
from eaglepangu_jax.models.config import LlamaConfig

# Tiny config (L=3, h=32, h_q=32, h_kv=16, f=64, V=97) on a 1 GFLOP/s, 100 MB/s machine: with
# TRUTH, forwards of up to 15-27 tokens are memory-bound, larger ones compute-bound, so both
# regimes show up in samples.
TINY = B.Roofline.for_llama(LlamaConfig.tiny(), peak_flops=1e9, bandwidth=1e8)
TRUTH = B.Calibration(
    a_c=jnp.float32(2.0), b_c=jnp.float32(5e-5), a_m=jnp.float32(1.5), b_m=jnp.float32(1e-4)
)


def grid():
    s, c = np.meshgrid(np.arange(1, 129, 3), [0, 64, 200])
    return s.ravel().astype(np.float64), c.ravel().astype(np.float64)


def coeffs(calib):
    return np.asarray([calib.a_c, calib.b_c, calib.a_m, calib.b_m], np.float64)


# ------------------------------------------------------------------ roofline


def test_roofline_literal_counts():
    assert (TINY.num_layers, TINY.hidden, TINY.q_width, TINY.kv_width, TINY.ffn, TINY.vocab) == (
        3,
        32,
        32,
        16,
        64,
        97,
    )
    # s=2, c=3. Per layer 2*2*32*32 + 4*2*32*16 + 4*2*5*32 + 2*2*32*32 + 6*2*32*64 = 38144;
    # 3 layers + lm head 2*2*32*97 = 126848.
    np.testing.assert_allclose(TINY.flops(2, 3), 126848, rtol=1e-6)
    # Weights 4*(2*97*32 + 3*(2*32*32 + 2*32*16 + 3*32*64)) = 135424; KV 4*3*(2*3*16 + 2*2*16)
    # = 1920; activations 4*2*(3*(64 + 64 + 32 + 128) + 97) = 7688.
    np.testing.assert_allclose(TINY.bytes(2, 3), 135424 + 1920 + 7688, rtol=1e-6)


def test_roofline_is_vectorised_and_jittable():
    s, c = grid()
    flops = jax.jit(TINY.flops)(s, c)
    for i in (0, 7, len(s) - 1):
        np.testing.assert_allclose(flops[i], TINY.flops(float(s[i]), float(c[i])), rtol=1e-6)
    assert TINY.bytes(s, c).shape == s.shape


def test_roofline_rejects_non_positive_figures():
    with pytest.raises(ValueError, match="peak_flops"):
        dataclasses.replace(TINY, peak_flops=0.0)
    with pytest.raises(TypeError):
        B.Roofline(3, 32, 32, 16, 64, 97, 4, 1e9, 1e9)  # keyword-only


def test_latency_is_the_max_of_the_branches_and_jits():
    s, c = grid()
    got = jax.jit(B.latency, static_argnums=0)(TINY, TRUTH, s, c)
    compute = 2.0 * TINY.flops(s, c) / 1e9 + 5e-5
    memory = 1.5 * TINY.bytes(s, c) / 1e8 + 1e-4
    np.testing.assert_allclose(got, np.maximum(compute, memory), rtol=1e-5)
    assert np.any(compute > memory) and np.any(memory > compute)  # both regimes exercised
    table = B.verify_latencies(TINY, TRUTH, 64, max_nodes=5)
    np.testing.assert_allclose(table, B.latency(TINY, TRUTH, np.arange(1.0, 7.0), 64), rtol=1e-6)


# ------------------------------------------------------------------ calibration


def test_calibrate_recovers_known_coefficients():
    s, c = grid()
    t = np.asarray(B.latency(TINY, TRUTH, s, c), np.float64)
    fit = B.calibrate(TINY, np.stack([s, c, t], axis=1))
    np.testing.assert_allclose(coeffs(fit), coeffs(TRUTH), rtol=1e-3)


def test_calibrate_with_noise_predicts_well():
    s, c = grid()
    rng = np.random.default_rng(0)
    truth = np.asarray(B.latency(TINY, TRUTH, s, c), np.float64)
    noisy = truth * (1 + 0.01 * rng.standard_normal(truth.shape))
    fit = B.calibrate(TINY, list(zip(s, c, noisy)))
    assert np.all(coeffs(fit) >= 0)
    np.testing.assert_allclose(B.latency(TINY, fit, s, c), truth, rtol=0.03)


def test_calibrate_keeps_coefficients_non_negative():
    # Times that fall as the forward grows would need a negative slope: NNLS clamps it to 0.
    s = np.arange(1.0, 20.0)
    samples = np.stack([s, np.zeros_like(s), 1.0 - 0.01 * s], axis=1)
    fit = B.calibrate(TINY, samples)
    assert np.all(coeffs(fit) >= 0)
    np.testing.assert_allclose(B.latency(TINY, fit, s, 0.0), np.mean(samples[:, 2]), rtol=0.1)


@pytest.mark.parametrize(
    "bad", [np.zeros((0, 3)), np.zeros((4, 2)), [[1.0, 0.0, float("nan")]], [[1.0, 0.0, -1.0]]]
)
def test_calibrate_rejects_bad_samples(bad):
    with pytest.raises(ValueError, match="samples"):
        B.calibrate(TINY, bad)


# ------------------------------------------------------------------ stopping rule


def brute_force_budget(logscores, verify, t_draft, t_other):
    """The n of the largest S(n) = A(n) / C(n) (the first if tied), every n scanned in
    float64; also the S values."""
    logs = np.where(np.isnan(logscores), -np.inf, logscores).astype(np.float64)
    accept = np.concatenate([[1.0], 1.0 + np.cumsum(np.exp(logs))])
    speed = accept / (t_draft + t_other + np.asarray(verify, np.float64))
    best = 0
    for n in range(1, len(speed)):
        if speed[n] > speed[best]:
            best = n
    return best, speed


@st.composite
def budget_problems(draw, max_n=12):
    n = draw(st.integers(1, max_n))
    logs = draw(
        st.lists(
            st.one_of(st.floats(-8.0, 0.0, width=32), st.just(float("nan"))), min_size=n, max_size=n
        )
    )
    logs = sorted(logs, key=lambda x: -np.inf if np.isnan(x) else x, reverse=True)
    verify = np.cumsum(
        draw(st.lists(st.floats(0.0, 0.0625, width=32), min_size=n + 1, max_size=n + 1))
    )
    t_draft = draw(st.floats(0.0, 0.0625, width=32))
    t_other = draw(st.floats(0.0, 0.015625, width=32))
    return (
        np.asarray(logs, np.float32),
        verify.astype(np.float32),
        np.float32(t_draft),
        np.float32(t_other),
    )


@given(budget_problems())
def test_choose_budget_matches_brute_force_scan(problem):
    logs, verify, t_draft, t_other = problem
    assume(t_draft + t_other + verify[0] > 1e-4)
    want, speed = brute_force_budget(*problem)
    # Skip near-ties with the best, where float32 and float64 may legitimately disagree.
    others = np.delete(speed, want)
    assume(np.all(speed[want] - others > 1e-4 * speed[want]))
    got = jax.jit(B.choose_budget)(*problem)
    assert got.dtype == jnp.int32
    assert int(got) == want


@pytest.mark.parametrize("decay,quad", [(0.9, 2e-5), (0.7, 1e-4), (0.97, 0.0), (0.5, 1e-3)])
def test_first_local_max_is_global_for_concave_accept_and_convex_cost(decay, quad):
    n = 40
    logs = np.log(0.8 * decay ** np.arange(n)).astype(np.float32)
    nodes = np.arange(n + 1, dtype=np.float64)
    verify = (0.01 + 4e-4 * nodes + quad * nodes**2).astype(np.float32)
    got = int(B.choose_budget(logs, verify, 0.003, 0.001))
    _, speed = brute_force_budget(logs, verify, 0.003, 0.001)
    assert got == int(np.argmax(speed))


def test_choose_budget_looks_past_a_bucket_step():
    """A staircase cost (slot buckets 1, 4, 8): the 4th node alone moves the round to the
    8-slot forward and lowers S, the 4th to 7th together raise it. The first local maximum
    (n = 3) is not the best; the scan finds n = 7."""
    logs = np.log(np.full(8, 0.9, np.float32))
    bucket = np.array([1, 4, 4, 4, 8, 8, 8, 8, 16])
    verify = np.select([bucket == 1, bucket == 4, bucket == 8], [0.0387, 0.050, 0.0633], 0.0944)
    verify = verify.astype(np.float32)
    _, speed = brute_force_budget(logs, verify, 0.0, 0.0)
    assert speed[4] < speed[3] < speed[7]  # the trap the first-peak rule fell into
    assert int(B.choose_budget(logs, verify, 0.0, 0.0)) == 7


def test_choose_budget_edge_cases():
    free = np.zeros(5, np.float32)
    # Free verification: every node with any probability is worth adding.
    assert int(B.choose_budget(np.log(np.full(4, 0.5, np.float32)), free, 0.01, 0.0)) == 4
    # Worthless nodes (NaN, -inf) are never added when verification costs anything.
    costly = np.linspace(0.01, 0.05, 5).astype(np.float32)
    assert int(B.choose_budget(np.full(4, np.nan, np.float32), costly, 0.01, 0.0)) == 0
    assert int(B.choose_budget(np.full(4, -np.inf, np.float32), costly, 0.01, 0.0)) == 0
    with pytest.raises(ValueError, match=r"\[N \+ 1\]"):
        B.choose_budget(np.zeros(4, np.float32), np.zeros(4, np.float32), 0.0, 0.0)


def test_choose_budget_vmaps_and_does_not_recompile():
    traces = []

    def choose(logs, verify, t_draft):
        traces.append(1)
        return B.choose_budget(logs, verify, t_draft, jnp.float32(0.001))

    fn = jax.jit(jax.vmap(choose))
    rng = np.random.default_rng(0)
    for _ in range(3):
        logs = -np.sort(rng.exponential(size=(4, 10)), axis=-1).astype(np.float32)
        verify = np.cumsum(rng.uniform(0, 0.01, size=(4, 11)), axis=-1).astype(np.float32)
        t_draft = rng.uniform(0, 0.02, size=4).astype(np.float32)
        got = fn(logs, verify, t_draft)
        for b in range(4):
            assert int(got[b]) == brute_force_budget(logs[b], verify[b], t_draft[b], 0.001)[0]
    assert len(traces) == 1


# ------------------------------------------------------------------ online correction


def stream(n, seed):
    """Log-uniform forward sizes in [1, 128]: about half of them memory-bound."""
    rng = np.random.default_rng(seed)
    return (
        np.round(np.exp(rng.uniform(0.0, np.log(128.0), n))).astype(np.float32),
        rng.choice([0.0, 64.0, 200.0], n).astype(np.float32),
    )


@pytest.mark.parametrize("k_c,k_m", [(1.25, 0.8), (0.8, 1.3), (1.0, 1.0), (2.0, 2.0)])
def test_online_scales_converge_to_a_scaled_truth(k_c, k_m):
    state = B.OnlineCalibration.create(TINY, TRUTH)
    s, c = stream(600, 1)
    x_c, x_m = TINY.regime_times(s, c)
    seconds = jnp.maximum(k_c * (2.0 * x_c + 5e-5), k_m * (1.5 * x_m + 1e-4))

    @jax.jit
    def run(state):
        def step(st, obs):
            return B.observe(st, *obs, decay=0.9), None

        return jax.lax.scan(step, state, (s, c, seconds))[0]

    final = run(state)
    np.testing.assert_allclose([final.scale_c, final.scale_m], [k_c, k_m], rtol=1e-3)
    assert int(final.count_c) > 0 and int(final.count_m) > 0
    assert int(final.count_c + final.count_m) == 600
    s_test, c_test = stream(50, 2)
    x_c, x_m = TINY.regime_times(s_test, c_test)
    truth = jnp.maximum(k_c * (2.0 * x_c + 5e-5), k_m * (1.5 * x_m + 1e-4))
    np.testing.assert_allclose(B.corrected_latency(final, s_test, c_test), truth, rtol=2e-3)


def test_observe_ignores_bad_measurements_and_is_a_pytree():
    state = B.OnlineCalibration.create(TINY, TRUTH)
    assert len(jax.tree.leaves(state)) == 8  # the roofline is static metadata
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        after = B.observe(state, 4.0, 0.0, bad)
        for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(state)):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(
        B.corrected_latency(state, 4.0, 0.0), B.latency(TINY, TRUTH, 4.0, 0.0), rtol=1e-6
    )
