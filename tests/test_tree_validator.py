"""An independent validator of the tree invariants, held against ``tree.check``.

The validator below is plain Python over numpy arrays, written from the definition in the
README ("Core concepts") and the docstring of :mod:`eaglepangu_jax.tree`, not from tree.py's
code: it walks each node's parent chain to the root and compares every field with what that
walk implies. ``tree.check`` evaluates the same invariants with vectorised, clip-everything JAX
code. The two must agree, on valid trees, on valid trees with a few corruptions sprinkled in,
and on raw garbage, about whether a tree is valid and, when it is not, about the invariant and
the node that :func:`tree.assert_valid` names (eagerly and inside ``jax.jit`` via checkify).

What the validator checks, per slot ``i`` of an ``N``-slot tree of maximum depth ``D``:

* ``root_ok``: slot 0 is the virtual root: valid, ``parents[0] == 0`` and ``depth[0] == 0``.
* ``in_range``: no negative or too-large index anywhere: ``parents[i]`` and every entry of
  ``ancestors[i]`` lie in ``[0, N)``, padding included.
* ``topological``: a valid ``i > 0`` has ``0 <= parents[i] < i`` (the root: ``parents[0] == 0``).
* ``acyclic``: following parents from any slot (padding included) reaches the root.
* ``valid_closure``: a valid ``i > 0`` has a valid parent.
* ``depth_consistent``: a valid node's depth is the length of its root path and at most ``D``;
  its ancestor row lists that path (``ancestors[i, d]`` = ancestor at depth ``d``, so column 0
  is the root and column ``depth[i]`` is ``i``) and repeats ``i`` past its depth (the root's
  row is all zeros); a padding slot's depth lies in ``[0, D]`` (``positions`` adds it to a
  sequence position).

:func:`tree.assert_valid` reports the first broken invariant in the order above and the lowest
slot breaking it; :func:`first_violation` does the same on the validator's verdicts. Where the
validator's per-slot verdict of an invariant would depend on a convention for input that an
earlier invariant already rejects (``tree.check`` clips out-of-range parents, the validator
treats them as dead ends), the reports still agree, since the earlier invariant is reported.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from eaglepangu_jax import tree as T

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT32 = st.integers(min_value=INT32_MIN, max_value=INT32_MAX)

# The order in which assert_valid reports a broken invariant (its contract).
ORDER = ("root_ok", "in_range", "topological", "acyclic", "valid_closure", "depth_consistent")

# ------------------------------------------------------------------------------- the validator


@dataclasses.dataclass
class Fields:
    """The index fields of a tree as host arrays (tokens and logscore carry no index)."""

    parents: np.ndarray  # [N] int32
    valid: np.ndarray  # [N] bool
    depth: np.ndarray  # [N] int32
    ancestors: np.ndarray  # [N, D + 1] int32

    @property
    def max_depth(self) -> int:
        return self.ancestors.shape[1] - 1

    def copy(self) -> "Fields":
        return Fields(*(np.array(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def to_tree(self) -> T.Tree:
        n = len(self.parents)
        return T.Tree(
            tokens=jnp.zeros((n,), jnp.int32),
            parents=jnp.asarray(self.parents, jnp.int32),
            valid=jnp.asarray(self.valid, bool),
            depth=jnp.asarray(self.depth, jnp.int32),
            ancestors=jnp.asarray(self.ancestors, jnp.int32),
            logscore=jnp.zeros((n,), jnp.float32),
        )


def root_path(parents, i: int) -> list[int] | None:
    """Slots from the root down to ``i``, or None when the parent chain leaves ``[0, N)`` or
    never reaches the root (a cycle)."""
    n = len(parents)
    path = [i]
    while path[-1] != 0:
        if len(path) > n:
            return None
        parent = int(parents[path[-1]])
        if not 0 <= parent < n:
            return None
        path.append(parent)
    return path[::-1]


def validate(f: Fields) -> dict[str, np.ndarray]:
    """Per-slot verdict of each invariant (True = holds), from the definition alone."""
    parents = [int(p) for p in f.parents]
    valid = [bool(v) for v in f.valid]
    depth = [int(d) for d in f.depth]
    ancestors = [[int(a) for a in row] for row in f.ancestors]
    n, max_depth = len(parents), f.max_depth
    ok = {name: np.ones((n,), bool) for name in ORDER}
    ok["root_ok"][0] = valid[0] and parents[0] == 0 and depth[0] == 0
    for i in range(n):
        ok["in_range"][i] = 0 <= parents[i] < n and all(0 <= a < n for a in ancestors[i])
        path = root_path(parents, i)
        ok["acyclic"][i] = path is not None
        if not valid[i]:
            # Padding is never accepted, but its depth still offsets a sequence position.
            ok["depth_consistent"][i] = 0 <= depth[i] <= max_depth
            continue
        if i == 0:
            ok["topological"][i] = parents[0] == 0
        else:
            ok["topological"][i] = 0 <= parents[i] < i
            ok["valid_closure"][i] = 0 <= parents[i] < n and valid[parents[i]]
        ok["depth_consistent"][i] = (
            path is not None
            and depth[i] == len(path) - 1 <= max_depth
            and ancestors[i] == path + [i] * (max_depth + 1 - len(path))
        )
    return ok


def first_violation(f: Fields) -> tuple[str, int] | None:
    """``(invariant, slot)`` that assert_valid must name, or None for a valid tree."""
    for name, ok in validate(f).items():
        if not ok.all():
            return name, int(np.flatnonzero(~ok)[0])
    return None


def build(parents, valid, max_depth: int, *, keep_too_deep: bool = False) -> Fields:
    """A valid tree from topological parents, written from the definition (not tree.py).

    A node is kept when it, every ancestor, and its depth (<= max_depth) are fine; the others
    become padding hanging off the root. ``keep_too_deep`` keeps nodes deeper than
    ``max_depth`` valid with their true depth (ancestor rows truncated): a depth overflow.
    """
    n = len(parents)
    parents = [0] + [int(p) for p in parents[1:]]
    assert all(0 <= parents[i] < i for i in range(1, n))
    keep = [True] + [bool(v) for v in valid[1:]]
    true_depth = [0] * n
    for i in range(1, n):
        true_depth[i] = true_depth[parents[i]] + 1
        keep[i] = keep[i] and keep[parents[i]] and (keep_too_deep or true_depth[i] <= max_depth)
    out_parents, out_depth, rows = [], [], []
    for i in range(n):
        if keep[i]:
            path = root_path(parents, i)
            out_parents.append(parents[i])
            out_depth.append(true_depth[i])
            rows.append((path + [i] * (max_depth + 1))[: max_depth + 1])
        else:  # padding: parent 0, depth 1, ancestors [0, i, i, ...]
            out_parents.append(0)
            out_depth.append(1)
            rows.append([0] + [i] * max_depth)
    return Fields(
        np.asarray(out_parents, np.int32),
        np.asarray(keep),
        np.asarray(out_depth, np.int32),
        np.asarray(rows, np.int32),
    )


# ------------------------------------------------------------------------------ the comparison

_check_jit = jax.jit(T.check)
_is_valid_jit = jax.jit(T.is_valid)
_from_parents_jit = jax.jit(T.from_parents, static_argnames="max_depth")
# assert_valid inside jit: its checkify checks, functionalised (as mode.checked does).
_assert_valid_jit = checkify.checkify(jax.jit(T.assert_valid), errors=checkify.user_checks)


def assert_agree(f: Fields, *, eager: bool = False) -> tuple[str, int] | None:
    """Validator and tree.check agree on validity and on the reported (invariant, node).

    Compares with ``is_valid`` and with ``assert_valid`` under ``jax.jit`` (checkify); with
    ``eager`` also with eager ``assert_valid`` (slower: it retraces ``check`` every call).
    """
    expected = first_violation(f)
    tree = f.to_tree()
    results = {name: np.asarray(ok) for name, ok in _check_jit(tree).items()}
    assert set(results) == set(ORDER)
    assert all(ok.shape == f.parents.shape and ok.dtype == bool for ok in results.values())
    assert bool(_is_valid_jit(tree)) == (expected is None), (expected, results)
    message = _assert_valid_jit(tree)[0].get()
    if expected is None:
        assert message is None, message
        if eager:
            T.assert_valid(tree)  # must not raise
    else:
        pattern = f"invariant '{expected[0]}' broken at node {expected[1]}\\b"
        assert message is not None and re.search(pattern, message), (expected, message)
        if eager:
            with pytest.raises(T.InvalidTreeError, match=pattern):
                T.assert_valid(tree)
    return expected


def test_validator_reports_in_assert_valid_order():
    assert tuple(T.INVARIANTS) == ORDER


# ------------------------------------------------------------------------------ (a) valid trees

SHAPES = [(9, 3), (9, 8), (5, 2), (2, 1), (1, 1)]  # (N, D): few shapes, few compilations


@st.composite
def topological_tree(draw):
    """``(parents, valid, max_depth)``: random topological parents and a random valid mask."""
    n, max_depth = draw(st.sampled_from(SHAPES))
    parents = [0] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    valid = [True] + [draw(st.booleans()) for _ in range(1, n)]
    return parents, valid, max_depth


@given(topological_tree())
def test_valid_trees_agree(data):
    parents, valid, max_depth = data
    f = build(parents, valid, max_depth)
    assert first_violation(f) is None  # the validator accepts what the definition builds
    assert assert_agree(f) is None
    # The constructor builds exactly the same index fields.
    t = _from_parents_jit(
        np.asarray(parents, np.int32), valid=np.asarray(valid), max_depth=max_depth
    )
    for name in ("parents", "valid", "depth", "ancestors"):
        np.testing.assert_array_equal(np.asarray(getattr(t, name)), getattr(f, name), name)


# ----------------------------------------------------------------- (b) valid trees, corrupted

CORRUPTIONS = (
    "parent_out_of_range",
    "parent_negative",
    "parent_not_before",
    "cycle",
    "invalidate",
    "orphan",
    "validate",
    "depth",
    "ancestor",
    "root",
    "swap_rows",
)


@st.composite
def corrupted_tree(draw):
    """A valid tree (possibly with a depth overflow) with 1-3 corruptions sprinkled in."""
    parents, valid, max_depth = draw(topological_tree())
    f = build(parents, valid, max_depth, keep_too_deep=draw(st.booleans()))
    n = len(parents)
    small = st.integers(-2, n + 2)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(CORRUPTIONS))
        i = draw(st.integers(1, n - 1)) if n > 1 else 0  # the root has its own kind
        if kind == "parent_out_of_range":
            f.parents[i] = draw(st.sampled_from([n, n + 1, INT32_MAX]))
        elif kind == "parent_negative":
            f.parents[i] = draw(st.sampled_from([-1, -2, INT32_MIN]))
        elif kind == "parent_not_before":
            f.parents[i] = draw(st.integers(i, n - 1))
        elif kind == "cycle" and n > 2:
            a, b = sorted(
                draw(st.lists(st.integers(1, n - 1), min_size=2, max_size=2, unique=True))
            )
            f.parents[a], f.parents[b] = b, a
        elif kind == "invalidate":
            f.valid[i] = False
        elif kind == "orphan" and 0 < f.parents[i] < n:  # node i's parent becomes padding
            f.valid[f.parents[i]] = False
        elif kind == "validate":
            f.valid[i] = True
        elif kind == "depth":
            near = [max(int(f.depth[i]) - 1, INT32_MIN), min(int(f.depth[i]) + 1, INT32_MAX)]
            near += [max_depth, max_depth + 1]
            f.depth[i] = draw(st.sampled_from([-1, 0, 1, INT32_MIN, INT32_MAX, *near]))
        elif kind == "ancestor":
            d = draw(st.integers(0, max_depth))
            wrong = st.one_of(st.integers(0, n - 1), small, st.sampled_from([INT32_MIN, INT32_MAX]))
            f.ancestors[i, d] = draw(wrong)
        elif kind == "root":
            field = draw(st.sampled_from(["parents", "depth", "valid"]))
            getattr(f, field)[0] = draw(small) if field != "valid" else False
        elif kind == "swap_rows" and n > 1:
            j = draw(st.integers(0, n - 1))
            f.ancestors[[i, j]] = f.ancestors[[j, i]]
    return f


# Cheap examples (one compilation per shape): run more of them than the profile's default.
MORE = settings(max_examples=5 * settings.default.max_examples)


@MORE
@given(corrupted_tree())
def test_corrupted_trees_agree(f):
    assert_agree(f)


# -------------------------------------------------------------------------- (c) raw garbage


@st.composite
def garbage(draw):
    """Arbitrary int32 index fields: any int32, small ones around ``[0, N)``, or in-range
    ones only (so that invariants after ``in_range`` get their turn too)."""
    n, max_depth = draw(st.sampled_from(SHAPES))
    kind = draw(st.sampled_from(["in_range", "small", "any"]))
    slots = {
        "in_range": st.integers(0, n - 1),
        "small": st.integers(-1, n),
        "any": st.one_of(st.integers(-1, n), INT32),
    }[kind]
    depths = st.integers(0, max_depth + 1) if kind == "in_range" else slots

    def ints(values, count):
        drawn = draw(st.lists(values, min_size=count, max_size=count))
        return np.asarray(drawn, np.int64).astype(np.int32)

    f = Fields(
        parents=ints(slots, n),
        valid=np.asarray(draw(st.lists(st.booleans(), min_size=n, max_size=n))),
        depth=ints(depths, n),
        ancestors=ints(slots, n * (max_depth + 1)).reshape(n, max_depth + 1),
    )
    if draw(st.sampled_from([True, True, False])):  # a sound root: the rest get their turn
        f.parents[0] = f.depth[0] = 0
        f.valid[0] = True
        f.ancestors[0] = 0
    return f


@MORE
@given(garbage())
def test_garbage_agrees(f):
    assert_agree(f)


# --------------------------------------------------------------- literal corruptions, named

# The 5-slot tree of the docs: root -> 1 -> 3, root -> 2, 1 -> 4; max_depth 2.
_BASE = build([0, 0, 0, 1, 1], [True] * 5, 2)


def _corrupt(field, index, value, base=_BASE):
    f = base.copy()
    getattr(f, field)[index] = value
    return f


LITERAL = {
    "root invalid": (_corrupt("valid", 0, False), ("root_ok", 0)),
    "root parent": (_corrupt("parents", 0, 1), ("root_ok", 0)),
    "root depth": (_corrupt("depth", 0, 1), ("root_ok", 0)),
    "parent out of range": (_corrupt("parents", 3, 5), ("in_range", 3)),
    "negative parent": (_corrupt("parents", 2, -1), ("in_range", 2)),
    "negative ancestor": (_corrupt("ancestors", (4, 0), -1), ("in_range", 4)),
    "own parent": (_corrupt("parents", 3, 3), ("topological", 3)),
    "cycle 1-4": (_corrupt("parents", 1, 4), ("topological", 1)),
    "padding loop": (_corrupt("parents", 2, 2, _corrupt("valid", 2, False)), ("acyclic", 2)),
    "child of padding": (_corrupt("valid", 1, False), ("valid_closure", 3)),
    "depth overflow": (_corrupt("depth", 3, 3), ("depth_consistent", 3)),
    "depth off by one": (_corrupt("depth", 4, 1), ("depth_consistent", 4)),
    "padding depth": (
        _corrupt("depth", 2, -1, _corrupt("valid", 2, False)),
        ("depth_consistent", 2),
    ),
    "too deep": (build([0, 0, 1, 2], [True] * 4, 2, keep_too_deep=True), ("depth_consistent", 3)),
    "wrong ancestor": (_corrupt("ancestors", (3, 1), 2), ("depth_consistent", 3)),
    "self column": (_corrupt("ancestors", (3, 2), 4), ("depth_consistent", 3)),
    "past the depth": (_corrupt("ancestors", (1, 2), 4), ("depth_consistent", 1)),
    "root row": (_corrupt("ancestors", (0, 1), 3), ("depth_consistent", 0)),
    "column 0": (_corrupt("ancestors", (slice(None), 0), 3), ("depth_consistent", 0)),
    "valid chain": (build([0, 0, 1, 2], [True] * 4, 2), None),
    "leaf to padding": (_corrupt("valid", 4, False), None),
    "padding anywhere": (_corrupt("parents", 4, 3, _corrupt("valid", 4, False)), None),
}


@pytest.mark.parametrize(
    "f,expected", list(LITERAL.values()), ids=[name.replace(" ", "_") for name in LITERAL]
)
def test_literal_corruptions(f, expected):
    assert first_violation(f) == expected
    assert assert_agree(f, eager=True) == expected
