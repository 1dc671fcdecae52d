"""Prompt suites for benchmarks: MT-Bench, HumanEval, and the seeds' 240-turn mix.

A suite is a list of :class:`Conversation`: user messages sent one after another, each after the
model's own answer to the previous one. Suites are read from JSON Lines, one conversation per
line::

    {"id": "q1", "category": "writing", "turns": ["Write a poem.", "Now shorter."]}
    {"question_id": 7, "prompt": "def add(a, b):"}

The shipped suites (data files inside the package):

* ``"mtbench"``: the 80 MT-Bench questions, 2 turns each (160 turns).
* ``"humaneval"``: the first 80 HumanEval problems, one turn each, the problem's prompt wrapped
  in :data:`HUMANEVAL_TEMPLATE` (category ``"humaneval"``, id the task id).
* ``"mtbench-humaneval"``: both, MT-Bench first (the seeds' 240 turns).
* ``"dev"``: :data:`DEV_FILE`, 56 conversations (104 turns) written for this project in the
  manner of the two (multi-sentence, specific user requests in MT-Bench's eight categories, two
  turns each, and eight function stubs with doctests, category ``"code-completion"``), sharing
  no run of 8 words with either (tested). The drafters' training prompts are written by the
  teacher itself; this suite is the human-written stand-in for the evaluation prompts that
  model selection or training may look at, where MT-Bench and HumanEval must stay unseen.

Not a suite: :func:`written_prompts` (:data:`WRITTEN_FILE`), 1,011 conversations (1,875
turns) written for this project as *training* prompts in the same manner, in the same nine
categories, sharing no run of 8 words with the evaluation suites or the dev suite and holding
no near-duplicate turn (tested). They are the human-written counterpart of the teacher-written
user turns of the self-distilled corpus.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from importlib import resources
from os import PathLike
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

__all__ = [
    "MTBENCH_FILE",
    "HUMANEVAL_FILE",
    "DEV_FILE",
    "WRITTEN_FILE",
    "HUMANEVAL_COUNT",
    "HUMANEVAL_TEMPLATE",
    "SUITES",
    "DEFAULT_CATEGORY",
    "Turn",
    "Conversation",
    "count_turns",
    "per_category",
    "iter_turns",
    "load_prompts",
    "evaluation_texts",
    "load_suite",
    "written_prompts",
]

MTBENCH_FILE = "mt_bench_questions.jsonl"
HUMANEVAL_FILE = "HumanEval.jsonl.gz"
DEV_FILE = "dev_prompts.jsonl"
WRITTEN_FILE = "written_prompts.jsonl"
HUMANEVAL_COUNT = 80
# The user turn sent for a HumanEval problem; ``{prompt}`` is the problem's signature and
# docstring with trailing whitespace removed.
HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function in a Python "
    "code block.\n\n```python\n{prompt}\n```"
)
SUITES = ("mtbench", "humaneval", "mtbench-humaneval", "dev")
DEFAULT_CATEGORY = "general"
_ID_KEYS = ("id", "question_id", "task_id")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Turn:
    """One user message of a conversation (the unit benchmarks time)."""

    conversation_id: str
    category: str
    index: int  # 0 for the opening message
    text: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conversation:
    """User messages sent in order, each after the model's answer to the previous one."""

    id: str
    category: str
    turns: tuple[str, ...]

    def iter_turns(self) -> Iterator[Turn]:
        """The turns as :class:`Turn` records, in order."""
        for index, text in enumerate(self.turns):
            yield Turn(conversation_id=self.id, category=self.category, index=index, text=text)


def count_turns(conversations: Iterable[Conversation]) -> int:
    """Total user turns over ``conversations``."""
    return sum(len(c.turns) for c in conversations)


def per_category(conversations: Sequence[Conversation], n: int) -> list[Conversation]:
    """The first ``n`` conversations of every category, in the original order (a small
    sample that still covers every category, e.g. for per-category comparisons)."""
    if n < 1:
        raise ValueError(f"per-category count must be >= 1, got {n}")
    seen: dict[str, int] = {}
    chosen = []
    for c in conversations:
        seen[c.category] = seen.get(c.category, 0) + 1
        if seen[c.category] <= n:
            chosen.append(c)
    return chosen


def iter_turns(conversations: Iterable[Conversation]) -> Iterator[Turn]:
    """Every turn of every conversation, in order."""
    for conversation in conversations:
        yield from conversation.iter_turns()


def load_prompts(path: str | PathLike) -> list[Conversation]:
    """Read conversations from a JSON Lines file (``.gz`` compressed or plain).

    Each non-blank line is an object with ``turns`` (a non-empty list of strings) or ``prompt``
    (one string, a single turn); an id under ``id``, ``question_id`` or ``task_id`` (string or
    integer, unique in the file); and optionally ``category`` (default ``"general"``).

    Raises:
      ValueError: naming the file and line of the first malformed line, a duplicate id, or a
        file without any conversation.
    """
    path = Path(path)
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return _parse(data, str(path))


def _parse(data: bytes, source: str) -> list[Conversation]:
    conversations: list[Conversation] = []
    first_line: dict[str, int] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{source}: not UTF-8 text ({err})") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        conversation = _parse_line(line, f"{source}, line {number}")
        if conversation.id in first_line:
            raise ValueError(
                f"{source}, line {number}: duplicate id {conversation.id!r} "
                f"(first on line {first_line[conversation.id]})"
            )
        first_line[conversation.id] = number
        conversations.append(conversation)
    if not conversations:
        raise ValueError(f"{source}: no conversations (the file is empty)")
    return conversations


def _parse_line(line: str, where: str) -> Conversation:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if (
            not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) and t.strip() for t in turns)
        ):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    elif "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        turns = [record["prompt"]]
    else:
        raise ValueError(f"{where}: missing 'turns' (list of user messages) or 'prompt'")
    key = next((k for k in _ID_KEYS if k in record), None)
    if key is None:
        raise ValueError(f"{where}: missing an id (one of {list(_ID_KEYS)})")
    ident = record[key]
    if isinstance(ident, bool) or not isinstance(ident, (str, int)) or str(ident) == "":
        raise ValueError(
            f"{where}: {key!r} must be a non-empty string or an integer, got {ident!r}"
        )
    category = record.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str):
        raise ValueError(f"{where}: 'category' must be a string, got {category!r}")
    return Conversation(id=str(ident), category=category, turns=tuple(turns))


def _read_data(name: str) -> bytes:
    data = (resources.files("eaglepangu_jax") / "data" / name).read_bytes()
    return gzip.decompress(data) if name.endswith(".gz") else data


def _mtbench() -> list[Conversation]:
    return _parse(_read_data(MTBENCH_FILE), MTBENCH_FILE)


def _humaneval() -> list[Conversation]:
    problems = _parse(_read_data(HUMANEVAL_FILE), HUMANEVAL_FILE)[:HUMANEVAL_COUNT]
    return [
        Conversation(
            id=p.id,
            category="humaneval",
            turns=(HUMANEVAL_TEMPLATE.format(prompt=p.turns[0].rstrip()),),
        )
        for p in problems
    ]


def evaluation_texts() -> list[str]:
    """Every text the shipped suites could ever show the teacher: all MT-Bench turns and all
    HumanEval problems (not only the first :data:`HUMANEVAL_COUNT`). Training data is checked
    against these (:class:`eaglepangu_jax.training.synth.EvalGuard`)."""
    mtbench = [turn for conv in _mtbench() for turn in conv.turns]
    humaneval = [p.turns[0] for p in _parse(_read_data(HUMANEVAL_FILE), HUMANEVAL_FILE)]
    return mtbench + humaneval


def written_prompts() -> list[Conversation]:
    """The training prompts written for the project (see the module docstring)."""
    return _parse(_read_data(WRITTEN_FILE), WRITTEN_FILE)


def load_suite(name: str) -> list[Conversation]:
    """A shipped suite by name (see the module docstring).

    Raises:
      ValueError: unknown name, listing the known suites.
    """
    if name == "mtbench":
        return _mtbench()
    if name == "humaneval":
        return _humaneval()
    if name == "mtbench-humaneval":
        return _mtbench() + _humaneval()
    if name == "dev":
        return _parse(_read_data(DEV_FILE), DEV_FILE)
    raise ValueError(f"unknown suite {name!r}; known suites: {list(SUITES)}")
