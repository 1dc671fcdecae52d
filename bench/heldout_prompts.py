"""The corpus's held-out user turns as a bench prompt file (JSON Lines, one turn each).

Used to tell a drafter's two gaps apart: the engine on the prompts it was trained for (the
held-out shards' teacher-written and template prompts, never trained on) against the engine on
the human-written evaluation suites. Every ``len(held-out) // count``-th conversation is taken,
in manifest order, so the file is the same on every machine::

    python3 bench/heldout_prompts.py --corpus eaglepangu_jax/data/corpus --count 17 \\
        --out heldout17.jsonl
    eaglepangu bench --prompts heldout17.jsonl --methods greedy,draft-distilled \\
        --policy drafter --depth 4 --json OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The stored prompt ids are the teacher's ChatML rendering (models/chat.py): a system turn,
# one user turn, then the assistant header. The bench renders the user text again itself.
_USER_OPEN, _TURN_CLOSE = "<|im_start|>user\n", "<|im_end|>"


def user_turn(rendered: str) -> str:
    """The user turn's text of one rendered single-turn prompt."""
    if rendered.count(_USER_OPEN) != 1:
        raise ValueError(f"expected exactly one user turn in {rendered[:80]!r}...")
    return rendered.split(_USER_OPEN, 1)[1].split(_TURN_CLOSE, 1)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", required=True, help="corpus folder (its manifest's split)")
    parser.add_argument("--count", type=int, default=17, help="prompts to write")
    parser.add_argument("--out", required=True, help="prompt file to write (.jsonl)")
    args = parser.parse_args()

    from eaglepangu_jax.files import atomic_write
    from eaglepangu_jax.models.tokenizer import load_tokenizer
    from eaglepangu_jax.training.corpus import load_corpus_shard
    from eaglepangu_jax.training.distill import read_manifest

    corpus = Path(args.corpus)
    manifest = read_manifest(corpus)
    tokenizer = load_tokenizer()
    prompts: list[str] = []
    for entry in manifest["shards"]:
        if entry["split"] != "heldout":
            continue
        shard = load_corpus_shard(corpus / "answers", entry["key"])
        if shard is None:
            raise SystemExit(f"held-out shard {entry['key']} is missing or corrupt")
        prompts.extend(user_turn(tokenizer.decode(ids)) for ids in shard.prompts())
    if not 1 <= args.count <= len(prompts):
        raise SystemExit(f"--count must be in [1, {len(prompts)}], got {args.count}")
    stride = len(prompts) // args.count
    lines = [
        json.dumps({"id": f"heldout-{i * stride}", "turns": [prompts[i * stride]]})
        for i in range(args.count)
    ]
    text = "\n".join(lines) + "\n"
    atomic_write(Path(args.out), lambda tmp: tmp.write_text(text))
    print(f"{args.count} of {len(prompts)} held-out prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
