"""The corpus pipeline: synthesize prompts, answer them in batches, keep a manifest.

1. **Prompts** (:func:`prompt_list`): synthesis batch ``b`` (``SynthSettings.batch_size`` user
   turns sampled from the pre-query template, stored as a ``"user-turns"`` shard) for ``b = 0,
   1, ...``; each turn filtered (:func:`~eaglepangu_jax.training.synth.reject_reason`); one
   template or code prompt (:mod:`eaglepangu_jax.training.prompts`) after every
   ``template_every`` kept turns; the whole stream deduplicated and checked against the
   evaluation texts. Every step keeps or drops an item by looking only at earlier items, so
   more synthesis batches *append* prompts and never reorder them: the shards already made stay
   valid when the corpus grows.
2. **Answers** (:func:`build_corpus`): consecutive chunks of ``shard_size`` prompts, each one
   answer shard (:mod:`eaglepangu_jax.training.corpus`), made in order until the answer tokens
   reach the target; every ``heldout_every``-th shard is held out (never trained on).
3. **Manifest** (``manifest.json``, rewritten atomically after every new shard; a resumed
   run that only replays recorded shards leaves it as it is): the teacher
   fingerprint, the settings, the prompt mix and filter counts, and per shard its key, sha256,
   counts and split, with totals.

A second kind of corpus answers *given* conversations instead of synthesised prompts
(:func:`build_conversation_corpus`, e.g. the prompts written for the project): every user turn
of every conversation, the later turns after the teacher's own greedy answers to the earlier
ones, exactly as the benchmark builds them. Same shards, same manifest format (its ``plan``
and ``prompts`` say where the conversations came from), so training reads either.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from eaglepangu_jax.files import write_json_atomic
from eaglepangu_jax.training import corpus as corpus_lib
from eaglepangu_jax.training import synth
from eaglepangu_jax.training.prompts import training_prompts

__all__ = [
    "CorpusPlan",
    "PromptList",
    "prompt_list",
    "build_corpus",
    "build_conversation_corpus",
    "read_manifest",
]

MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusPlan:
    """What corpus to make.

    Attributes:
      seed: seeds the synthesis batches and the template order.
      target_answer_tokens: stop once the answer shards hold this many answer tokens.
      template_every: one template/code prompt after this many kept synthesized turns.
      heldout_every: shard ``i`` is held out when ``i % heldout_every == heldout_every - 1``.
      synth: sampling and filtering of user turns.
      answers: answer generation.
    """

    seed: int = 0
    target_answer_tokens: int = 1_000_000
    template_every: int = 4
    heldout_every: int = 20
    synth: synth.SynthSettings = dataclasses.field(default_factory=synth.SynthSettings)
    answers: corpus_lib.CorpusSettings = dataclasses.field(
        default_factory=corpus_lib.CorpusSettings
    )

    def __post_init__(self):
        if self.target_answer_tokens < 1 or self.template_every < 1 or self.heldout_every < 2:
            raise ValueError(
                "need target_answer_tokens >= 1, template_every >= 1 and heldout_every >= 2"
            )

    def held_out(self, shard_index: int) -> bool:
        return shard_index % self.heldout_every == self.heldout_every - 1


@dataclasses.dataclass(frozen=True)
class PromptList:
    """The prompt stream made from the first ``batches`` synthesis batches."""

    texts: list[str]
    sources: list[str]  # "teacher" or "template" per prompt
    dropped: dict[str, int]  # samples or prompts dropped, by reason
    batches: int
    sampled: int  # user turns sampled

    def report(self) -> dict[str, Any]:
        return {
            "synthesis_batches": self.batches,
            "user_turns_sampled": self.sampled,
            "kept": dict(Counter(self.sources)),
            "dropped": dict(self.dropped),
        }


def prompt_list(
    teacher,
    tokenizer,
    plan: CorpusPlan,
    directory: str | os.PathLike,
    *,
    fingerprint: str,
    batches: int,
    guard: synth.EvalGuard,
    progress: Callable[[str], None] | None = None,
) -> PromptList:
    """The prompts of the first ``batches`` synthesis batches (sampled or read back)."""
    turns_dir = Path(directory) / "user-turns"
    prefix = synth.pre_query_ids(tokenizer)
    specials = set(getattr(tokenizer, "special_ids", ()))
    eos_id = teacher.config.eos_id
    templates = training_prompts(seed=plan.seed)
    texts: list[str] = []
    sources: list[str] = []
    dropped: Counter = Counter()
    sampled = 0
    template_next = 0
    kept_turns = 0

    def offer(text: str, source: str) -> None:
        if guard.overlaps(text):
            dropped["evaluation overlap"] += 1
            return
        texts.append(text)
        sources.append(source)

    for b in range(batches):
        settings = {**dataclasses.asdict(plan.synth), "seed": plan.seed, "batch": b}
        key = corpus_lib.corpus_key("user-turns", fingerprint, [prefix], settings)
        shard = corpus_lib.load_corpus_shard(turns_dir, key)
        if shard is None:
            t0 = time.perf_counter()
            turns = synth.sample_user_turns(teacher, tokenizer, plan.synth, seed=plan.seed, batch=b)
            shard = corpus_lib.pack([prefix] * len(turns), turns)
            info = {"kind": "user-turns", "teacher": fingerprint, "settings": settings}
            corpus_lib.save_corpus_shard(turns_dir, key, shard, info)
            if progress is not None:
                progress(f"user turns: batch {b + 1}/{batches} in {time.perf_counter() - t0:.0f} s")
        for ids in shard.answers():
            sampled += 1
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            reason = synth.reject_reason(
                ids, text, eos_id=eos_id, special_ids=specials, settings=plan.synth
            )
            if reason is not None:
                dropped[reason] += 1
                continue
            offer(text, "teacher")
            kept_turns += 1
            if kept_turns % plan.template_every == 0 and template_next < len(templates):
                offer(templates[template_next], "template")
                template_next += 1
    keep = synth.deduplicate(texts, seed=plan.seed)
    dropped["duplicate"] += len(texts) - len(keep)
    return PromptList(
        texts=[texts[i] for i in keep],
        sources=[sources[i] for i in keep],
        dropped=dict(dropped),
        batches=batches,
        sampled=sampled,
    )


def build_corpus(
    teacher,
    tokenizer,
    plan: CorpusPlan,
    directory: str | os.PathLike,
    *,
    fingerprint: str,
    guard: synth.EvalGuard,
    ray_address: str | None = None,
    progress: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Grow the corpus in ``directory`` until it holds ``plan.target_answer_tokens`` answer
    tokens (resuming from what is there); returns the manifest."""
    from eaglepangu_jax.models.chat import encode_chat

    directory = Path(directory)
    answers_dir = directory / "answers"
    size = plan.answers.shard_size
    # Synthesis grows a few batches at a time, so answering starts early and a killed run
    # loses at most one shard; earlier prompts never move when batches are added.
    batches = 4
    shards: list[dict[str, Any]] = []
    # A resumed run replays the shards already made, in order, before it makes new ones.
    # While it only replays what the manifest on disk records, that manifest is left alone:
    # rewriting it shard by shard would leave it shorter than the corpus if the run is
    # stopped during the replay, and a lower target would shrink it.
    recorded = _recorded_keys(directory, plan, fingerprint)
    grown = False
    t0 = time.perf_counter()
    while True:
        prompts = prompt_list(
            teacher,
            tokenizer,
            plan,
            directory,
            fingerprint=fingerprint,
            batches=batches,
            guard=guard,
            progress=progress,
        )
        ids = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in prompts.texts]
        chunks = [ids[i : i + size] for i in range(0, len(ids) - size + 1, size)]
        total = sum(s["answer_tokens"] for s in shards)
        for index in range(len(shards), len(chunks)):
            if total >= plan.target_answer_tokens:
                break

            def record(i, meta, index=index, prompts=prompts):
                nonlocal total, grown
                shards.append(_entry(meta, plan.held_out(index)))
                total += meta["answer_tokens"]
                replayed = index < len(recorded) and recorded[index] == meta["key"]
                grown = grown or not replayed
                if grown:
                    write_manifest(directory, plan, fingerprint, prompts, shards)
                if progress is not None:
                    rate = total / max(time.perf_counter() - t0, 1e-9)
                    progress(
                        f"shard {index + 1}: {total:,} / {plan.target_answer_tokens:,} answer "
                        f"tokens ({rate:.0f} tok/s over this run incl. reads)"
                    )

            keys = corpus_lib.build_shards(
                teacher,
                [chunks[index]],
                plan.answers,
                answers_dir,
                fingerprint=fingerprint,
                ray_address=ray_address,
                on_shard=record,
            )
            if len(shards) == index:  # already on disk: read its meta
                meta = json.loads((answers_dir / f"{keys[0]}.json").read_text())
                record(0, meta)
        if total >= plan.target_answer_tokens:
            if grown or not recorded:
                return write_manifest(directory, plan, fingerprint, prompts, shards)
            return read_manifest(directory)  # reached by replay alone: the manifest stands
        batches += 4


def build_conversation_corpus(
    teacher,
    tokenizer,
    conversations: Sequence[Sequence[str]],
    settings: corpus_lib.CorpusSettings,
    directory: str | os.PathLike,
    *,
    fingerprint: str,
    source: str,
    heldout_every: int | None = None,
    ray_address: str | None = None,
    progress: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Answer every user turn of ``conversations`` (each a list of user texts) greedily.

    Turn ``r`` of every conversation that has one is answered in shards of
    ``settings.shard_size`` prompts after the answers to turns ``< r`` are known; a prompt is
    the chat template over the conversation so far, earlier answers decoded to text as the
    benchmark sends them back. Shards are content-addressed (:func:`corpus_lib.build_shards`):
    a killed run resumes after its last complete shard, and the answers it reads back rebuild
    the same later prompts. Every shard is a training shard unless ``heldout_every`` holds
    shards out as :class:`CorpusPlan` does. Returns the manifest written to ``directory``
    (``source`` names where the conversations came from).

    Raises:
      ValueError: no conversations, or an empty one.
    """
    from eaglepangu_jax.models.chat import encode_chat

    if not conversations or any(not c for c in conversations):
        raise ValueError("need at least one conversation, each with at least one user turn")
    directory = Path(directory)
    histories: list[list[dict[str, str]]] = [[] for _ in conversations]
    shards: list[dict[str, Any]] = []
    made, t0 = {"tokens": 0}, time.perf_counter()  # answer tokens generated by this run
    for turn in range(max(len(c) for c in conversations)):
        active = [i for i, c in enumerate(conversations) if len(c) > turn]
        for i in active:
            histories[i].append({"role": "user", "content": conversations[i][turn]})
        prompts = [encode_chat(tokenizer, histories[i]) for i in active]
        size = settings.shard_size
        chunks = [prompts[j : j + size] for j in range(0, len(prompts), size)]

        def report(j, meta, turn=turn, count=len(chunks)):
            made["tokens"] += meta["answer_tokens"]
            if progress is not None:
                rate = made["tokens"] / max(time.perf_counter() - t0, 1e-9)
                progress(f"turn {turn + 1}: shard {j + 1}/{count} made ({rate:.0f} tok/s)")

        keys = corpus_lib.build_shards(
            teacher,
            chunks,
            settings,
            directory / "answers",
            fingerprint=fingerprint,
            ray_address=ray_address,
            on_shard=report,
        )
        answers: list[list[int]] = []
        for key in keys:
            meta = json.loads((directory / "answers" / f"{key}.json").read_text())
            held = heldout_every is not None and len(shards) % heldout_every == heldout_every - 1
            shards.append(_entry(meta, held))
            shard = corpus_lib.load_corpus_shard(directory / "answers", key)
            if shard is None:  # made a moment ago: only a failing disk gets here
                raise OSError(f"answer shard {key} in {directory} cannot be read back")
            answers.extend(shard.answers())
        for i, ids in zip(active, answers):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": text})
    plan = {
        "source": source,
        "conversations": len(conversations),
        "turns": sum(len(c) for c in conversations),
        "heldout_every": heldout_every,
        "answers": dataclasses.asdict(settings),
    }
    prompts_report = {"source": source, "kept": {source: plan["turns"]}, "dropped": {}}
    return _write_manifest(directory, fingerprint, plan, prompts_report, shards)


def _recorded_keys(directory: Path, plan: CorpusPlan, fingerprint: str) -> list[str]:
    """The shard keys of the manifest in ``directory``, in order, if it was made by this
    teacher under this plan (its target aside); else none."""
    try:
        manifest = read_manifest(directory)
    except ValueError:
        return []
    planned = json.loads(json.dumps(dataclasses.asdict(plan)))  # tuples as JSON reads them
    same_plan = {**manifest.get("plan", {}), "target_answer_tokens": None} == {
        **planned,
        "target_answer_tokens": None,
    }
    if manifest.get("teacher") != fingerprint or not same_plan:
        return []
    return [str(s.get("key")) for s in manifest.get("shards", []) if isinstance(s, dict)]


def _entry(meta: dict[str, Any], held_out: bool) -> dict[str, Any]:
    return {
        "key": meta["key"],
        "sha256": meta["sha256"],
        "sequences": meta["sequences"],
        "prompt_tokens": meta["prompt_tokens"],
        "answer_tokens": meta["answer_tokens"],
        "split": "heldout" if held_out else "train",
    }


def write_manifest(directory, plan, fingerprint, prompts: PromptList, shards) -> dict[str, Any]:
    plan_json = dataclasses.asdict(plan)
    return _write_manifest(directory, fingerprint, plan_json, prompts.report(), shards)


def _write_manifest(directory, fingerprint, plan, prompts, shards) -> dict[str, Any]:
    manifest = {
        "format": "eaglepangu corpus",
        "version": corpus_lib.CORPUS_VERSION,
        "teacher": fingerprint,
        "plan": plan,
        "prompts": prompts,
        "shards": shards,
        "totals": {
            split: {
                "shards": sum(1 for s in shards if s["split"] == split),
                "sequences": sum(s["sequences"] for s in shards if s["split"] == split),
                "prompt_tokens": sum(s["prompt_tokens"] for s in shards if s["split"] == split),
                "answer_tokens": sum(s["answer_tokens"] for s in shards if s["split"] == split),
            }
            for split in ("train", "heldout")
        },
    }
    write_json_atomic(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """The corpus manifest, checked for shape.

    Raises:
      ValueError: missing, unreadable or not a corpus manifest.
    """
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the corpus manifest {path}: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != "eaglepangu corpus":
        raise ValueError(f"{path} is not an eaglepangu corpus manifest")
    return manifest
