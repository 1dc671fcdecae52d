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
# # 01 · Tree tensors and attention masks
#
# Tree speculative decoding verifies many candidate continuations in **one** teacher forward.
# The candidates form a tree; the forward sees the tree as a flat batch of tokens plus an
# attention mask that lets each token see only its own ancestors. This notebook builds such
# trees with `eaglepangu_jax.tree`, turns them into masks with `eaglepangu_jax.mask`, and shows
# the invariants that keep every index on the accelerator in range.
#
# It needs no model weights and runs in seconds.
#
# **What you will see**
#
# 1. a tree from parent pointers, and its virtual root;
# 2. the depth and ancestor tables every gather goes through;
# 3. trees from EAGLE/Medusa-style choice lists and from best-first path scores;
# 4. the tree mask and the verify mask against a committed KV-cache prefix;
# 5. the Ascend polarity and the bit-packed form;
# 6. reference mode catching a broken tree, performance mode repairing it.

# %%
import os

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import scoring
from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.files import atomic_write

# Figures are shown inline; they are written to disk only when EAGLEPANGU_NOTEBOOK_PLOTS names
# a folder (CI leaves no files behind).
PLOT_DIR = os.environ.get("EAGLEPANGU_NOTEBOOK_PLOTS")


def save(fig, name):
    """Write ``fig`` as ``PLOT_DIR/name.png`` when plots were asked for (atomic write)."""
    if not PLOT_DIR:
        return
    atomic_write(
        os.path.join(PLOT_DIR, name + ".png"),
        lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"),
    )


# %% [markdown]
# ## 1. A tree from parent pointers
#
# A tree with `N` slots is a set of flat arrays. **Slot 0 is the virtual root**: it holds the
# last committed token (the previous round's bonus token), which the teacher has not processed
# yet, and it is its own parent (`parents[0] == 0`). Every other slot `i` is a draft token whose
# parent comes *before* it (`0 <= parents[i] < i`): slots are in topological order, so a cycle
# cannot even be written down.
#
# We use a toy vocabulary so that the tree reads as text. The prefix so far ends with
# "The cat"; the drafter proposes continuations:
#
# ```
# cat ─┬─ sat ─┬─ on
#      │       └─ down
#      └─ is ──── sleeping
# ```

# %%
VOCAB = ["cat", "sat", "is", "on", "down", "sleeping", "the", "mat", "a", "was", "here", "."]
TOK = {word: i for i, word in enumerate(VOCAB)}

parents = np.array([0, 0, 0, 1, 1, 2], np.int32)
tokens = np.array([TOK[w] for w in ["cat", "sat", "is", "on", "down", "sleeping"]], np.int32)
# Draft log-probability of each slot's own token; path scores multiply them along the path.
own_logprob = np.log(np.array([1.0, 0.6, 0.3, 0.5, 0.3, 0.8], np.float32))
logscore = scoring.path_logscores(parents, own_logprob)

tree = tree_lib.from_parents(parents, tokens=tokens, logscore=logscore, max_depth=3)
print("slots N      =", tree.num_slots, "  max depth D =", tree.max_depth)
print("tokens       =", [VOCAB[int(t)] for t in tree.tokens])
print("parents      =", tree.parents.tolist())
print("depth        =", tree.depth.tolist())
print("valid        =", tree.valid.tolist())
print("path score ρ =", [round(float(r), 3) for r in np.exp(np.asarray(tree.logscore))])

# %% [markdown]
# `path_logscores` multiplies the draft probabilities along each root path (in log space):
# "cat sat on" scores 0.6 × 0.5 = 0.30. BASTION calls this ρ(i); it is the drafter's estimate
# of the probability that the teacher accepts node *i*.
#
# ## 2. The ancestor table
#
# `ancestors[i, d]` is node *i*'s ancestor at depth *d*: column 0 is always the root, column
# `depth[i]` is *i* itself, and columns past the depth repeat *i*. Every entry is a slot index
# in `[0, N)`, so a gather through this table can never leave the array. (Implementations that
# pad with `-1` read the *last* node instead on accelerators, silently.)

# %%
anc = np.asarray(tree.ancestors)
print("slot | token    | ancestors (depth 0..D)")
for i in range(tree.num_slots):
    print(f"{i:4d} | {VOCAB[int(tree.tokens[i])]:8s} | {anc[i].tolist()}")
# path_to lists the slots from the root; entries past the node's depth repeat the node.
root_to_3 = tree_lib.path_to(tree, 3)[: int(tree.depth[3]) + 1]
print("\nroot → node 3:", root_to_3.tolist(), [VOCAB[int(tree.tokens[s])] for s in root_to_3])


# %% [markdown]
# ## 3. Drawing a tree next to its mask
#
# A small plotting helper (plain matplotlib): each node shows its token and its path score ρ;
# padding slots are drawn grey. Next to it, `mask.tree_mask(tree)`: row *i* (query) may attend
# to column *j* (key) when *j* is *i* itself or one of its ancestors.


# %%
def layout(t):
    """x position per slot: leaves left to right in depth-first order, parents centred."""
    par = np.asarray(t.parents)
    valid = np.asarray(t.valid)
    children = {
        i: [c for c in range(1, t.num_slots) if valid[c] and par[c] == i]
        for i in range(t.num_slots)
    }
    x = {}

    def place(node, next_leaf):
        if not children[node]:
            x[node] = float(next_leaf)
            return next_leaf + 1
        for child in children[node]:
            next_leaf = place(child, next_leaf)
        x[node] = float(np.mean([x[c] for c in children[node]]))
        return next_leaf

    leaf = place(0, 0)
    for i in range(t.num_slots):  # padding hangs off the root: put it to the right, greyed
        if i not in x:
            x[i] = float(leaf)
            leaf += 1
    return x


def draw_tree(ax, t, title, vocab=VOCAB):
    x = layout(t)
    depth = np.asarray(t.depth)
    par = np.asarray(t.parents)
    valid = np.asarray(t.valid)
    rho = np.exp(np.asarray(t.logscore))
    for i in range(1, t.num_slots):
        if valid[i]:
            ax.plot([x[par[i]], x[i]], [-depth[par[i]], -depth[i]], color="0.6", zorder=1)
    for i in range(t.num_slots):
        name = "root\n" + vocab[int(t.tokens[i])] if i == 0 else vocab[int(t.tokens[i])]
        label = f"{name}\n#{i}" + ("" if i == 0 else f" ρ={rho[i]:.2f}" if valid[i] else " pad")
        ax.text(
            x[i],
            -depth[i],
            label,
            ha="center",
            va="center",
            fontsize=8,
            zorder=2,
            bbox=dict(
                boxstyle="round", fc="#cde" if valid[i] else "0.9", ec="k" if valid[i] else "0.7"
            ),
        )
    ax.set_title(title)
    ax.set_xlabel("leaf index (depth-first order)")
    ax.set_xticks(range(int(max(x.values())) + 1))
    ax.set_ylabel("depth (tokens after the root)")
    ax.set_yticks(-np.arange(t.max_depth + 1), [str(d) for d in range(t.max_depth + 1)])
    ax.set_xlim(min(x.values()) - 0.8, max(x.values()) + 0.8)
    ax.set_ylim(-t.max_depth - 0.6, 0.6)


def draw_mask(ax, m, title, xlabel="key slot", ylabel="query slot (tree node)"):
    m = np.asarray(m)
    ax.imshow(m, cmap="Blues", vmin=0, vmax=1.4, aspect="equal")
    for (r, c), v in np.ndenumerate(m):
        ax.text(c, r, int(v), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(m.shape[1]))
    ax.set_yticks(range(m.shape[0]))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw=dict(width_ratios=[1.4, 1]))
draw_tree(ax1, tree, "Tree from parent pointers")
draw_mask(ax2, mask_lib.tree_mask(tree), "tree_mask (1 = may attend)")
fig.tight_layout()
save(fig, "01_tree_and_mask")
plt.show()

# %% [markdown]
# Reading the mask: row 3 ("on") sees slots 0 (root "cat"), 1 ("sat") and itself. It does not
# see "is" or "down": those are alternative branches, and letting them leak in would make the
# teacher score "cat is on", a sentence nobody proposed.
#
# ## 4. Trees from choice lists and from path scores
#
# **Choice lists** (EAGLE/Medusa static trees) name nodes by the rank of each token among its
# siblings: `[0, 1]` is "second-best child of the best child of the root". `from_choices`
# returns the topology and each slot's rank; a drafter fills in the tokens each round.

# %%
choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
static_tree, rank = tree_lib.from_choices(choices)
print("parents:", static_tree.parents.tolist())
print("rank   :", rank.tolist())
print("depth  :", static_tree.depth.tolist())

# %% [markdown]
# **Best-first trees** (BASTION, DDTree). A block drafter gives one distribution per depth,
# `q_1 … q_D`. The path score of a prefix is the product of its tokens' probabilities, and the
# `B` best prefixes always form a tree (a child never outscores its parent), which maximises
# the expected number of accepted tokens for that node budget. `scoring.best_first` finds them;
# slots come out sorted by score.

# %%
q = np.full((3, len(VOCAB)), 1e-3, np.float32)
q[0, [TOK["sat"], TOK["is"], TOK["was"]]] = [0.55, 0.30, 0.10]
q[1, [TOK["on"], TOK["down"], TOK["here"]]] = [0.60, 0.25, 0.10]
q[2, [TOK["the"], TOK["a"], TOK["."]]] = [0.70, 0.20, 0.05]
q /= q.sum(axis=1, keepdims=True)
bf_tree = scoring.best_first(jnp.log(jnp.asarray(q)), TOK["cat"], budget=8)
rho = np.exp(np.asarray(bf_tree.logscore))
for i in range(bf_tree.num_slots):
    path = [VOCAB[int(bf_tree.tokens[s])] for s in np.unique(np.asarray(bf_tree.ancestors[i]))]
    print(f"slot {i}: ρ={rho[i]:.3f}  {' '.join(path)}")
print("expected accepted tokens A(T) =", float(scoring.expected_accept(bf_tree)))

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw=dict(width_ratios=[1.5, 1]))
draw_tree(ax1, bf_tree, "Best-first tree, budget 8 (ρ = path score)")
draw_mask(ax2, mask_lib.tree_mask(bf_tree), "its tree_mask (1 = may attend)")
fig.tight_layout()
save(fig, "01_best_first_tree")
plt.show()

# %% [markdown]
# `A(T) = Σ ρ(i)` with the root counting 1 (it stands for the bonus token the teacher always
# adds). Notebook 02 follows this number as the budget grows.
#
# ## 5. The verify mask: the tree on top of the committed KV cache
#
# In the real forward the keys are KV-cache slots. The committed prefix occupies slots
# `[0, c)` and is visible to every node; tree slot *j* writes its K/V at cache slot `c + j`.
# `verify_mask(tree, c, S)` is the `[N, S]` mask with `S` key columns (the attention window);
# columns past the tree are hidden. Positions for rotary embeddings are `c + depth`, not
# `c + slot`: siblings share a position.

# %%
committed = 4
window = 12
vmask = mask_lib.verify_mask(tree, committed, window)
print("rotary positions:", tree_lib.positions(tree, committed).tolist())

fig, ax = plt.subplots(figsize=(9, 3.6))
draw_mask(
    ax,
    vmask,
    f"verify_mask: committed prefix c={committed}, window S={window}",
    xlabel="KV-cache slot (key)",
)
ax.axvline(committed - 0.5, color="r", lw=1.5, label="end of committed prefix")
ax.axvline(committed + tree.num_slots - 0.5, color="r", lw=1.5, ls="--", label="end of tree slots")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
fig.tight_layout()
save(fig, "01_verify_mask")
plt.show()

# %% [markdown]
# No row is ever empty: every node sees at least the root and itself. That matters because
# fused attention kernels return NaN for a fully masked row.
#
# ## 6. Ascend polarity and the packed form
#
# PyTorch SDPA and this library use **True = may attend**. Ascend's fused attention kernels
# use the opposite, **1 = masked out**, as `uint8`. `to_ascend` flips it (and `from_ascend`
# flips it back). Getting this wrong does not crash: it silently attends to exactly the wrong
# tokens, which is why the conversion lives in one named function.

# %%
ascend = mask_lib.to_ascend(vmask)
print("library (1 = attend):\n", np.asarray(vmask).astype(np.uint8))
print("Ascend  (1 = masked):\n", np.asarray(ascend))
assert bool(jnp.all(mask_lib.from_ascend(ascend) == vmask))

# %% [markdown]
# Masks that are kept around (one per round, or shipped between host and device) can be
# bit-packed: `pack` stores 32 key columns per `uint32` word, bit `c % 32` of word `c // 32`.
# A `[N, 12]` mask becomes `[N, 1]` words; `unpack` restores it exactly.

# %%
packed = mask_lib.pack(vmask)
print("packed shape:", packed.shape, packed.dtype)
for i, word in enumerate(np.asarray(packed)[:, 0]):
    # Printed most significant bit first, so column 0 is the rightmost digit.
    print(f"row {i}: {int(word):#010x} = {int(word):012b}")
restored = mask_lib.unpack(packed, window)
assert bool(jnp.all(restored == vmask))
print("bytes: bool mask", vmask.size, "→ packed", packed.size * 4)

# %% [markdown]
# ## 7. Invariants: reference mode catches, performance mode repairs
#
# The mode comes from the environment variable `EAGLEPANGU_MODE` and is read when a function
# runs (or is traced). In **reference** mode, constructors check the invariants and raise
# `InvalidTreeError` naming the first bad node. `tree.check` reports every invariant per slot,
# and `assert_valid` raises on a hand-built tree.
#
# Here node 1 claims node 2 as its parent, which comes *after* it: not topological (and, with
# node 2 pointing back at node 1, a cycle).

# %%
broken_parents = np.array([0, 2, 1, 1], np.int32)
previous_mode = os.environ.get("EAGLEPANGU_MODE")
os.environ["EAGLEPANGU_MODE"] = "reference"
try:
    tree_lib.from_parents(broken_parents, max_depth=3)
    raise AssertionError("reference mode should have rejected the broken tree")
except tree_lib.InvalidTreeError as err:
    print("from_parents raised:", err)

# A tree built field by field (bypassing the constructor), e.g. one received from elsewhere.
good = tree_lib.from_parents(np.array([0, 0, 1, 1], np.int32), max_depth=3)
hand_built = tree_lib.Tree(
    tokens=good.tokens,
    parents=jnp.asarray(broken_parents),
    valid=good.valid,
    depth=good.depth,
    ancestors=good.ancestors,
    logscore=good.logscore,
)
report = tree_lib.check(hand_built)
for name, ok in report.items():
    print(f"{name:17s}", np.asarray(ok).astype(int).tolist())
try:
    tree_lib.assert_valid(hand_built)
    raise AssertionError("assert_valid should have raised")
except tree_lib.InvalidTreeError as err:
    print("assert_valid raised:", err)

# %% [markdown]
# In **performance** mode (the default) there are no checks in compiled code. Instead the
# constructor repairs bad input into padding: a node with an impossible parent, and everything
# below it, becomes an invalid slot hanging off the root. Hostile input degrades acceptance; it
# can never produce an out-of-range gather.

# %%
os.environ["EAGLEPANGU_MODE"] = "performance"
repaired = tree_lib.from_parents(broken_parents, max_depth=3)
print("parents:", repaired.parents.tolist(), " valid:", repaired.valid.tolist())
assert bool(tree_lib.is_valid(repaired))

# Restore whatever mode the kernel started with.
if previous_mode is None:
    del os.environ["EAGLEPANGU_MODE"]
else:
    os.environ["EAGLEPANGU_MODE"] = previous_mode

# %% [markdown]
# ## Summary
#
# * A tree is flat arrays with a virtual root at slot 0; parents precede children.
# * Depth and ancestor tables make every device-side index lie in `[0, N)`.
# * `tree_mask` / `verify_mask` turn the tree into attention masks (True = attend); no row is
#   empty; positions follow depth.
# * `to_ascend` flips the polarity for Ascend kernels; `pack` stores 32 columns per word.
# * `EAGLEPANGU_MODE=reference` raises on broken trees; `performance` repairs them.
#
# Next: notebook 02 uses path scores to pick how many nodes are worth verifying.
