"""Block (DFlash-style) drafter: per-depth marginals of the next ``D`` tokens in one forward.

**Context stream.** Every committed position ``s`` has teacher features from ``F`` tapped
layers; each is RMS-normed on its own (the teacher's residual stream carries massive
activations, one dimension hundreds of times the median one, and its layers differ in scale
by ~10x), ``fc: F*H -> H`` fuses them and a norm gives ``c_s``. Each drafter layer ``l``
projects ``c_s`` to its own context keys/values (``ctx_wk[l]``, ``ctx_wv[l]``, rotated at position
``s``). They depend on position ``s`` alone, so the drafter state caches them once, when the
features arrive (:meth:`BlockDrafter.update`), and proposing never recomputes them.

**Query block.** With the root (last committed token, never fed to the teacher) at position
``p``, the block is ``[embed(root), MASK, ..., MASK]`` (``D`` slots at positions
``p .. p + D - 1``; MASK is a learned vector, the embedding is the teacher's, frozen), and every
slot also gets ``w_last`` times the newest context vector ``c_{p-1}``, an addition to DFlash:
like EAGLE-3's head, whose residual stream starts from the teacher's features, the block
starts from the teacher's newest state instead of having to find it by attention. (On the
small self-distilled data set here a plain DFlash block learned to recognise the training
sequences through attention and memorised them: training loss near zero, held-out accuracy
below a bigram model's.) The block runs through ``num_layers`` pre-norm decoder layers
whose attention reads the context K/V of positions ``< p`` together with the block's own K/V,
with no causal mask inside the block::

    context   c_0 ... c_{p-1}                   (K/V cached per layer)
    block     [root | MASK | MASK | ... ]        positions p .. p+D-1, attend to all of
                 |      |      |                 the context and the whole block
    output    q_1    q_2    q_3   ...            slot i predicts token p + i + 1

A final norm and ``lm_head`` over the draft vocabulary give the ``D`` marginals; they are
scattered to teacher ids through ``d2t`` (every other teacher id gets ``-inf``) and handed to
the engine's tree policies (``best_first``, ``auto``), which build the tree.

Dimensions: ``C`` buffer capacity, ``S`` context slots, ``A`` blocks (anchors), ``D`` block
size, ``L`` drafter layers, ``F`` tapped layers, ``H`` hidden, ``Vd`` draft vocabulary, ``V``
teacher vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax.drafters import eagle3_head
from eaglepangu_jax.drafters.block_head import LAYER_KEYS, BlockConfig, init_head
from eaglepangu_jax.drafters.eagle3_head import (
    checked_temperature,
    draft_logits,
    finish,
    fuse,
    safe_log_softmax,
)
from eaglepangu_jax.engine.drafter import DraftContext, FeatureHeadDrafter, Proposal
from eaglepangu_jax.models.llama import rms_norm
from eaglepangu_jax.models.rope import apply_rope, rope_angles

__all__ = [
    "BlockConfig",
    "BlockDrafter",
    "BlockState",
    "init_head",
    "make_params",
    "prepare_head",
    "DECODER_KEYS",
    "with_depth_temperature",
    "load_shipped_block",
    "context_stream",
    "context_kv",
    "block_inputs",
    "block_hidden",
    "block_logits",
    "teacher_marginals",
]


# The weights of one decoder layer of the block (the context projections ``ctx_wk`` /
# ``ctx_wv`` are not among them: :func:`context_kv` runs every layer's in one batched product).
DECODER_KEYS = tuple(k for k in LAYER_KEYS if k not in ("ctx_wk", "ctx_wv"))


def prepare_head(head: dict) -> dict:
    """The drafting layout of a head (idempotent): the decoder layers' weights as a tuple
    of per-layer dicts under ``"layers"``, every other leaf as stored.

    Training and the files keep the stacked layout (``[L, ...]`` leaves). Drafting from it,
    XLA on CPU copied each layer's weight slice before its matrix product: 28 MB a round for
    the shipped 2-layer head, and 30 MB of temporaries per call (measured: the engine's
    drafting call alone took 14 ms stacked, 5.6 ms prepared; the same logits). The teacher
    has the same two layouts for the same reason (:func:`eaglepangu_jax.models.llama.
    prepare_params`). Copies the layer weights once.
    """
    if "layers" in head:
        return head
    n = head["wq"].shape[0]
    layers = tuple({name: head[name][i] for name in DECODER_KEYS} for i in range(n))
    rest = {name: value for name, value in head.items() if name not in DECODER_KEYS}
    return {**rest, "layers": layers}


def make_params(head: dict, embed: Float[Array, "V H"], d2t: Int[Array, " Vd"]) -> dict:
    """The drafter's parameter pytree (:func:`eaglepangu_jax.drafters.eagle3_head.
    make_params`) with the head in the drafting layout (:func:`prepare_head`)."""
    return eagle3_head.make_params(prepare_head(head), embed, d2t)


def _decoder_layer(head: dict, i: int) -> dict:
    """Layer ``i``'s decoder weights from either layout (see :func:`prepare_head`)."""
    if "layers" in head:
        return head["layers"][i]
    return {name: head[name][i] for name in DECODER_KEYS}


def context_stream(
    head: dict, config: BlockConfig, features: Float[Array, "T F H"]
) -> Float[Array, "T H"]:
    """The context vectors ``c``: normed ``fc`` of each position's normed tapped features."""
    eps = config.rms_norm_eps
    ones = jnp.ones((features.shape[-1],), jnp.float32)
    normed = rms_norm(features, ones, eps) * head["feature_norm"].astype(jnp.float32)[None]
    return rms_norm(fuse(head, normed), head["ctx_norm"], eps)


def context_kv(
    head: dict, config: BlockConfig, c: Float[Array, "T H"], positions: Int[Array, " T"]
) -> tuple[Float[Array, "L T Nk Dh"], Float[Array, "L T Nk Dh"]]:
    """Every layer's context keys (rotated at ``positions``) and values of context vectors."""
    t, n = c.shape[0], config.num_layers
    k = jnp.einsum("th,lhk->ltk", c, head["ctx_wk"]).reshape(
        n, t, config.num_kv_heads, config.head_dim
    )
    v = jnp.einsum("th,lhk->ltk", c, head["ctx_wv"]).reshape(
        n, t, config.num_kv_heads, config.head_dim
    )
    cos, sin = rope_angles(positions, config.head_dim, config.rope_theta)
    return jax.vmap(lambda x: apply_rope(x, cos, sin))(k), v


def block_inputs(
    head: dict,
    embed: Float[Array, "V H"],
    roots: Int[Array, " A"],
    last: Float[Array, "A H"],
    block_size: int,
) -> Float[Array, "A D H"]:
    """``[embed(root), MASK x (D - 1)] + w_last c_{p-1}`` for every block (``last`` is
    ``c_{p-1}``, zeros where that position is not visible)."""
    first = embed[roots].astype(jnp.float32)[:, None, :]
    mask = jnp.broadcast_to(
        head["mask_embed"].astype(jnp.float32)[None, None, :],
        (roots.shape[0], block_size - 1, first.shape[-1]),
    )
    return jnp.concatenate([first, mask], axis=1) + (last @ head["w_last"])[:, None, :]


def _attend(
    config: BlockConfig,
    q: Float[Array, "A D Nq Dh"],
    ctx_k: Float[Array, "S Nk Dh"],
    ctx_v: Float[Array, "S Nk Dh"],
    visible: Bool[Array, "A S"],
    k: Float[Array, "A D Nk Dh"],
    v: Float[Array, "A D Nk Dh"],
) -> Float[Array, "A D Nq Dh"]:
    """One softmax over each block's visible context and its whole block (grouped heads:
    query head ``n`` reads KV head ``n // group``). The context K/V are shared by all
    blocks, never copied per block; a block always sees itself, so no row is fully masked."""
    a, d, nq, dh = q.shape
    nk = config.num_kv_heads
    q = q.reshape(a, d, nk, nq // nk, dh) / jnp.float32(math.sqrt(dh))
    s_ctx = jnp.einsum("adkgh,skh->adkgs", q, ctx_k)
    s_ctx = jnp.where(visible[:, None, None, None, :], s_ctx, -jnp.inf)
    s_own = jnp.einsum("adkgh,aekh->adkge", q, k)
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_own], axis=-1), axis=-1)
    s = ctx_k.shape[0]
    out = jnp.einsum("adkgs,skh->adkgh", p[..., :s], ctx_v) + jnp.einsum(
        "adkge,aekh->adkgh", p[..., s:], v
    )
    return out.reshape(a, d, nq, dh)


def block_hidden(
    head: dict,
    config: BlockConfig,
    ctx_k: Float[Array, "L S Nk Dh"],
    ctx_v: Float[Array, "L S Nk Dh"],
    visible: Bool[Array, "A S"],
    x: Float[Array, "A D H"],
    positions: Int[Array, "A D"],
) -> Float[Array, "A D H"]:
    """The drafter layers over ``A`` blocks; block ``a`` reads the context slots
    ``visible[a]`` (its own block always)."""
    a, d, h = x.shape
    nq, nk, dh = config.num_heads, config.num_kv_heads, config.head_dim
    cos, sin = rope_angles(positions.reshape(-1), dh, config.rope_theta)
    x = x.reshape(a * d, h)
    for i in range(config.num_layers):
        layer = _decoder_layer(head, i)
        y = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
        q = apply_rope((y @ layer["wq"]).reshape(a * d, nq, dh), cos, sin)
        k = apply_rope((y @ layer["wk"]).reshape(a * d, nk, dh), cos, sin)
        v = (y @ layer["wv"]).reshape(a * d, nk, dh)
        attn = _attend(
            config,
            q.reshape(a, d, nq, dh),
            ctx_k[i],
            ctx_v[i],
            visible,
            k.reshape(a, d, nk, dh),
            v.reshape(a, d, nk, dh),
        )
        # EAGLE-3's tail: output projection on the residual, then the gated MLP block.
        x = finish(layer, config, x, attn.reshape(a * d, nq, dh))
    return x.reshape(a, d, h)


def block_logits(
    head: dict,
    config: BlockConfig,
    embed: Float[Array, "V H"],
    ctx_k: Float[Array, "L S Nk Dh"],
    ctx_v: Float[Array, "L S Nk Dh"],
    visible: Bool[Array, "A S"],
    roots: Int[Array, " A"],
    starts: Int[Array, " A"],
    last: Float[Array, "A H"],
) -> Float[Array, "A D Vd"]:
    """Draft-vocabulary logits of ``A`` blocks; block ``a`` has its root at position
    ``starts[a]``, the context vector ``last[a]`` of the position before it, and its slot
    ``i`` predicts the token at ``starts[a] + i + 1``."""
    d = config.block_size
    x = block_inputs(head, embed, roots, last, d)
    positions = starts[:, None] + jnp.arange(d, dtype=jnp.int32)[None, :]
    h = block_hidden(head, config, ctx_k, ctx_v, visible, x, positions)
    a = roots.shape[0]
    return draft_logits(head, config, h.reshape(a * d, -1)).reshape(a, d, -1)


def teacher_marginals(
    logp: Float[Array, "D Vd"], d2t: Int[Array, " Vd"], vocab_size: int
) -> Float[Array, "D V"]:
    """Draft-vocabulary log-probabilities at their teacher ids, ``-inf`` elsewhere."""
    out = jnp.full((logp.shape[0], vocab_size), -jnp.inf, jnp.float32)
    return out.at[:, d2t].set(logp)


# --------------------------------------------------------------------------------- drafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockState:
    """Every layer's context K/V of the committed positions (slot = position)."""

    k: Float[Array, "L C Nk Dh"]  # [L, C, Nk, Dh]
    v: Float[Array, "L C Nk Dh"]  # [L, C, Nk, Dh]
    first: Int[Array, ""]  # first filled slot (earlier prompt positions had no features)
    length: Int[Array, ""]  # slots [first, length) are filled; length = the root's position
    last: Float[Array, " H"]  # context vector of slot length - 1 (zeros when none)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockDrafter(FeatureHeadDrafter):
    """Block drafter (see the module docstring); params from :func:`make_params`.

    It proposes marginals, never a tree: run it under the ``best_first`` or ``auto`` policy.

    Attributes:
      config: the drafter's shape.
      depth: marginals returned per round (``1 .. block_size``; default ``block_size``). The
        block always runs at its trained size, so a smaller depth changes no marginal.
    """

    name: ClassVar[str] = "block"
    # Raised when the same tree's drafting cost changes (1: layers read in place, see
    # prepare_head): a calibration's cost measured before is then not read for this drafter
    # (:func:`eaglepangu_jax.calibration.curve.draft_cost_key`) but measured again.
    cost_revision: ClassVar[int] = 1

    config: BlockConfig
    depth: int | None = None

    def __post_init__(self):
        if self.depth is None:
            object.__setattr__(self, "depth", self.config.block_size)
        if not 1 <= self.depth <= self.config.block_size:
            raise ValueError(
                f"depth must lie in [1, block_size = {self.config.block_size}], got {self.depth}"
            )

    def init_state(self, params: Any, context: DraftContext) -> BlockState:
        """Empty cache, then the prompt positions whose features the engine handed over."""
        cfg = self.config
        shape = (cfg.num_layers, context.tokens.shape[0], cfg.num_kv_heads, cfg.head_dim)
        first = jnp.maximum(context.num_tokens - 1 - context.num_features, 0).astype(jnp.int32)
        empty = BlockState(
            k=jnp.zeros(shape, jnp.float32),
            v=jnp.zeros(shape, jnp.float32),
            first=first,
            length=first,
            last=jnp.zeros((cfg.hidden_size,), jnp.float32),
        )
        return self.update(params, empty, context)

    def update(self, params: Any, state: BlockState, context: DraftContext) -> BlockState:
        """Cache the context K/V of the newly accepted positions (their features arrived)."""
        c, a = state.k.shape[1], context.features.shape[0]
        nf = context.num_features
        row = jnp.arange(a, dtype=jnp.int32)
        pos = context.num_tokens - 1 - nf + row
        stream = context_stream(params["head"], self.config, context.features)
        k, v = context_kv(params["head"], self.config, stream, jnp.maximum(pos, 0))
        slot = jnp.where((row < nf) & (pos >= 0), pos, c)  # c is past the end: dropped
        last = jnp.where(nf > 0, stream[jnp.clip(nf - 1, 0, a - 1)], state.last)
        return BlockState(
            k=state.k.at[:, slot].set(k, mode="drop"),
            v=state.v.at[:, slot].set(v, mode="drop"),
            first=state.first,
            length=(context.num_tokens - 1).astype(jnp.int32),
            last=last,
        )

    def propose(
        self, params: Any, state: BlockState, context: DraftContext, key: Array
    ) -> Proposal:
        """``[depth, V]`` teacher-vocabulary log-marginals of the tokens after the root."""
        cfg = self.config
        c = context.tokens.shape[0]
        position = jnp.clip(context.num_tokens - 1, 0, c - 1).astype(jnp.int32)
        root = context.tokens[position]
        s = jnp.arange(state.k.shape[1], dtype=jnp.int32)
        first = jnp.maximum(state.first, context.start)
        visible = ((s >= first) & (s < state.length))[None, :]
        newest = state.length - 1
        last = jnp.where((newest >= first) & (newest >= 0), state.last, 0.0)
        logits = block_logits(
            params["head"],
            cfg,
            params["embed"],
            state.k,
            state.v,
            visible,
            root[None],
            position[None],
            last[None],
        )[0, : self.depth]
        temperature = params.get("depth_temperature")
        if temperature is not None:  # per-depth calibration (absent: the raw marginals)
            logits = logits / temperature[: self.depth, None]
        return Proposal(
            marginals=teacher_marginals(
                safe_log_softmax(logits), params["d2t"], cfg.teacher_vocab_size
            )
        )


def with_depth_temperature(params: dict, config: BlockConfig, temperature) -> dict:
    """``params`` whose marginals at depth ``i`` are ``softmax(logits / temperature[i])``.

    The block drafter is trained with hard targets and grows overconfident, most at the deep
    slots; the tree policies and the controller read its marginals as acceptance
    probabilities, so they are rescaled by temperatures fitted on held-out data
    (:func:`eaglepangu_jax.training.train_block.fit_depth_temperatures`). A temperature keeps
    every argmax, so the top-1 chain is unchanged.
    """
    shape = jnp.asarray(temperature).shape
    if shape != (config.block_size,):
        raise ValueError(
            f"depth_temperature must have one entry per block slot ({config.block_size}), "
            f"got shape {shape}"
        )
    return {**params, "depth_temperature": checked_temperature(temperature)}


# -------------------------------------------------------------------------------- shipping

SHIPPED_NAME = "block_smollm2"


def load_shipped_block(
    teacher_params: dict | None = None, *, budget: int = 8, depth: int | None = None
) -> tuple[BlockDrafter, dict]:
    """The packaged block drafter trained for SmolLM2-135M-Instruct: ``(drafter, params)``.

    Args:
      teacher_params: the teacher's parameters (for the frozen embedding); loaded when
        ``None``. The teacher weight file must be the one the drafter was trained on.
      budget: tree nodes per round the caller plans (``>= 1``). A block drafter proposes
        marginals, so the tree budget is the run's ``SpecConfig.budget``; the argument keeps
        one loader signature for all shipped drafters.
      depth: marginals per round (default: the trained block size).

    Raises:
      ValueError: the installed teacher is not the one the drafter was trained for, or a bad
        ``budget`` / ``depth``.
    """
    from eaglepangu_jax.drafters.shipped import load_packaged

    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    config, head, d2t, embed, meta = load_packaged(SHIPPED_NAME, "block", teacher_params)
    drafter = BlockDrafter(config=config, depth=depth)
    params = make_params(head, embed, d2t)
    temperature = meta.get("calibration", {}).get("depth_temperature")
    if temperature is not None:
        params = with_depth_temperature(params, config, temperature)
    return drafter, params
