"""Synthetic training prompts for the draft head, disjoint from the evaluation suites.

Recipe (deterministic, no network, no evaluation data):

* **Chat / writing / reasoning**: every combination of a topic (``TOPICS``) and an instruction
  kind (``INSTRUCTIONS``: explain, list, letter, story, compare, plan, ...), rendered from a
  template such as ``"Write a short story about {topic}."``. MT-Bench questions are long,
  specific multi-sentence tasks; these are one-line generic requests over a disjoint topic list.
* **Code**: for public functions of a fixed list of Python standard-library modules, the first
  paragraph of the function's own docstring (read with :mod:`inspect`) becomes the task
  ``"Write a Python function `name(signature)` that <docstring>"``. HumanEval problems are
  hand-written puzzles, not stdlib re-implementations.

The code tasks are read from ``data/code_prompts.json``, made once with
:func:`code_prompts_from_stdlib` under Python 3.11: docstrings and signatures change between
Python versions, and the prompts are hashed into the corpus shards' keys, so building them
afresh made another corpus on another Python (a GPU machine with Python 3.12 answered new
shards instead of extending the shipped corpus). Both lists are interleaved and shuffled with a
fixed seed, so ``training_prompts(n)`` is a pure function of ``n`` and ``seed``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
from importlib import resources

__all__ = [
    "TOPICS",
    "INSTRUCTIONS",
    "CODE_MODULES",
    "chat_prompts",
    "code_prompts",
    "CODE_PROMPTS_FILE",
    "code_prompts_from_stdlib",
    "training_prompts",
]

TOPICS = (
    "volcanoes",
    "honey bees",
    "the printing press",
    "solar panels",
    "coral reefs",
    "chess openings",
    "bread baking",
    "the water cycle",
    "electric cars",
    "public libraries",
    "jazz music",
    "the immune system",
    "recycling plastics",
    "mountain hiking",
    "the history of maps",
    "black holes",
    "urban gardening",
    "time management",
    "learning a new language",
    "remote work",
    "ancient Egypt",
    "the stock market",
    "photosynthesis",
    "bicycles",
    "rainforests",
    "video game design",
    "healthy sleep",
    "the moon landing",
    "wind turbines",
    "coffee",
    "earthquakes",
    "board games",
    "the human heart",
    "origami",
    "renewable energy",
    "penguins",
    "cloud computing",
    "the Roman Empire",
    "meditation",
    "weather forecasting",
)

INSTRUCTIONS = (
    "Explain {topic} to a ten-year-old.",
    "Give me five interesting facts about {topic}.",
    "Write a short story about {topic}.",
    "Write a short poem about {topic}.",
    "What are the advantages and disadvantages of {topic}?",
    "Write a friendly email inviting a colleague to a talk about {topic}.",
    "Summarize the most important ideas about {topic} in one paragraph.",
    "Make a step-by-step plan for a beginner who wants to learn about {topic}.",
    "Why do people find {topic} interesting? Answer with three reasons.",
    "Write a blog post introduction about {topic}.",
    "Describe a common misconception about {topic} and correct it.",
    "Create a short quiz with three questions about {topic}.",
)

CODE_MODULES = (
    "textwrap",
    "string",
    "os.path",
    "shutil",
    "json",
    "base64",
    "calendar",
    "fnmatch",
    "glob",
    "heapq",
    "bisect",
    "statistics",
    "random",
    "colorsys",
    "difflib",
    "html",
    "urllib.parse",
    "copy",
    "functools",
    "itertools",
)


def chat_prompts() -> list[str]:
    """Every topic x instruction request (``len(TOPICS) * len(INSTRUCTIONS)`` prompts)."""
    return [kind.format(topic=topic) for topic in TOPICS for kind in INSTRUCTIONS]


def _first_paragraph(doc: str) -> str:
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(paragraph.split())


def _signature(fn) -> str:
    """``(a, b=1, ...)`` with defaults whose repr holds an object address elided: the prompt
    text must not change between runs, since it is hashed into the shard keys."""
    parts = []
    for param in inspect.signature(fn).parameters.values():
        text = str(param)
        parts.append(f"{param.name}=..." if " at 0x" in text else text)
    return "(" + ", ".join(parts) + ")"


CODE_PROMPTS_FILE = "code_prompts.json"


def code_prompts() -> list[str]:
    """The stored tasks made from standard-library docstrings (see the module docstring)."""
    path = resources.files("eaglepangu_jax") / "data" / CODE_PROMPTS_FILE
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        prompts = stored["prompts"]
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError("'prompts' is not a list of strings")
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"{path}: unreadable stored code prompts ({err}); reinstall the package"
        ) from err
    return prompts


def code_prompts_from_stdlib() -> list[str]:
    """Tasks made from the docstrings of public standard-library functions of the running
    Python (how ``data/code_prompts.json`` was made; another Python version gives others)."""
    out = []
    for module_name in CODE_MODULES:
        module = importlib.import_module(module_name)
        for name, fn in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            if getattr(fn, "__module__", None) != module.__name__ or not fn.__doc__:
                continue
            text = _first_paragraph(fn.__doc__)
            if not 20 <= len(text) <= 300:
                continue
            try:
                signature = _signature(fn)
            except (TypeError, ValueError):
                continue
            out.append(
                f"Write a Python function `{name}{signature}` that does the following: {text}"
            )
    return out


def training_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """Chat and code prompts interleaved (about one code task per two chat requests),
    shuffled with ``seed``; the first ``n`` (all when ``None``)."""
    rng = random.Random(seed)
    chat, code = chat_prompts(), code_prompts()
    rng.shuffle(chat)
    rng.shuffle(code)
    mixed = []
    while chat or code:
        for source, take in ((chat, 2), (code, 1)):
            for _ in range(take):
                if source:
                    mixed.append(source.pop())
    return mixed if n is None else mixed[:n]
