"""Side-by-side decoding benchmark: every method on the same turns, on the same teacher.

For each user turn the methods run one after another (greedy first: it is the reference), so a
change of machine load hits them all alike. Later turns of a conversation follow the *greedy*
answers, so every method sees the same prompt. Per turn and method we record the throughput,
the accepted length (emitted tokens / verify rounds, bonus included) and whether the output is
identical to greedy; for a divergence, its index and the teacher's top-2 logit gap there
(computed along the greedy sequence): in float32, lossless methods should only diverge at
near-ties.

Compilation is kept out of the timings: a warm-up generation per method runs first, and a turn
whose decoding compiled anything (new shapes) is run again and the second run is recorded; the
discarded time is reported as ``compile_seconds``. (``prefill_seconds`` may still include
compilation: it is reported, not used.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eaglepangu_jax import cache as cache_lib
from eaglepangu_jax import mask as mask_lib
from eaglepangu_jax import peers
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.generate import GenerationResult, Teacher, generate
from eaglepangu_jax.engine.trace import write_text_atomic
from eaglepangu_jax.models import llama
from eaglepangu_jax.models.config import LlamaConfig
from eaglepangu_jax.suites import Conversation, count_turns

REFERENCE = "greedy"
# Peers: other implementations decoding the same GGUF file, run beside ours; the value is the
# prompt-lookup candidate count (None: plain greedy).
PEER_METHODS = {"transformers-greedy": None, "transformers-pld": peers.PROMPT_LOOKUP_TOKENS}
METHODS = ("greedy", "ngram", "eagle3", "block", *PEER_METHODS)
DEFAULT_BUDGET = 8  # tree nodes; the seeds' M = 16 verifies too slowly on 2 CPU cores
DEFAULT_DEPTH = 6  # deepest draft node
# Rough figures of a 2-core CPU host (f32 matmul throughput, memory read bandwidth) for the
# uncalibrated roofline the "auto" policy needs when no calibration is given.
CPU_PEAK_FLOPS = 165e9
CPU_BANDWIDTH = 24e9
MAX_RUNS = 3  # generations per turn and method at most (see run_method)
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                   "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/compilation_cache/cache_retrieval_time_sec")


class DrafterUnavailableError(RuntimeError):
    """A drafter (or peer) was asked for that this installation cannot provide (the message
    says why)."""


# ----------------------------------------------------------------------------- methods


class PeerRunner(Protocol):
    """Runs a method outside the JAX engine (see :mod:`eaglepangu_jax.peers`)."""

    def __call__(self, prompt_ids: Sequence[int], spec: SpecConfig, *,
                 eos_id: int) -> GenerationResult:
        """Generate for ``prompt_ids``, counted like :func:`generate`: the generated ids, one
        round per teacher forward, decode seconds apart from the prefill."""

    def describe(self) -> dict[str, Any]:
        """The runner's settings in effect (JSON-ready), for the report."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
    """One decoding method and its run settings: a drafter for the JAX engine (``None`` for
    greedy), or a ``runner`` that decodes instead of the engine (a peer implementation)."""

    name: str
    spec: SpecConfig
    drafter: Any = None
    draft_params: Any = None
    runner: PeerRunner | None = None


def parse_methods(text: str | Sequence[str]) -> tuple[str, ...]:
    """Method names from ``"greedy,ngram"``, greedy first (added if missing).

    Raises:
      ValueError: an unknown or repeated name, or an empty list.
    """
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"no methods given; known methods: {', '.join(METHODS)}")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known methods: {', '.join(METHODS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"method(s) {repeated} given more than once")
    return (REFERENCE,) + tuple(n for n in names if n != REFERENCE)


def load_shipped(name: str, **kwargs: Any) -> tuple[Any, Any]:
    """A shipped drafter and its weights: ``drafters.<name>.load_shipped_<name>(**kwargs)``.

    Raises:
      DrafterUnavailableError: the drafter module or its shipped weights are missing or
        unreadable (the message says which).
    """
    module_name = f"eaglepangu_jax.drafters.{name}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        if isinstance(err, ModuleNotFoundError) and err.name == module_name:
            raise DrafterUnavailableError(
                f"the {name} drafter is not part of this installation") from None
        raise DrafterUnavailableError(f"the {name} drafter cannot be imported: {err}") from err
    loader = getattr(module, f"load_shipped_{name}", None)
    if loader is None:
        raise DrafterUnavailableError(f"the {name} module has no load_shipped_{name}()")
    try:
        return loader(**kwargs)
    except (ImportError, OSError, ValueError, KeyError) as err:
        raise DrafterUnavailableError(f"the {name} shipped weights could not be loaded: "
                                      f"{err}") from err


def load_eagle3() -> tuple[Any, Any]:
    """The shipped EAGLE-3 drafter and its weights (see :func:`load_shipped`)."""
    return load_shipped("eagle3")


def load_block(*, budget: int = DEFAULT_BUDGET) -> tuple[Any, Any]:
    """The shipped block drafter at its trained depth, and its weights (see
    :func:`load_shipped`)."""
    return load_shipped("block", budget=budget)


def configure_drafter(drafter: Any, *, budget: int, depth: int) -> Any:
    """``drafter`` with its ``budget`` / ``depth`` hyper-parameters set, where it has them."""
    if not dataclasses.is_dataclass(drafter):
        return drafter
    fields = {f.name for f in dataclasses.fields(drafter) if f.init}
    changes = {k: v for k, v in (("budget", budget), ("depth", depth)) if k in fields}
    return dataclasses.replace(drafter, **changes) if changes else drafter


def make_method(name: str, spec: SpecConfig, *, default_depth: bool = False,
                eagle3_loader: Callable[[], tuple[Any, Any]] | None = None,
                torch_threads: int | None = None) -> Method:
    """Build a benchmark method; ``spec``'s budget and depth configure the drafter.

    Args:
      name: one of :data:`METHODS`.
      spec: the run settings. The block drafter proposes marginals, not a tree: under the
        default ``"drafter"`` policy it runs ``"auto"`` (best-first, roofline-sized trees).
      default_depth: ``spec.depth`` is a default the user did not choose: a shipped drafter
        keeps the depth it comes with (EAGLE-3's head was trained for its own), and a drafter
        whose maximum is lower lowers it, instead of failing.
      eagle3_loader: returns the EAGLE-3 ``(drafter, params)`` (default: :func:`load_eagle3`).
      torch_threads: torch's threads for the transformers peers (``None``: torch's default;
        see :class:`~eaglepangu_jax.peers.TransformersPeer`).

    Raises:
      ValueError: unknown name, or a depth above the drafter's maximum.
      DrafterUnavailableError: a shipped drafter was asked for and cannot be loaded, or a peer
        whose packages are not installed.
    """
    from eaglepangu_jax.drafters import make_drafter

    if name == REFERENCE:
        return Method(name=name, spec=spec)
    if name in PEER_METHODS:
        return _peer_method(name, spec, torch_threads)
    if name == "ngram":
        drafter, params = make_drafter("ngram", depth=spec.depth, budget=spec.budget), None
    elif name in ("eagle3", "block"):
        if name == "eagle3":
            drafter, params = (eagle3_loader or load_eagle3)()
        else:
            drafter, params = load_block(budget=spec.budget)
            if spec.policy == "drafter":
                spec = dataclasses.replace(spec, policy="auto")
        if default_depth:
            spec = dataclasses.replace(spec, depth=drafter.max_depth)
        drafter = configure_drafter(drafter, budget=spec.budget, depth=spec.depth)
    else:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    if spec.depth > drafter.max_depth:
        if not default_depth:
            raise ValueError(f"depth {spec.depth} is above the {name} drafter's maximum "
                             f"{drafter.max_depth}")
        spec = dataclasses.replace(spec, depth=drafter.max_depth)
        drafter = configure_drafter(drafter, budget=spec.budget, depth=spec.depth)
    return Method(name=name, spec=spec, drafter=drafter, draft_params=params)


def _peer_method(name: str, spec: SpecConfig, torch_threads: int | None) -> Method:
    try:
        peers.check_reference_stack()
    except peers.ReferenceStackMissingError as err:
        raise DrafterUnavailableError(f"{name}: {err}") from None
    if spec.sampling:
        raise ValueError(f"{name} decodes greedily; it cannot run a sampling spec")
    runner = peers.TransformersPeer(prompt_lookup=PEER_METHODS[name],
                                    torch_threads=torch_threads)
    return Method(name=name, spec=spec, runner=runner)


def auto_verify_latency(config: LlamaConfig, spec: SpecConfig, context: int,
                        drafter_name: str | None = None) -> Any:
    """The verify-latency curve the ``"auto"`` policy needs (``None`` for other policies):
    this machine's saved calibration (``eaglepangu calibrate``) at ``context`` cached tokens,
    with ``drafter_name``'s drafting cost folded in; the uncalibrated roofline of this machine
    class when there is no usable calibration (see :func:`eaglepangu_jax.calibrate.curve_for`).
    """
    if spec.policy != "auto":
        return None
    from eaglepangu_jax import calibrate

    return calibrate.curve_for(config, spec, context, drafter_name)


def method_verify_latency(config: LlamaConfig, method: Method, context: int) -> Any:
    """:func:`auto_verify_latency` for ``method`` (its drafter's cost included)."""
    return auto_verify_latency(config, method.spec, context,
                               getattr(method.drafter, "name", None))


# ----------------------------------------------------------------------------- prompts


class Renderer(Protocol):
    """Turns a conversation into prompt ids and answer ids into text."""

    def encode(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt ids ending with the assistant header."""

    def decode(self, ids: Sequence[int]) -> str:
        """Answer text (special tokens dropped), sent back as the assistant message."""

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text, no template (``generate --raw``)."""


@dataclasses.dataclass(frozen=True)
class ChatRenderer:
    """The teacher's chat template (the real benchmark's renderer)."""

    tokenizer: Any

    def encode(self, messages: Sequence[dict[str, str]]) -> list[int]:
        from eaglepangu_jax.models.chat import encode_chat

        return encode_chat(self.tokenizer, messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


# ----------------------------------------------------------------------------- timing


class CompileWatch:
    """Records compilation work (tracing, lowering, XLA compiles, persistent-cache reads)
    while active, through ``jax.monitoring``."""

    def __init__(self):
        self.events: list[tuple[float, float]] = []  # (perf_counter at the end, seconds)

    @property
    def seconds(self) -> float:
        """Seconds of all recorded compilation work."""
        return sum(d for _, d in self.events)

    def seconds_after(self, t: float) -> float:
        """Seconds of the work that ended after ``time.perf_counter() == t``."""
        return sum(d for end, d in self.events if end > t)

    def _listen(self, event: str, duration: float, **kwargs: Any) -> None:
        if event in _COMPILE_EVENTS:
            self.events.append((time.perf_counter(), duration))

    @contextlib.contextmanager
    def active(self) -> Iterator["CompileWatch"]:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        try:
            yield self
        finally:
            jax.monitoring.unregister_event_duration_listener(self._listen)


def generate_with(teacher: Teacher, method: Method, prompt_ids: Sequence[int]
                  ) -> GenerationResult:
    """One generation with ``method``: its peer runner, or the JAX engine on ``teacher``."""
    if method.runner is not None:
        eos_id = teacher.config.eos_id if method.spec.eos_id is None else method.spec.eos_id
        return method.runner(prompt_ids, method.spec, eos_id=eos_id)
    return generate(teacher, method.drafter, prompt_ids, method.spec,
                    draft_params=method.draft_params,
                    verify_latency=method_verify_latency(teacher.config, method,
                                                         len(prompt_ids)))


def run_method(teacher: Teacher, method: Method, prompt_ids: Sequence[int]
               ) -> tuple[GenerationResult, float]:
    """Generate with ``method``; a run that compiled is discarded and run again.

    Returns:
      The recorded result and the wall seconds of discarded (compiling) runs. After
      ``MAX_RUNS`` runs the last one is kept even if it compiled (something recompiles every
      time: a bug to look for, not a reason to loop forever). A peer compiles no JAX: its
      first run is kept.
    """
    discarded = 0.0
    for attempt in range(MAX_RUNS):
        watch = CompileWatch()
        start = time.perf_counter()
        with watch.active():
            result = generate_with(teacher, method, prompt_ids)
        # Only compilation inside the decode time (after the prefill) spoils the figures.
        if not watch.seconds_after(start + result.stats.prefill_seconds) \
                or attempt == MAX_RUNS - 1:
            return result, discarded
        discarded += time.perf_counter() - start
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- divergence


def first_divergence(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """First index where ``tokens`` differs from ``reference`` (``None`` if identical)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    if len(reference) != len(tokens):
        return min(len(reference), len(tokens))
    return None


@functools.partial(jax.jit, static_argnames="config")
def _sequence_logits(params: dict, tokens: jax.Array, *, config: LlamaConfig) -> jax.Array:
    t = tokens.shape[0]
    kv = cache_lib.init(config.num_layers, t, config.num_kv_heads, config.head_dim,
                        params["embed"].dtype)
    logits, _, _ = llama.forward(params, tokens, jnp.arange(t, dtype=jnp.int32), kv,
                                 mask_lib.causal_mask(t, 0, t), config=config)
    return logits


def near_tie_gaps(teacher: Teacher, prompt_ids: Sequence[int], greedy: Sequence[int],
                  indices: Sequence[int]) -> dict[int, float | None]:
    """Teacher top-1 minus top-2 logit before greedy token ``i``, for each ``i`` in
    ``indices``, from one causal forward over ``prompt + greedy`` (``None`` past its end)."""
    wanted = sorted({i for i in indices if 0 <= i < len(greedy)})
    gaps: dict[int, float | None] = {i: None for i in indices}
    if not wanted:
        return gaps
    sequence = list(prompt_ids) + list(greedy)
    # Padded to a multiple of 128 so sequences of similar length share one compilation; the
    # padding comes after every row we read, so causality keeps it out of them.
    padded = np.zeros((-(-len(sequence) // 128) * 128,), np.int32)
    padded[: len(sequence)] = sequence
    logits = _sequence_logits(teacher.params, jnp.asarray(padded), config=teacher.config)
    rows = np.asarray(logits[np.asarray([len(prompt_ids) - 1 + i for i in wanted])])
    top2 = np.sort(rows, axis=-1)[:, -2:]
    for i, (second, first) in zip(wanted, top2):
        gaps[i] = float(first - second)
    return gaps


# ----------------------------------------------------------------------------- the run


def _turn_record(result: GenerationResult, compile_seconds: float) -> dict[str, Any]:
    stats = result.stats
    return {"new_tokens": stats.new_tokens, "seconds": stats.seconds,
            "tokens_per_s": _finite(stats.tokens_per_s), "rounds": stats.rounds,
            "accepted_length": stats.accepted_length,
            "prefill_seconds": stats.prefill_seconds, "compile_seconds": compile_seconds}


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def check_prompts(conversations: Sequence[Conversation], renderer: Renderer,
                  config: LlamaConfig, max_new_tokens: int) -> None:
    """Fail before any work if an opening turn cannot fit the teacher's context."""
    for c in conversations:
        n = len(renderer.encode([{"role": "user", "content": c.turns[0]}]))
        if n + max_new_tokens > config.max_position:
            raise ValueError(f"conversation {c.id!r}: the first prompt has {n} tokens; with "
                             f"{max_new_tokens} new tokens it exceeds the teacher's context "
                             f"of {config.max_position}")


def run_bench(teacher: Teacher, conversations: Sequence[Conversation],
              methods: Sequence[Method], renderer: Renderer, *,
              progress: bool = True) -> dict[str, Any]:
    """Run every method on every turn, interleaved per turn, greedy first.

    Args:
      teacher: the verifying model (injected, so tests can use a tiny random one).
      conversations: the prompts; later turns follow the greedy answers.
      methods: greedy first (see :func:`parse_methods`, :func:`make_method`).
      renderer: prompt encoding and answer decoding.
      progress: show a progress bar (stderr) with the running accepted lengths.

    Returns:
      The report: ``methods`` (settings), ``warmup_seconds``, ``turns`` and ``summary`` (see
      :func:`summarize_turns`); JSON-ready.
    """
    if not methods or methods[0].name != REFERENCE:
        raise ValueError(f"the first method must be {REFERENCE!r} (the reference)")
    if not conversations:
        raise ValueError("no conversations to benchmark")
    check_prompts(conversations, renderer, teacher.config,
                  max(m.spec.max_new_tokens for m in methods))
    first = renderer.encode([{"role": "user", "content": conversations[0].turns[0]}])
    warmup = {}
    for method in methods:
        start = time.perf_counter()
        generate_with(teacher, method, first)
        warmup[method.name] = time.perf_counter() - start
    turns = []
    with _progress_bar(count_turns(conversations), progress) as bar:
        for conversation in conversations:
            history: list[dict[str, str]] = []
            for index, text in enumerate(conversation.turns):
                history.append({"role": "user", "content": text})
                record, greedy_tokens = _run_turn(teacher, methods, renderer.encode(history))
                record = {"conversation_id": conversation.id, "category": conversation.category,
                          "turn_index": index, **record}
                turns.append(record)
                history.append({"role": "assistant", "content": renderer.decode(greedy_tokens)})
                _advance(bar, turns, methods)
    return {
        "methods": {m.name: _describe(m) for m in methods},
        "warmup_seconds": warmup,
        "turns": turns,
        "summary": summarize_turns(turns, [m.name for m in methods]),
    }


def _run_turn(teacher: Teacher, methods: Sequence[Method], prompt_ids: list[int]
              ) -> tuple[dict[str, Any], list[int]]:
    results, records = {}, {}
    for method in methods:
        result, compile_seconds = run_method(teacher, method, prompt_ids)
        results[method.name] = result
        records[method.name] = _turn_record(result, compile_seconds)
    greedy = results[REFERENCE].tokens
    divergence = {name: first_divergence(greedy, r.tokens) for name, r in results.items()}
    gaps = near_tie_gaps(teacher, prompt_ids, greedy,
                         [i for i in divergence.values() if i is not None])
    greedy_tps = records[REFERENCE]["tokens_per_s"]
    for name, record in records.items():
        index = divergence[name]
        record["identical_to_greedy"] = index is None
        record["divergence_index"] = index
        record["near_tie_gap"] = gaps[index] if index is not None else None
        tps = record["tokens_per_s"]
        record["speedup"] = tps / greedy_tps if tps is not None and greedy_tps else None
    return {"prompt_tokens": len(prompt_ids), "methods": records}, greedy


def _describe(method: Method) -> dict[str, Any]:
    return {"drafter": repr(method.drafter) if method.drafter is not None else None,
            "runner": method.runner.describe() if method.runner is not None else None,
            "spec": dataclasses.asdict(method.spec)}


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    bar = tqdm(total=total, unit="turn", desc="bench", disable=not enabled, dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def _advance(bar, turns: list[dict[str, Any]], methods: Sequence[Method]) -> None:
    running = {}
    for method in methods[1:]:
        tokens = sum(t["methods"][method.name]["new_tokens"] for t in turns)
        rounds = sum(t["methods"][method.name]["rounds"] for t in turns)
        running[method.name] = f"{tokens / rounds:.2f}" if rounds else "-"
    bar.set_postfix({f"acc[{k}]": v for k, v in running.items()}, refresh=False)
    bar.update(1)


# ----------------------------------------------------------------------------- summary


def summarize_turns(turns: Sequence[dict[str, Any]], names: Sequence[str]
                    ) -> dict[str, dict[str, Any]]:
    """Per method, over the turns: ``mean_tokens_per_s``; ``mean_speedup``, ``p50_speedup``,
    ``p99_speedup`` of per-turn tokens/s over greedy's (percentiles interpolate linearly);
    ``mean_accepted_length`` (mean of per-turn values) and ``overall_accepted_length`` (all
    tokens / all rounds); ``identical_fraction``; ``turns``."""
    summary = {}
    for name in names:
        rows = [t["methods"][name] for t in turns]
        speedups = [r["speedup"] for r in rows if r["speedup"] is not None]
        tps = [r["tokens_per_s"] for r in rows if r["tokens_per_s"] is not None]
        rounds = sum(r["rounds"] for r in rows)
        summary[name] = {
            "turns": len(rows),
            "mean_tokens_per_s": _mean(tps),
            "mean_speedup": _mean(speedups),
            "p50_speedup": _percentile(speedups, 50),
            "p99_speedup": _percentile(speedups, 99),
            "mean_accepted_length": _mean([r["accepted_length"] for r in rows]),
            "overall_accepted_length": (sum(r["new_tokens"] for r in rows) / rounds
                                        if rounds else None),
            "identical_fraction": _mean([float(r["identical_to_greedy"]) for r in rows]),
            "compile_seconds": float(sum(r["compile_seconds"] for r in rows)),
        }
    return summary


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def format_summary(report: dict[str, Any]) -> str:
    """The summary as a fixed-width table."""
    w = _name_width(report["summary"])
    header = (f"{'method':<{w}} {'turns':>5} {'tok/s':>7} {'speed-up':>8} {'p50':>6} {'p99':>6} "
              f"{'acc.len':>7} {'identical':>9} {'warm-up s':>9} {'compile s':>9}")
    lines = [header, "-" * len(header)]
    for name, s in report["summary"].items():
        lines.append(
            f"{name:<{w}} {s['turns']:>5} {_fmt(s['mean_tokens_per_s'], 1):>7} "
            f"{_fmt(s['mean_speedup'], 2, 'x'):>8} {_fmt(s['p50_speedup'], 2, 'x'):>6} "
            f"{_fmt(s['p99_speedup'], 2, 'x'):>6} {_fmt(s['mean_accepted_length'], 2):>7} "
            f"{_fmt(s['identical_fraction'], 0, '%', 100):>9} "
            f"{report['warmup_seconds'][name]:>9.1f} {s['compile_seconds']:>9.1f}")
    return "\n".join(lines)


def format_turns(report: dict[str, Any]) -> str:
    """One row per turn and method: the side-by-side view."""
    w = _name_width(report["summary"])
    header = (f"{'turn':<16} {'method':<{w}} {'tokens':>6} {'tok/s':>7} {'speed-up':>8} "
              f"{'acc.len':>7} {'same as greedy':>14}")
    lines = [header, "-" * len(header)]
    for t in report["turns"]:
        label = f"{t['conversation_id']}#{t['turn_index'] + 1}"
        for name, r in t["methods"].items():
            same = "yes" if r["identical_to_greedy"] else (
                f"no @{r['divergence_index']}" + (f" gap {r['near_tie_gap']:.2f}"
                                                  if r["near_tie_gap"] is not None else ""))
            lines.append(f"{label:<16} {name:<{w}} {r['new_tokens']:>6} "
                         f"{_fmt(r['tokens_per_s'], 1):>7} {_fmt(r['speedup'], 2, 'x'):>8} "
                         f"{r['accepted_length']:>7.2f} {same:>14}")
            label = ""
    return "\n".join(lines)


def _name_width(names: Sequence[str]) -> int:
    return max([8, *(len(n) for n in names)])


def _fmt(value: float | None, digits: int, suffix: str = "", scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def write_report(path: str | os.PathLike, report: dict[str, Any]) -> None:
    """The report as indented JSON, written atomically."""
    write_text_atomic(path, json.dumps(report, indent=2, allow_nan=False) + "\n")
