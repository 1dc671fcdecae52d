"""EAGLE-3 draft head: one decoder layer over fused low/mid/high teacher features.

**Head.** Slot ``j`` sees the teacher features of token ``x_j`` from ``F`` tapped layers,
fused by ``fc: F*H -> H`` into ``g_j``, and the (frozen, shared) teacher embedding of the next
token ``x_{j+1}``. One decoder layer whose q/k/v read ``[norm(embed(x_{j+1})), norm(g_j)]``
(``2H`` wide) with ``g_j`` as the residual, then an MLP, gives the head's hidden state ``h_j``;
``lm_head(final_norm(h_j))`` over the draft vocabulary predicts ``x_{j+2}``. For the next draft
step the head's own ``h_j`` stands in for the teacher feature (the teacher has not seen the
drafted token yet)::

    slot j     [g_j   | x_{j+1}]  -> h_j      -> predicts x_{j+2}
    slot j+1   [h_j   | x_{j+2}]  -> h_{j+1}  -> predicts x_{j+3}   (draft / training-time test)

**Draft time.** The drafter state keeps the head's K/V of every committed slot (teacher
features known), so a round costs ``depth - 1`` forwards of ``top_k`` tokens. The tree is grown
EAGLE-2 style: the ``top_k`` best children of each of the ``top_k`` frontier nodes (by
cumulative log-probability) are candidates, the ``top_k`` best candidates form the next
frontier; finally the global best ``budget`` candidates are kept. Every candidate records its
parent's candidate index, so parents are never searched for; a NaN log-probability becomes
``-inf`` and such nodes are padding.

**Training-time test** (:func:`ttt_logits`): ``k`` unrolled steps; step ``i`` of the chain
started at slot ``s`` attends to the teacher-feature slots ``<= s`` and to steps ``1..i`` of its
own chain, exactly what a depth-``i`` draft node sees.

Dimensions: ``T`` slots, ``C`` buffer capacity, ``K`` top_k, ``D`` depth, ``F`` tapped layers,
``H`` hidden, ``Vd`` draft vocabulary, ``V`` teacher vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import tree as tree_lib
from eaglepangu_jax.engine.drafter import DraftContext, FeatureHeadDrafter, Proposal
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.rope import apply_rope, rope_angles

__all__ = [
    "HEAD_KEYS",
    "default_feature_layers",
    "check_head_config",
    "Eagle3Config",
    "init_head",
    "make_params",
    "fuse",
    "project",
    "finish",
    "draft_logits",
    "attend",
    "ttt_logits",
    "Eagle3State",
    "Eagle3Drafter",
    "SHIPPED_NAME",
    "load_shipped_eagle3",
]

HEAD_KEYS = (
    "fc",
    "embed_norm",
    "feature_norm",
    "wq",
    "wk",
    "wv",
    "wo",
    "mlp_norm",
    "w_gate",
    "w_up",
    "w_down",
    "final_norm",
    "lm_head",
)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The tapped teacher layers: low, middle and high, ``(2, L // 2, L - 3)``."""
    n = num_layers
    return tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)}))


def check_head_config(config: Any) -> None:
    """Checks every trained head's config shares: attention grouping, draft vocabulary size
    and at least one tapped teacher layer (raises ``ValueError`` naming the problem)."""
    if config.num_heads % config.num_kv_heads:
        raise ValueError(
            f"num_heads {config.num_heads} is not a multiple of num_kv_heads {config.num_kv_heads}"
        )
    if not 1 <= config.draft_vocab_size <= config.teacher_vocab_size:
        raise ValueError(
            f"draft vocabulary {config.draft_vocab_size} must lie in [1, "
            f"{config.teacher_vocab_size}]"
        )
    if not config.feature_layers:
        raise ValueError("feature_layers must name at least one teacher layer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    """Static shape of an EAGLE-3 head (hashable)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    teacher_vocab_size: int
    feature_layers: tuple[int, ...]
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        check_head_config(self)

    @classmethod
    def for_teacher(
        cls,
        teacher: LlamaConfig,
        draft_vocab_size: int,
        feature_layers: tuple[int, ...] | None = None,
    ) -> "Eagle3Config":
        """A head shaped like one teacher layer; layers ``(2, L // 2, L - 3)`` by default."""
        if feature_layers is None:
            feature_layers = default_feature_layers(teacher.num_layers)
        return cls(
            hidden_size=teacher.hidden_size,
            num_heads=teacher.num_heads,
            num_kv_heads=teacher.num_kv_heads,
            head_dim=teacher.head_dim,
            intermediate_size=teacher.intermediate_size,
            draft_vocab_size=draft_vocab_size,
            teacher_vocab_size=teacher.vocab_size,
            feature_layers=tuple(feature_layers),
            rope_theta=teacher.rope_theta,
            rms_norm_eps=teacher.rms_norm_eps,
        )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "feature_layers": list(self.feature_layers)}

    @classmethod
    def from_json(cls, data: dict) -> "Eagle3Config":
        return cls(**{**data, "feature_layers": tuple(data["feature_layers"])})

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every head weight."""
        h, f, i = self.hidden_size, len(self.feature_layers), self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "fc": (f * h, h),
            "embed_norm": (h,),
            "feature_norm": (h,),
            "wq": (2 * h, q),
            "wk": (2 * h, kv),
            "wv": (2 * h, kv),
            "wo": (q, h),
            "mlp_norm": (h,),
            "w_gate": (h, i),
            "w_up": (h, i),
            "w_down": (i, h),
            "final_norm": (h,),
            "lm_head": (h, self.draft_vocab_size),
        }


def init_head(
    config: Eagle3Config,
    key: Array,
    *,
    embed: Float[Array, "V H"] | None = None,
    d2t: Int[Array, " Vd"] | None = None,
    final_norm: Float[Array, " H"] | None = None,
) -> dict:
    """Random head weights (float32); ``lm_head`` / ``final_norm`` start from the teacher's
    tied embedding rows of the draft vocabulary and final norm when given (a warm start: the
    head then only has to learn to predict the next residual stream)."""
    shapes = config.head_shapes()
    keys = dict(zip(HEAD_KEYS, jax.random.split(key, len(HEAD_KEYS))))
    head = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            head[name] = jnp.ones(shape, jnp.float32)
        else:
            scale = jnp.float32(1.0 / math.sqrt(shape[0]))
            head[name] = scale * jax.random.normal(keys[name], shape, jnp.float32)
    if embed is not None and d2t is not None:
        head["lm_head"] = jnp.asarray(embed, jnp.float32)[jnp.asarray(d2t, jnp.int32)].T
        # Start as the teacher's "logit lens" of the highest tapped layer: fc passes that layer
        # through and the residual branches start small, so the first predictions come from
        # a meaningful residual stream at the right scale instead of a random projection.
        h = config.hidden_size
        head["fc"] = head["fc"].at[-h:].add(jnp.eye(h, dtype=jnp.float32))
        head["wo"] = jnp.float32(0.1) * head["wo"]
        head["w_down"] = jnp.float32(0.1) * head["w_down"]
    if final_norm is not None:
        head["final_norm"] = jnp.asarray(final_norm, jnp.float32)
    return head


def make_params(head: dict, embed: Float[Array, "V H"], d2t: Int[Array, " Vd"]) -> dict:
    """The drafter's parameter pytree: trained head, frozen teacher embedding, draft map."""
    return {"head": head, "embed": embed, "d2t": jnp.asarray(d2t, jnp.int32)}


# ----------------------------------------------------------------------------- layer pieces


def _rms(x: Float[Array, "... H"], weight: Float[Array, " H"], eps: float) -> Float[Array, "... H"]:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.float32(eps))
    return normed * weight.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))


def fuse(head: dict, features: Float[Array, "T F H"]) -> Float[Array, "T H"]:
    """``fc`` over the concatenated tapped features."""
    t = features.shape[0]
    return features.reshape(t, -1).astype(jnp.float32) @ head["fc"]


def project(
    head: dict,
    config: Eagle3Config,
    emb: Float[Array, "T H"],
    feat: Float[Array, "T H"],
    positions: Int[Array, " T"],
) -> tuple[Float[Array, "T Nq Dh"], Float[Array, "T Nk Dh"], Float[Array, "T Nk Dh"]]:
    """Rotated queries/keys and values of slots from ``[norm(emb), norm(feat)]``."""
    eps = config.rms_norm_eps
    x = jnp.concatenate(
        [_rms(emb, head["embed_norm"], eps), _rms(feat, head["feature_norm"], eps)], axis=-1
    )
    t, dh = x.shape[0], config.head_dim
    q = (x @ head["wq"]).reshape(t, config.num_heads, dh)
    k = (x @ head["wk"]).reshape(t, config.num_kv_heads, dh)
    v = (x @ head["wv"]).reshape(t, config.num_kv_heads, dh)
    cos, sin = rope_angles(positions, dh, config.rope_theta)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def finish(
    head: dict, config: Eagle3Config, feat: Float[Array, "T H"], attn: Float[Array, "T Nq Dh"]
) -> Float[Array, "T H"]:
    """Output projection on the feature residual, then the MLP block: the hidden ``h``."""
    h = feat.astype(jnp.float32) + attn.reshape(attn.shape[0], -1) @ head["wo"]
    x = _rms(h, head["mlp_norm"], config.rms_norm_eps)
    return h + (jax.nn.silu(x @ head["w_gate"]) * (x @ head["w_up"])) @ head["w_down"]


def draft_logits(head: dict, config: Eagle3Config, h: Float[Array, "T H"]) -> Float[Array, "T Vd"]:
    """Draft-vocabulary logits of hidden states (float32)."""
    return _rms(h, head["final_norm"], config.rms_norm_eps) @ head["lm_head"]


def _scores(
    config: Eagle3Config, q: Float[Array, "T Nq Dh"], k: Float[Array, "S Nk Dh"]
) -> Float[Array, "T Nq S"]:
    group = config.num_heads // config.num_kv_heads
    k = jnp.repeat(k, group, axis=1)
    return jnp.einsum("tnd,snd->tns", q, k) / jnp.float32(math.sqrt(config.head_dim))


def attend(
    config: Eagle3Config,
    q: Float[Array, "T Nq Dh"],
    k: Float[Array, "S Nk Dh"],
    v: Float[Array, "S Nk Dh"],
    mask: Bool[Array, "T S"],
) -> Float[Array, "T Nq Dh"]:
    """Masked attention; a fully masked row gives zeros, never NaN."""
    s = _scores(config, q, k)
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.float32(1e-30))
    group = config.num_heads // config.num_kv_heads
    return jnp.einsum("tns,snd->tnd", p, jnp.repeat(v, group, axis=1))


# ----------------------------------------------------------------------- training-time test


def ttt_logits(
    head: dict,
    config: Eagle3Config,
    embed: Float[Array, "V H"],
    features: Float[Array, "T F H"],
    tokens: Int[Array, " T"],
    steps: int,
) -> Float[Array, "K T Vd"]:
    """Draft logits of ``steps`` unrolled steps for every chain start ``s`` (one sequence).

    ``out[i, s]`` predicts ``tokens[s + i + 2]`` from the teacher features of slots ``<= s``
    and the head's own hidden states for the ``i`` later steps, fed the true tokens
    ``tokens[s + 1 .. s + i + 1]`` (training-time test). Entries past the sequence read
    padding and must be masked by the caller.
    """
    t = tokens.shape[0]
    index = jnp.arange(t, dtype=jnp.int32)
    causal = index[None, :] <= index[:, None]
    feat = fuse(head, features)
    base_k = base_v = None
    own_k, own_v, out = [], [], []
    for i in range(steps):
        nxt = jnp.concatenate([tokens[i + 1 :], jnp.zeros((i + 1,), tokens.dtype)])[:t]
        emb = embed[nxt].astype(jnp.float32)
        q, k, v = project(head, config, emb, feat, index + i)
        if i == 0:
            base_k, base_v = k, v
        else:
            own_k.append(k)
            own_v.append(v)
        group = config.num_heads // config.num_kv_heads
        s0 = _scores(config, q, base_k)  # [T, Nq, T]
        s0 = jnp.where(causal[:, None, :], s0, -jnp.inf)
        diag = [
            jnp.sum(q * jnp.repeat(kk, group, axis=1), axis=-1)
            / jnp.float32(math.sqrt(config.head_dim))
            for kk in own_k
        ]  # [T, Nq] each
        scores = jnp.concatenate([s0] + [d[:, :, None] for d in diag], axis=-1)
        p = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("tns,snd->tnd", p[:, :, :t], jnp.repeat(base_v, group, axis=1))
        for j, vv in enumerate(own_v):
            attn = attn + p[:, :, t + j, None] * jnp.repeat(vv, group, axis=1)
        feat = finish(head, config, feat, attn)
        out.append(draft_logits(head, config, feat))
    return jnp.stack(out)


# --------------------------------------------------------------------------------- drafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3State:
    """The head's committed K/V: slot ``p`` = (features of position ``p``, token ``p + 1``)."""

    k: Float[Array, "C Nk Dh"]  # [C, Nk, Dh]
    v: Float[Array, "C Nk Dh"]  # [C, Nk, Dh]
    first: Int[Array, ""]  # first filled slot (earlier prompt positions had no features)
    length: Int[Array, ""]  # slots [first, length) are filled
    last_hidden: Float[Array, " H"]  # h of slot length - 1: it predicts the root's child


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Drafter(FeatureHeadDrafter):
    """EAGLE-3 drafter (see the module docstring); params from :func:`make_params`.

    Attributes:
      config: the head's shape.
      budget: tree nodes per round, root excluded (the tree has ``budget + 1`` slots).
      depth: deepest draft node ``D``.
      top_k: children per expanded node and frontier width ``K``.
    """

    name: ClassVar[str] = "eagle3"

    config: Eagle3Config
    budget: int = 16
    depth: int = 6
    top_k: int = 4

    def __post_init__(self):
        for field in ("budget", "depth", "top_k"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.top_k > self.config.draft_vocab_size:
            raise ValueError(
                f"top_k {self.top_k} exceeds the draft vocabulary {self.config.draft_vocab_size}"
            )

    def init_state(self, params: Any, context: DraftContext) -> Eagle3State:
        """Empty cache, then the prompt positions whose features the engine handed over."""
        cfg = self.config
        c = context.tokens.shape[0]
        shape = (c, cfg.num_kv_heads, cfg.head_dim)
        first = jnp.maximum(context.num_tokens - 1 - context.num_features, 0)
        empty = Eagle3State(
            k=jnp.zeros(shape, jnp.float32),
            v=jnp.zeros(shape, jnp.float32),
            first=first.astype(jnp.int32),
            length=first.astype(jnp.int32),
            last_hidden=jnp.zeros((cfg.hidden_size,), jnp.float32),
        )
        return self.update(params, empty, context)

    def update(self, params: Any, state: Eagle3State, context: DraftContext) -> Eagle3State:
        """Add the slots of the newly accepted positions (their features just arrived)."""
        cfg, head = self.config, params["head"]
        c, a = context.tokens.shape[0], context.features.shape[0]
        nf = context.num_features
        row = jnp.arange(a, dtype=jnp.int32)
        pos = context.num_tokens - 1 - nf + row
        live = row < nf
        nxt = context.tokens[jnp.clip(pos + 1, 0, c - 1)]
        feat = fuse(head, context.features)
        emb = params["embed"][nxt].astype(jnp.float32)
        q, k, v = project(head, cfg, emb, feat, jnp.maximum(pos, 0))
        slot = jnp.where(live, pos, c)  # c is past the end: dropped, never wrapped
        keys = state.k.at[slot].set(k, mode="drop")
        values = state.v.at[slot].set(v, mode="drop")
        s = jnp.arange(c, dtype=jnp.int32)
        first = jnp.maximum(state.first, context.start)
        mask = (s[None, :] >= first) & (s[None, :] <= pos[:, None])
        h = finish(head, cfg, feat, attend(cfg, q, keys, values, mask))
        last = jnp.clip(nf - 1, 0, a - 1)
        last_hidden = jnp.where(nf > 0, h[last], state.last_hidden)
        return Eagle3State(
            k=keys,
            v=values,
            first=state.first,
            length=(context.num_tokens - 1).astype(jnp.int32),
            last_hidden=last_hidden,
        )

    def propose(
        self, params: Any, state: Eagle3State, context: DraftContext, key: Array
    ) -> Proposal:
        """An EAGLE-2-style dynamic tree of ``budget`` nodes (``budget + 1`` slots)."""
        cfg, head, d2t = self.config, params["head"], params["d2t"]
        kk, depth = self.top_k, self.depth
        c = context.tokens.shape[0]
        root = context.tokens[jnp.clip(context.num_tokens - 1, 0, c - 1)]
        s = jnp.arange(c, dtype=jnp.int32)
        first = jnp.maximum(state.first, context.start)
        committed = (s >= first) & (s < state.length)  # [C]

        logp = _safe_log_softmax(draft_logits(head, cfg, state.last_hidden[None, :])[0])
        score, ids = jax.lax.top_k(logp, kk)
        pool_score, pool_token, pool_parent = [score], [d2t[ids]], [jnp.zeros((kk,), jnp.int32)]
        # The frontier: pool index, token, score and the hidden its slot reads as a feature.
        f_index = jnp.arange(kk, dtype=jnp.int32)
        f_token, f_score = d2t[ids], score
        f_hidden = jnp.broadcast_to(state.last_hidden[None, :], (kk, cfg.hidden_size))
        draft_k = jnp.zeros((depth * kk, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
        draft_v = jnp.zeros_like(draft_k)
        # anc[j, d]: draft-buffer row of frontier node j's ancestor at depth d + 1.
        anc = jnp.zeros((kk, depth), jnp.int32)
        anc_live = jnp.zeros((kk, depth), bool)
        offset = kk
        for d in range(1, depth):
            rows = (d - 1) * kk + jnp.arange(kk, dtype=jnp.int32)
            anc = anc.at[:, d - 1].set(rows)
            anc_live = anc_live.at[:, d - 1].set(True)
            emb = params["embed"][f_token].astype(jnp.float32)
            position = jnp.full((kk,), state.length + d - 1, jnp.int32)
            q, k, v = project(head, cfg, emb, f_hidden, position)
            draft_k = draft_k.at[rows].set(k)
            draft_v = draft_v.at[rows].set(v)
            buffer_row = jnp.arange(depth * kk, dtype=jnp.int32)
            own = jnp.any(
                (anc[:, :, None] == buffer_row[None, None, :]) & anc_live[:, :, None], axis=1
            )  # [K, D * K]: the node's ancestors and itself
            mask = jnp.concatenate([jnp.broadcast_to(committed[None, :], (kk, c)), own], axis=1)
            attn = attend(
                cfg,
                q,
                jnp.concatenate([state.k, draft_k]),
                jnp.concatenate([state.v, draft_v]),
                mask,
            )
            h = finish(head, cfg, f_hidden, attn)
            logp = _safe_log_softmax(draft_logits(head, cfg, h))  # [K, Vd]
            child_score, child_ids = jax.lax.top_k(logp, kk)  # [K, K]
            cand = (f_score[:, None] + child_score).reshape(-1)
            cand = jnp.where(jnp.isnan(cand), -jnp.inf, cand)
            pool_score.append(cand)
            pool_token.append(d2t[child_ids].reshape(-1))
            pool_parent.append(jnp.repeat(f_index + 1, kk))  # pool index + 1; 0 = root
            best_score, best = jax.lax.top_k(cand, kk)
            parent_row = best // kk
            f_index = offset + best.astype(jnp.int32)
            f_token = d2t[child_ids.reshape(-1)[best]]
            f_score, f_hidden = best_score, h[parent_row]
            anc, anc_live = anc[parent_row], anc_live[parent_row]
            offset += kk * kk
        return Proposal(
            tree=self._select(
                root,
                jnp.concatenate(pool_score),
                jnp.concatenate(pool_token),
                jnp.concatenate(pool_parent),
            )
        )

    def _select(
        self,
        root: Int[Array, ""],
        score: Float[Array, " P"],
        token: Int[Array, " P"],
        parent: Int[Array, " P"],
    ) -> tree_lib.Tree:
        """The global top-``budget`` candidates as a tree; pool order is topological."""
        p, n = score.shape[0], self.budget
        score = jnp.where(jnp.isnan(score), -jnp.inf, score)
        take = min(n, p)
        _, chosen = jax.lax.top_k(score, take)
        chosen = jnp.sort(chosen).astype(jnp.int32)  # parents precede children in the pool
        slot_of = (
            jnp.zeros((p,), jnp.int32).at[chosen].set(jnp.arange(1, take + 1, dtype=jnp.int32))
        )
        par_pool = jnp.clip(parent[chosen] - 1, 0, p - 1)
        par_slot = jnp.where(parent[chosen] == 0, 0, slot_of[par_pool])
        ok = jnp.isfinite(score[chosen]) & ((parent[chosen] == 0) | (par_slot > 0))
        pad = n - take
        parents = jnp.concatenate(
            [jnp.zeros((1,), jnp.int32), par_slot, jnp.zeros((pad,), jnp.int32)]
        )
        valid = jnp.concatenate([jnp.ones((1,), bool), ok, jnp.zeros((pad,), bool)])
        tokens = jnp.concatenate(
            [
                root[None].astype(jnp.int32),
                token[chosen].astype(jnp.int32),
                jnp.zeros((pad,), jnp.int32),
            ]
        )
        logscore = jnp.concatenate(
            [jnp.zeros((1,), jnp.float32), score[chosen], jnp.full((pad,), -jnp.inf, jnp.float32)]
        )

        # Validity closure (an invalid parent invalidates its subtree), so the tree is
        # well-formed even in reference mode, where from_parents checks instead of repairing.
        def close(keep, i):
            return keep.at[i].set(keep[i] & keep[parents[i]]), None

        valid, _ = jax.lax.scan(close, valid, jnp.arange(1, n + 1, dtype=jnp.int32))
        parents = jnp.where(valid, parents, 0)
        return tree_lib.from_parents(
            parents, tokens=tokens, valid=valid, logscore=logscore, max_depth=self.depth
        )


def _safe_log_softmax(logits: Float[Array, "... Vd"]) -> Float[Array, "... Vd"]:
    """log-softmax with NaN mapped to ``-inf`` (a NaN never outranks a real candidate)."""
    out = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.where(jnp.isnan(out), -jnp.inf, out)


SHIPPED_NAME = "eagle3_smollm2"


def load_shipped_eagle3(
    teacher_params: dict | None = None, *, budget: int = 16, depth: int = 6, top_k: int = 4
) -> tuple[Eagle3Drafter, dict]:
    """The packaged head trained for SmolLM2-135M-Instruct: ``(drafter, params)``.

    Args:
      teacher_params: the teacher's parameters (for the frozen embedding); loaded when
        ``None``. The teacher weight file must be the one the head was trained on.
      budget, depth, top_k: tree shape of the returned drafter.

    Raises:
      ValueError: the installed teacher is not the one the head was trained for.
    """
    from eaglepangu_jax.drafters.shipped import load_packaged

    config, head, d2t, embed = load_packaged(SHIPPED_NAME, "eagle3", teacher_params)
    drafter = Eagle3Drafter(config=config, budget=budget, depth=depth, top_k=top_k)
    return drafter, make_params(head, embed, d2t)
