"""``SpecConfig``: the frozen, hashable settings of one speculative-decoding run."""

from __future__ import annotations

import dataclasses

from eaglepangu_jax.draft_control import ControlConfig

__all__ = ["POLICIES", "ACCEPTANCE", "SpecConfig"]

POLICIES = ("auto", "best_first", "static", "drafter")
ACCEPTANCE = ("greedy", "sample")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """The settings of a run; what shapes the compiled step is its static key.

    Attributes:
      policy: how a tree is built each round (default ``"auto"``).
        ``"auto"``: the draft-or-not controller (see :mod:`eaglepangu_jax.engine.step`):
        each round it first decides from online acceptance statistics whether speculating
        pays at all (if not, a plain one-token step, the drafter idle); when it drafts, the
        drafter's tree (or best-first over its marginals) is pruned to the nodes that pay
        for their verification, scored by the drafter corrected online (``budget`` is the
        ceiling). ``"drafter"``: the drafter's own tree, every round (n-gram, EAGLE-style
        heads); ``"best_first"``: the top-``budget`` prefixes of the drafter's per-depth
        marginals; ``"static"``: a fixed choice-list topology filled with the drafter's
        top-k tokens per depth.
      budget: tree nodes per round, root excluded (the ceiling under ``"auto"``).
      depth: deepest tree node (``D``).
      top_k: candidates per depth kept from marginals (``None``: ``budget``).
      acceptance: ``"greedy"`` (argmax match; output equals plain greedy decoding) or
        ``"sample"`` (lossless speculative sampling at ``temperature`` / ``top_p``).
      temperature, top_p: sampling settings (``temperature`` 0 means greedy).
      seed: PRNG seed for sampling and stochastic drafters.
      max_new_tokens: generation limit per sequence.
      (seed, temperature, top_p, eos_id and max_new_tokens are traced values of the compiled
      loop: changing them does not recompile; whether ``temperature > 0`` does.)
      draft_window: the drafter sees only the last ``draft_window`` tokens (``None``: all);
        the seed paper's truncation ablation.
      eos_id: stop token (``None``: the teacher's).
      choices: the ``"static"`` policy's topology, EAGLE/Medusa-style rank paths (``[0]`` is
        the top-1 child of the root, ``[0, 1]`` the second-ranked child of that, ...); at
        most ``budget`` nodes, at most ``depth`` deep.
      slot_buckets: the verify sizes (slots, root included) compiled below the full tree, a
        strictly increasing tuple starting at 1; a round verifies the smallest that holds
        its valid nodes (:func:`eaglepangu_jax.engine.verification.slot_buckets`). ``None``:
        1, 2, 4, 8, ... (a machine on which two rows cost what four do gains nothing from
        the 2-slot size and may leave it out, e.g. ``(1, 4, 8)``).
      control: the ``"auto"`` controller's settings
        (:class:`~eaglepangu_jax.draft_control.ControlConfig`: bins, averages, back-off, the
        single-node gate); part of the static key.
    """

    policy: str = "auto"
    budget: int = 16
    depth: int = 8
    top_k: int | None = None
    acceptance: str = "greedy"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    draft_window: int | None = None
    eos_id: int | None = None
    choices: tuple[tuple[int, ...], ...] | None = None
    slot_buckets: tuple[int, ...] | None = None
    control: ControlConfig = dataclasses.field(default_factory=ControlConfig)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown tree policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.acceptance not in ACCEPTANCE:
            raise ValueError(
                f"unknown acceptance {self.acceptance!r}; known: {', '.join(ACCEPTANCE)}"
            )
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1 tree node, got {self.budget}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.policy == "static":
            if not self.choices:
                raise ValueError("policy 'static' needs choices (rank paths)")
            prefixes = {tuple(c[:k]) for c in self.choices for k in range(1, len(c) + 1)}
            if len(prefixes) > self.budget:
                raise ValueError(f"choices make {len(prefixes)} nodes, above budget {self.budget}")
            if max(len(c) for c in self.choices) > self.depth:
                raise ValueError(f"choices are deeper than depth {self.depth}")
        if self.draft_window is not None and self.draft_window < 1:
            raise ValueError(f"draft_window must be >= 1 or None, got {self.draft_window}")
        if not isinstance(self.control, ControlConfig):
            raise ValueError(f"control must be a ControlConfig, got {self.control!r}")
        if self.slot_buckets is not None:
            sizes = self.slot_buckets
            if (
                not isinstance(sizes, tuple)
                or not sizes
                or sizes[0] != 1
                or any(not isinstance(b, int) or b <= a for a, b in zip(sizes, sizes[1:]))
            ):
                raise ValueError(
                    "slot_buckets must be a strictly increasing tuple of ints starting at 1, "
                    f"got {sizes!r}"
                )

    @property
    def sampling(self) -> bool:
        """True when tokens are sampled (``acceptance='sample'`` with a positive temperature)."""
        return self.acceptance == "sample" and self.temperature > 0.0
