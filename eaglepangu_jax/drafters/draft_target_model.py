"""The draft model of draft-target speculation: its fit to the teacher, its cache prefill, the
training-free draft (the teacher truncated to its first layers) and the distilled one.

**The distilled draft** (:class:`DraftModelConfig`): a few Llama layers of the teacher's width,
started from the teacher's first layers and trained on the self-distilled corpus to predict
the teacher's greedy next token. It reads the teacher's frozen embedding and owns its layers,
final norm and a head over a draft vocabulary ``d2t`` (``[H, Vd]``, started from the tied
embedding's rows), so a draft token costs a ``Vd``-column product instead of the teacher's
full one (the tied head alone is a fifth of SmolLM2-135M). Its checkpoint holds the trained
tensors, named ``layers.<i>.<key>``, ``final_norm`` and ``lm_head``.

The drafter that runs it is :class:`eaglepangu_jax.drafters.draft_target.DraftTargetDrafter`.
Dimensions: ``C`` token-buffer capacity, ``S`` draft cache slots, ``T`` new tokens, ``V``
vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax.cache import KVCache
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.models.llama import LAYER_KEYS

__all__ = [
    "PREFILL_CHUNK",
    "check_compatible",
    "block_mask",
    "prefill",
    "truncated_teacher",
    "DraftModelConfig",
    "init_from_teacher",
    "draft_model_params",
]

PREFILL_CHUNK = 64  # prompt tokens per draft forward at prefill (a fixed shape)


def check_compatible(draft: LlamaConfig, teacher: LlamaConfig) -> None:
    """Refuse a draft that does not speak the teacher's tokenizer.

    Raises:
      ValueError: the vocabulary sizes differ, or the bos / eos ids do (another tokenizer).
    """
    if draft.vocab_size != teacher.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens, the teacher's "
            f"{teacher.vocab_size}: a draft-target drafter needs the teacher's tokenizer"
        )
    if (draft.bos_id, draft.eos_id) != (teacher.bos_id, teacher.eos_id):
        raise ValueError(
            f"the draft model's bos/eos ids ({draft.bos_id}, {draft.eos_id}) differ from the "
            f"teacher's ({teacher.bos_id}, {teacher.eos_id}): another tokenizer"
        )


def block_mask(
    rows: int, at: Int[Array, ""], start: Int[Array, ""], num_slots: int
) -> Bool[Array, "T S"]:
    """``rows`` consecutive tokens written at ``[at, at + rows)``: causal, old context hidden."""
    s = jnp.arange(num_slots, dtype=jnp.int32)
    return mask_lib.causal_mask(rows, at, num_slots) & (s >= start)[None, :]


def prefill(
    params: dict,
    tokens: Int[Array, " C"],
    num_tokens: Int[Array, ""],
    start: Int[Array, ""],
    *,
    config: LlamaConfig,
    num_slots: int,
) -> tuple[KVCache, Float[Array, " V"]]:
    """A fresh draft cache holding ``tokens[:num_tokens]``, and the logits at the last one.

    Fixed ``PREFILL_CHUNK``-token forwards in a loop whose trip count is traced, so it jits
    once per buffer size. ``num_slots`` must cover the buffer rounded up to whole chunks.
    """
    c = tokens.shape[0]
    if num_slots < -(-c // PREFILL_CHUNK) * PREFILL_CHUNK:
        raise ValueError(f"{num_slots} draft cache slots cannot hold {c} tokens in chunks")
    padded = jnp.pad(tokens.astype(jnp.int32), (0, -c % PREFILL_CHUNK))
    num = jnp.clip(num_tokens, 1, c).astype(jnp.int32)
    cache = cache_lib.init(
        config.num_layers, num_slots, config.num_kv_heads, config.head_dim, params["embed"].dtype
    )
    offsets = jnp.arange(PREFILL_CHUNK, dtype=jnp.int32)

    def chunk(i, carry):
        kv, root_logits = carry
        begin = i * PREFILL_CHUNK
        ids = jax.lax.dynamic_slice(padded, (begin,), (PREFILL_CHUNK,))
        mask = block_mask(PREFILL_CHUNK, begin, start, num_slots)
        kv = cache_lib.truncate(kv, begin)  # the chunk's K/V land at slot `begin`
        row = num - 1 - begin
        here = (row >= 0) & (row < PREFILL_CHUNK)
        # One row's logits are kept (the root's, in the chunk holding it): only it is computed.
        logits, _, kv = llama.forward(
            params,
            ids,
            begin + offsets,
            kv,
            mask,
            config=config,
            logits_rows=jnp.clip(row, 0, PREFILL_CHUNK - 1)[None],
        )
        return kv, jnp.where(here, logits[0], root_logits)

    init = (cache, jnp.zeros((config.vocab_size,), jnp.float32))
    trips = (num + PREFILL_CHUNK - 1) // PREFILL_CHUNK
    cache, logits = jax.lax.fori_loop(0, trips, chunk, init)
    return cache_lib.truncate(cache, num), logits


def truncated_teacher(
    teacher_params: dict, teacher_config: LlamaConfig, num_layers: int
) -> tuple[LlamaConfig, dict]:
    """The teacher's first ``num_layers`` layers with its final norm and head, as a draft
    model ``(config, params)`` (same layout as given; arrays shared, not copied, when the
    layout is prepared).

    Raises:
      ValueError: ``num_layers`` outside ``[1, teacher layers]``.
    """
    if not 1 <= num_layers <= teacher_config.num_layers:
        raise ValueError(
            f"a truncated teacher needs 1 to {teacher_config.num_layers} layers, got {num_layers}"
        )
    layers = teacher_params["layers"]
    if isinstance(layers, (list, tuple)):
        kept: Any = tuple(layers[:num_layers])
    else:
        kept = {name: w[:num_layers] for name, w in layers.items()}
    config = dataclasses.replace(teacher_config, num_layers=num_layers)
    return config, dict(teacher_params, layers=kept)


# --------------------------------------------------------------------------- distilled draft


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModelConfig:
    """Static shape of a distilled draft model (hashable; the checkpoint format's config)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int
    teacher_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"a draft model needs at least one layer, got {self.num_layers}")
        if not 1 <= self.draft_vocab_size <= self.teacher_vocab_size:
            raise ValueError(
                f"draft vocabulary {self.draft_vocab_size} must lie in [1, "
                f"{self.teacher_vocab_size}]"
            )

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Teacher layers it reads: none (it reads tokens only)."""
        return ()

    @classmethod
    def for_teacher(
        cls, teacher: LlamaConfig, draft_vocab_size: int, num_layers: int
    ) -> "DraftModelConfig":
        """``num_layers`` layers shaped like the teacher's."""
        return cls(
            num_layers=num_layers,
            hidden_size=teacher.hidden_size,
            intermediate_size=teacher.intermediate_size,
            num_heads=teacher.num_heads,
            num_kv_heads=teacher.num_kv_heads,
            head_dim=teacher.head_dim,
            draft_vocab_size=draft_vocab_size,
            teacher_vocab_size=teacher.vocab_size,
            rope_theta=teacher.rope_theta,
            rms_norm_eps=teacher.rms_norm_eps,
            max_position=teacher.max_position,
            bos_id=teacher.bos_id,
            eos_id=teacher.eos_id,
        )

    def llama_config(self) -> LlamaConfig:
        """The model's :class:`LlamaConfig` (the teacher's vocabulary: what the drafter checks
        and what its logits cover)."""
        return LlamaConfig(
            vocab_size=self.teacher_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position=self.max_position,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "DraftModelConfig":
        return cls(**data)

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of every trained tensor."""
        layer = {k: v[1:] for k, v in self.llama_config().layer_shapes().items()}
        shapes = {
            f"layers.{i}.{key}": layer[key] for i in range(self.num_layers) for key in LAYER_KEYS
        }
        shapes["final_norm"] = (self.hidden_size,)
        shapes["lm_head"] = (self.hidden_size, self.draft_vocab_size)
        return shapes


def init_from_teacher(
    config: DraftModelConfig,
    teacher_params: dict,
    d2t: Int[Array, " Vd"],
) -> dict:
    """The teacher's first ``config.num_layers`` layers, its final norm and its head's
    draft-vocabulary columns, as trainable float32 tensors (the distillation's warm start).

    Raises:
      ValueError: the teacher has fewer layers than the draft model.
    """
    layers = teacher_params["layers"]
    available = len(layers) if isinstance(layers, (list, tuple)) else layers["wq"].shape[0]
    if config.num_layers > available:
        raise ValueError(
            f"a {config.num_layers}-layer draft cannot start from a {available}-layer teacher"
        )
    head = {
        f"layers.{i}.{key}": jnp.asarray(w, jnp.float32)
        for i in range(config.num_layers)
        for key, w in llama.layer_params(teacher_params, i).items()
    }
    head["final_norm"] = jnp.asarray(teacher_params["final_norm"], jnp.float32)
    ids = jnp.asarray(d2t, jnp.int32)
    if "lm_head" in teacher_params:  # [H, V] (untied, or the prepared layout)
        head["lm_head"] = jnp.asarray(teacher_params["lm_head"], jnp.float32)[:, ids]
    else:
        head["lm_head"] = jnp.asarray(teacher_params["embed"], jnp.float32)[ids].T
    return head


def draft_model_params(
    head: dict,
    config: DraftModelConfig,
    embed: Float[Array, "V H"],
    d2t: Int[Array, " Vd"] | None = None,
) -> dict:
    """Prepared :func:`~eaglepangu_jax.models.llama.forward` params of the draft model.

    With ``d2t`` the logits cover the teacher's vocabulary (``-inf`` off the draft
    vocabulary): the drafter's form. Without, they are the ``Vd`` draft-vocabulary logits:
    the training form.
    """
    layers = tuple(
        {key: head[f"layers.{i}.{key}"] for key in LAYER_KEYS} for i in range(config.num_layers)
    )
    params = {
        "embed": embed,
        "layers": layers,
        "final_norm": head["final_norm"],
        "lm_head": head["lm_head"],
    }
    if d2t is not None:
        params["vocab_ids"] = jnp.asarray(d2t, jnp.int32)
    return params
