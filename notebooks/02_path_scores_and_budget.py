# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Path scores, expected acceptance and the budget controller
#
# How many draft nodes should one verification round check? More nodes mean more chances that
# the teacher accepts a long path, but a bigger forward. BASTION answers with two curves:
#
# * **A(N)**, the expected number of tokens a round produces with the `N` best nodes: the sum
#   of their path scores ρ plus one for the bonus token. It grows with `N`, ever more slowly.
# * **C(N)**, the time of one round: drafting + overhead + a teacher forward over `N + 1`
#   tokens. A roofline model, calibrated on measured forwards, predicts it.
#
# The controller picks the `N` where tokens per second, **S(N) = A(N) / C(N)**, peaks.
#
# This notebook builds A(N) from draft marginals, times the real teacher (SmolLM2-135M) on
# this machine to calibrate C(N), picks the budget, and shows how the choice moves on other
# hardware. Run time: about a minute (six small compilations of the teacher forward).

# %%
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from eaglepangu_jax import budget as budget_lib
from eaglepangu_jax import scoring
from eaglepangu_jax.calibration import measure as cal_measure
from eaglepangu_jax.engine.decode import Teacher
from eaglepangu_jax.files import atomic_write
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.smollm2 import load_smollm2

PLOT_DIR = os.environ.get("EAGLEPANGU_NOTEBOOK_PLOTS")  # figures are saved only when set


def save(fig, name):
    """Write ``fig`` as ``PLOT_DIR/name.png`` when plots were asked for (atomic write)."""
    if not PLOT_DIR:
        return
    atomic_write(
        os.path.join(PLOT_DIR, name + ".png"),
        lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"),
    )


# %% [markdown]
# ## 1. Draft marginals
#
# A block drafter (DFlash-style) emits one distribution per future position in a single pass:
# `q_1` for the next token, `q_2` for the one after, and so on, each blind to what was drawn
# before it. We simulate such marginals: confident near the root, flatter further out, over a
# small vocabulary of 64 tokens.

# %%
DEPTH, VOCAB_SIZE, MAX_BUDGET = 6, 64, 48
rng = np.random.default_rng(0)
# Geometric in the token's rank, flatter with depth (temperature 0.6 -> 3), lightly perturbed;
# each depth favours different token ids.
temperature = np.linspace(0.6, 3.0, DEPTH, dtype=np.float32)[:, None]
rank_logits = -np.arange(VOCAB_SIZE, dtype=np.float32)[None, :] / temperature
rank_logits += 0.1 * rng.normal(size=(DEPTH, VOCAB_SIZE)).astype(np.float32)
logits = np.stack([row[rng.permutation(VOCAB_SIZE)] for row in rank_logits])
marginal_logprobs = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
q = np.exp(np.asarray(marginal_logprobs))
top = np.sort(q, axis=1)[:, ::-1]

fig, ax = plt.subplots(figsize=(6.5, 3.5))
for r in range(3):
    ax.plot(np.arange(1, DEPTH + 1), top[:, r], marker="o", label=f"rank {r + 1} token")
ax.set_title("Simulated block-drafter marginals")
ax.set_xlabel("depth k (tokens after the root)")
ax.set_ylabel("draft probability q_k (fraction)")
ax.legend()
fig.tight_layout()
save(fig, "02_marginals")
plt.show()

# %% [markdown]
# ## 2. Best-first trees and expected acceptance A(N)
#
# The path score of a prefix is the product of its tokens' marginals. With one marginal per
# depth a child never scores above its parent, so the `N` best prefixes form a tree, and that
# tree maximises A for `N` nodes. `scoring.best_first` returns it with slots sorted by score,
# so the tree for budget `N` is the first `N` slots of the tree for any larger budget, and one
# tree gives the whole curve.

# %%
ROOT_TOKEN = 7
big = scoring.best_first(marginal_logprobs, ROOT_TOKEN, budget=MAX_BUDGET)
rho = np.exp(np.asarray(big.logscore[1:]))  # ρ of node 1..N, non-increasing
assert np.all(np.diff(rho) <= 1e-6), "best-first order must not increase the score"

# `n_nodes` trims the tree to its first n nodes without changing any shape, so one compiled
# function serves every budget.
best_first = jax.jit(scoring.best_first, static_argnames=("budget", "top_k"))
budgets = np.arange(1, MAX_BUDGET + 1)
accept = np.array(
    [
        float(
            scoring.expected_accept(
                best_first(marginal_logprobs, ROOT_TOKEN, budget=MAX_BUDGET, n_nodes=int(b))
            )
        )
        for b in budgets
    ]
)
# The prefix property: A(N) = 1 + ρ_1 + ... + ρ_N read off the single big tree.
np.testing.assert_allclose(accept, 1.0 + np.cumsum(rho), rtol=1e-5)
# Concavity: each extra node adds no more than the previous one.
assert np.all(np.diff(accept, n=2) <= 1e-5)
print("A(N) for N = 1, 4, 16, 48:", np.round(accept[[0, 3, 15, 47]], 3))
print("depth of the best-first nodes:", np.asarray(big.depth[1:]).tolist())

# %% [markdown]
# The scores are products along paths, which `scoring.path_logscores` recomputes from the
# parent pointers and each node's own token log-probability. They agree with the tree's
# stored scores:

# %%
depth = np.asarray(big.depth)
own = np.asarray(marginal_logprobs)[np.maximum(depth - 1, 0), np.asarray(big.tokens)]
recomputed = scoring.path_logscores(big.parents, own)
np.testing.assert_allclose(np.asarray(recomputed), np.asarray(big.logscore), rtol=1e-5, atol=1e-6)
print("path_logscores matches tree.logscore on all", big.num_slots, "slots")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
ax1.plot(budgets, accept, marker=".")
ax1.set_title("Expected accepted tokens per round (concave)")
ax1.set_xlabel("tree budget N (draft nodes)")
ax1.set_ylabel("A(N) (tokens / round)")
ax2.semilogy(budgets, rho, marker=".", color="C1")
ax2.set_title("Marginal gain of the N-th node")
ax2.set_xlabel("node rank N in best-first order")
ax2.set_ylabel("path score ρ_N (probability, log scale)")
fig.tight_layout()
save(fig, "02_expected_accept")
plt.show()

# %% [markdown]
# ## 3. Timing the real teacher's verify forward on this machine
#
# Now the cost side. We load SmolLM2-135M-Instruct (float32) and time one verification forward
# over `s = 1, 2, 4, 8, 16, 32` tree slots with 128 committed tokens in the KV cache.
# `cal_measure.measure_grid` times the function the engine itself runs each round
# (`step.verify_and_accept`: the tree-masked forward plus acceptance), jitted; every `s` is a
# new static shape, so each compiles once (a few seconds, not timed), then runs seven times,
# the sizes interleaved so that a busy moment hits all of them alike. We keep the median.
#
# The engine's attention reads a whole power-of-two *window* of the cache (here 256 slots),
# masked, so the keys a forward reads are the window, not `c + s`: the roofline's `c` is
# therefore the window minus the new tokens.

# %%
config, params = load_smollm2()
teacher = Teacher(config, llama.prepare_params(params))  # per-layer layout: faster forwards
CONTEXT, SLOTS = 128, (1, 2, 4, 8, 16, 32)
grid = cal_measure.measure_grid(teacher, SLOTS, (CONTEXT,), repeats=7)
WINDOW = grid[0].window
assert all(x.window == WINDOW for x in grid), "one window for every size here"
for x in grid:
    print(f"s = {x.slots:2d} slots: {1e3 * x.seconds:6.1f} ms (fastest {1e3 * min(x.times):6.1f})")
# Rows of (s, attended context W - s, seconds), the regressors of the roofline fit.
samples = np.array([(x.slots, WINDOW - x.slots, x.seconds) for x in grid])


# %% [markdown]
# ## 4. Calibrating the roofline
#
# The roofline of one forward over `s` new tokens is
# `T(s) = max(a_c · FLOPs(s)/F + b_c, a_m · Bytes(s)/BW + b_m)`: compute-bound or
# memory-bound, whichever is slower. `Roofline.for_llama` counts FLOPs and bytes from the model
# shape; `F` and `BW` are the machine's peak FLOP/s and memory bandwidth. We start from
# figures typical of this CPU class (about 165 GFLOP/s in float32 matrix products, 24 GB/s);
# `calibrate` fits the efficiencies `a` and overheads `b` (all non-negative) to the timings.
# (`eaglepangu calibrate` does all of this over a grid of sizes and contexts, adds the
# per-round overheads and saves the result for the engine's `"auto"` policy.)

# %%
cpu = budget_lib.Roofline.for_llama(config, peak_flops=165e9, bandwidth=24e9)
calib = budget_lib.calibrate(cpu, samples)
print({name: float(getattr(calib, name)) for name in ("a_c", "b_c", "a_m", "b_m")})

s_grid = np.arange(1, 65)
fitted = np.asarray(budget_lib.latency(cpu, calib, s_grid, WINDOW - s_grid))
ideal = np.asarray(budget_lib.latency(cpu, budget_lib.Calibration.ideal(), s_grid, WINDOW - s_grid))

fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(samples[:, 0], 1e3 * samples[:, 2], "o", label="measured (engine verify, median)")
ax.plot(s_grid, 1e3 * fitted, label="calibrated roofline")
ax.plot(s_grid, 1e3 * ideal, ls="--", label="ideal roofline (peaks, no overhead)")
ax.set_title(f"Verify forward latency, SmolLM2-135M, {CONTEXT} cached tokens")
ax.set_xlabel("tokens in the forward s (root + draft nodes)")
ax.set_ylabel("latency (ms)")
ax.legend()
fig.tight_layout()
save(fig, "02_roofline_calibration")
plt.show()

# %% [markdown]
# On a CPU the weights dominate a one-token step (memory-bound), but the arithmetic grows
# quickly with `s`, so extra tree slots are far from free. The ideal roofline is the floor
# no implementation can beat. On a busy machine the points scatter (other processes steal
# the cores mid-measurement); the fit still gives a usable, monotone cost curve, and an idle
# machine gives a much cleaner one.
#
# ## 5. The controller: where S(N) = A(N) / C(N) peaks
#
# One round costs `C(N) = t_draft + t_other + T_verify(N)`, with `T_verify(N)` the forward over
# the root plus `N` nodes (`verify_latencies` tabulates it). We assume a drafter that costs a
# tenth of a one-token teacher step and the same again for the rest of the round (acceptance,
# cache commit). `choose_budget` scans every N and takes the largest S. With this smooth
# roofline (A concave, C convex) the first peak is already the global one; the engine's
# bucketed verify cost is a staircase, where it is not (a 4th node that moves the round to the
# 8-slot forward rarely pays alone, while four more do).

# %%
logscores = big.logscore[1:]
# The attended context of a forward over root + n nodes: the window minus its new tokens.
ATTENDED = jnp.asarray(WINDOW - np.arange(1, MAX_BUDGET + 2), jnp.float32)


def controller(roofline, calibration, context=ATTENDED):
    """The chosen budget and the S(N) curve for one hardware model."""
    verify = budget_lib.verify_latencies(roofline, calibration, context, max_nodes=MAX_BUDGET)
    t_draft = t_other = 0.1 * float(verify[0])
    chosen = int(budget_lib.choose_budget(logscores, verify, t_draft, t_other))
    cost = t_draft + t_other + np.asarray(verify)
    speed = np.concatenate([[1.0], accept]) / cost  # tokens / s for N = 0..MAX_BUDGET
    return chosen, speed


chosen, speed = controller(cpu, calib)
assert speed[chosen] >= speed.max() * (1 - 1e-5), "choose_budget must find the peak"
# On this smooth curve nothing beyond the chosen N comes back up: the first peak is global.
slack = 1e-5 * speed.max()
assert np.all(np.diff(speed[: chosen + 1]) >= -slack) and np.all(np.diff(speed[chosen:]) <= slack)
print(
    f"this machine: verify {chosen} nodes per round, "
    f"{speed[chosen]:.1f} tokens/s vs {speed[0]:.1f} for plain decoding (N = 0)"
)

fig, ax = plt.subplots(figsize=(6.5, 4))
ax.plot(np.arange(MAX_BUDGET + 1), speed, marker=".")
ax.axvline(chosen, color="r", ls="--", label=f"choose_budget → N = {chosen}")
ax.set_title("Predicted throughput on this machine")
ax.set_xlabel("tree budget N (draft nodes)")
ax.set_ylabel("S(N) = A(N) / C(N) (tokens / s)")
ax.legend()
fig.tight_layout()
save(fig, "02_controller_cpu")
plt.show()

# %% [markdown]
# ## 6. Other hardware, other budget
#
# The same tree on a datacentre GPU: peak float32 tensor throughput in the tens of TFLOP/s and
# ~3 TB/s of HBM. A 135M-parameter model is then memory-bound up to dozens of tokens per
# forward, so extra nodes are almost free and the controller verifies many more. We use the
# ideal (uncalibrated) roofline for the hypothetical machines, plus a fixed 20 µs kernel-launch
# overhead for the GPU.

# %%
gpu = budget_lib.Roofline.for_llama(config, peak_flops=60e12, bandwidth=3.0e12)
gpu_calib = budget_lib.Calibration(
    a_c=jnp.float32(1.0), b_c=jnp.float32(2e-5), a_m=jnp.float32(1.0), b_m=jnp.float32(2e-5)
)
machines = {
    "this CPU (calibrated)": (cpu, calib),
    "CPU-like, ideal roofline": (cpu, budget_lib.Calibration.ideal()),
    "GPU-like, ideal + 20 µs": (gpu, gpu_calib),
}
fig, ax = plt.subplots(figsize=(6.5, 4))
choices = {}
for label, (roofline, calibration) in machines.items():
    n, curve = controller(roofline, calibration)
    choices[label] = n
    ax.plot(np.arange(MAX_BUDGET + 1), curve / curve[0], label=f"{label}: N = {n}")
    ax.plot([n], [curve[n] / curve[0]], "k*", ms=10)
ax.set_title("Speed-up over plain decoding, by hardware model")
ax.set_xlabel("tree budget N (draft nodes)")
ax.set_ylabel("S(N) / S(0) (ratio)")
ax.legend(fontsize=8)
fig.tight_layout()
save(fig, "02_controller_hardware")
plt.show()
print(choices)
assert choices["GPU-like, ideal + 20 µs"] > choices["CPU-like, ideal roofline"]

# %% [markdown]
# A finer view: keep the bandwidth at 24 GB/s and raise the peak FLOP/s. The machine balance
# (FLOP per byte the hardware can afford) decides how many nodes ride along for free.

# %%
peaks = np.geomspace(2e10, 2e13, 25)
chosen_by_peak = [
    controller(
        budget_lib.Roofline.for_llama(config, peak_flops=float(p), bandwidth=24e9),
        budget_lib.Calibration.ideal(),
    )[0]
    for p in peaks
]
fig, ax = plt.subplots(figsize=(6.5, 4))
ax.semilogx(peaks / 24e9, chosen_by_peak, marker="o")
ax.set_title("Chosen budget vs machine balance (bandwidth 24 GB/s)")
ax.set_xlabel("machine balance F / BW (FLOP / byte)")
ax.set_ylabel("chosen budget N (draft nodes)")
fig.tight_layout()
save(fig, "02_budget_vs_balance")
plt.show()
assert chosen_by_peak[-1] >= chosen_by_peak[0]

# %% [markdown]
# ## 7. Draft or not: the controller on the real model
#
# A tree only pays if it is accepted, and a drafter's own probabilities are often wrong (an
# n-gram match claims certainty). So under `policy="auto"` the engine asks, *before*
# drafting, whether speculation is expected to pay: expected emitted tokens per second
# `(1 + E[accepted]) / (t_draft + T_verify(n))` against `1 / T_verify(0)`. `E[accepted]` is
# learned online (`draft_control.AcceptanceStats` in the decode state): an average of the
# accepted length of the rounds that drafted, and per-bin hit rates that correct the
# drafter's node scores. If drafting does not pay, the round is a plain one-token step and
# the drafter is not run; an exploration probe retries after a back-off that doubles after
# each failed probe (4, 8, ..., 64 rounds), so speculation comes back when the text turns
# repetitive.
#
# First the rule alone, on a simulated drafter that always claims certainty but is right
# only 10% of the time, with this machine's calibrated costs.

# %%
from eaglepangu_jax import draft_control  # noqa: E402
from eaglepangu_jax import tree as tree_lib

BUDGET = 8
verify_curve = jnp.asarray(
    budget_lib.verify_latencies(cpu, calib, WINDOW - BUDGET - 1, max_nodes=BUDGET), jnp.float32
)
control = draft_control.ControlConfig()
stats = draft_control.AcceptanceStats.create(control)
chain = tree_lib.chain(BUDGET + 1)  # logscore 0 everywhere: "probability 1"
update = jax.jit(draft_control.update, static_argnums=1)
pays_fn = jax.jit(draft_control.speculation_pays)
sim = np.random.default_rng(1)
drafted, estimate = [], []
for _ in range(200):
    drafts = bool(
        pays_fn(stats.accepted_ema, stats.nodes_ema, verify_curve, 0.2 * float(verify_curve[0]))
        | (stats.rounds_since_draft >= stats.backoff)
    )
    accepted = int(sim.random() < 0.1)  # the first node right 10% of the time, never more
    path = jnp.arange(BUDGET + 1, dtype=jnp.int32)
    stats = update(stats, control, chain, jnp.int32(accepted), path, jnp.bool_(drafts))
    drafted.append(drafts)
    estimate.append(float(stats.accepted_ema))
share_late = np.mean(drafted[50:])
print(f"drafted in {np.mean(drafted):.0%} of 200 rounds, {share_late:.0%} after round 50")
calibrated_p = np.exp(
    np.asarray(draft_control.calibrated_logscores(stats, jnp.zeros(4), jnp.ones(4, bool), control))
)
print("a node claiming p = 1 is now estimated at", np.round(calibrated_p[0], 2))
fig, ax = plt.subplots(figsize=(6.5, 3.5))
ax.plot(estimate, label="E[accepted] (online)")
ax.plot(
    np.flatnonzero(drafted),
    np.zeros(int(np.sum(drafted))),
    "k|",
    ms=12,
    label="rounds that drafted",
)
ax.set_xlabel("round")
ax.set_ylabel("accepted draft tokens")
ax.set_title("A drafter claiming certainty, right 10% of the time")
ax.legend()
fig.tight_layout()
save(fig, "02_draft_or_not")
plt.show()
assert share_late < 0.10 and calibrated_p[0] < 0.5

# %% [markdown]
# Now the engine on the real teacher with the n-gram drafter, the calibrated curve of
# section 3 and the same rule: a prompt whose answer quotes its input (the n-gram drafter's
# best case) and a free-form question (its worst). The output is identical to plain greedy
# decoding in both: the controller only decides what to verify.

# %%
from eaglepangu_jax.drafters import NGramDrafter  # noqa: E402
from eaglepangu_jax.engine import SpecConfig, generate  # noqa: E402
from eaglepangu_jax.models.chat import encode_chat  # noqa: E402
from eaglepangu_jax.models.tokenizer import load_tokenizer  # noqa: E402

tok = load_tokenizer()
spec = SpecConfig(policy="auto", budget=BUDGET, depth=6, max_new_tokens=48)
ngram = NGramDrafter(depth=6, budget=BUDGET)
prompts = {
    "quoting": "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "free-form": "Why is the sky blue? Answer in two sentences.",
}
for label, text in prompts.items():
    ids = encode_chat(tok, [{"role": "user", "content": text}])
    plain = generate(teacher, None, ids, spec)
    spec_run = generate(teacher, ngram, ids, spec, verify_latency=verify_curve)
    nodes = np.asarray(spec_run.stats.nodes_per_round)
    print(
        f"{label:9s}: {np.mean(nodes > 0):.0%} of {len(nodes)} rounds verified a tree, "
        f"accepted length {spec_run.stats.accepted_length:.2f}"
    )
    assert spec_run.tokens == plain.tokens, "the controller must not change the output"

# %% [markdown]
# ### Costs corrected online
#
# The latency curve is one measurement of one moment; the machine's load changes, and the
# engine's loop has per-round costs the verify forward alone does not show. So the engine
# also corrects the curve from what it measures: after each on-device segment (one
# attention window of the loop) the host knows the segment's wall time and how many plain
# and speculative rounds ran, and `CostCorrection` fits two scale factors, `a` for a plain
# step and `b` for a speculative round (`engine/costs.py`), one fit per attention window.
# Evidence about a kind of round that stopped running fades, so a controller that drafts in
# every round (or in none) is brought back to the calibrated ratio and measures both kinds
# again. Keep one per method across calls.
#
# Here the engine gets a curve that believes the machine is four times as fast as it is
# (every latency quartered), and the correction finds the factor from the measured segments.
# A segment whose program compiled during the call is skipped, so the first call teaches
# nothing.

# %%
from eaglepangu_jax.engine import CostCorrection  # noqa: E402

correction = CostCorrection()
ids = encode_chat(tok, [{"role": "user", "content": prompts["free-form"]}])
optimistic = verify_curve * 0.25
for call in range(4):
    generate(teacher, ngram, ids, spec, verify_latency=optimistic, correction=correction)
    a, b = correction.scales
    print(
        f"call {call + 1}: {correction.segments} segment(s) learned from, plain-step scale "
        f"a = {a:.2f}, speculative-round scale b = {b:.2f}"
    )
# Without learning a would stay at 1; the quartered curve has to be scaled back up (by about
# 4). The bar is half of that: the machine's load may change between the curve's measurement
# above and these calls (a shared machine once ran them 1.6x faster than it was measured).
assert correction.segments >= 2 and a > 2.0

# %% [markdown]
# ## Summary
#
# * A(N) from best-first path scores is concave: each node adds less than the one before.
# * The verify forward's latency, measured here and fitted by `calibrate`, grows with the tree.
# * `choose_budget` stops where tokens per second peak; cheap arithmetic (high machine balance)
#   moves the peak to bigger trees.
#
# * Before drafting at all, the controller weighs expected tokens per second with and without
#   speculation, with acceptance learned online; a drafter that never matches is found out
#   within a few rounds and retried only by exploration probes.
# * The latency curve itself is corrected online from measured segment times
#   (`CostCorrection`), so a stale or optimistic calibration is found out too.
#
# In the engine, `SpecConfig(policy="auto")` (the default) applies these rules every round
# (with `budget` as the ceiling), fed by a verify-latency curve; the command line measures
# this machine's curve on first use. Notebook 04 measures the real budget curve with a
# drafter.
