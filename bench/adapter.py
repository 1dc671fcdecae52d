"""Torch adapter against the JAX engine: decode tokens/s and the n-gram speed-up over greedy.

On the same SmolLM2 weights and the same chat-encoded HumanEval prompts, five methods run
interleaved prompt by prompt (machine noise hits them alike):

* ``jax/greedy``, ``jax/ngram``: :func:`eaglepangu_jax.engine.decode.generate`, rounds on
  device inside one ``while_loop``;
* ``torch/greedy``, ``torch/ngram``, ``torch/ngram-branches``:
  :func:`npu_backend.runner.generate_torch`, the host-driven loop with the teacher in torch
  (tree mode, and branches mode for chain-only kernels).

A run that compiled anything is discarded and repeated, so timings are steady-state decode
(prefill excluded). The speed-up is n-gram tokens/s over greedy tokens/s of the same
framework. Every method must emit the greedy tokens (``same_tokens``). Also reported: the
bridge's JAX -> torch -> JAX round trip for one step's mask and logits, against the torch
n-gram time per round.

    python bench/adapter.py --json adapter.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

from eaglepangu_jax.drafters.ngram import NGramDrafter
from eaglepangu_jax.engine import decode as engine
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.evaluation import suites
from eaglepangu_jax.evaluation.run import CompileWatch
from eaglepangu_jax.files import write_text_atomic
from eaglepangu_jax.models import chat, llama, smollm2, tokenizer
from npu_backend import bridge
from npu_backend.device import select_device
from npu_backend.llama_torch import TorchLlama
from npu_backend.runner import generate_torch

MAX_RUNS = 3
FRAMEWORKS = ("jax", "torch")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    config, weights = smollm2.load_smollm2()
    teacher = engine.Teacher(config, jax.block_until_ready(llama.prepare_params(weights)))
    device = select_device(args.device)
    model = TorchLlama(config, weights, device=device)
    spec = SpecConfig(budget=args.budget, depth=args.depth, max_new_tokens=args.new_tokens)
    drafter = NGramDrafter(budget=args.budget, depth=args.depth)
    methods = make_methods(teacher, model, drafter, spec, branches=not args.no_branches)
    prompts = load_prompts(args.prompts)
    rows = [run_prompt(methods, prompt) for prompt in prompts]
    report = {
        "device": device,
        "attention_impl": model.attention_impl,
        "new_tokens": args.new_tokens,
        "budget": args.budget,
        "depth": args.depth,
        "prompts": rows,
        "summary": summarize(rows, list(methods)),
        "bridge": bridge_overhead(config, spec, rows),
    }
    print(format_report(report))
    if args.json:
        write_json(args.json, report)
    return 0


def make_methods(
    teacher: engine.Teacher,
    model: TorchLlama,
    drafter: NGramDrafter,
    spec: SpecConfig,
    *,
    branches: bool,
) -> dict[str, Callable]:
    """Name -> ``prompt_ids -> GenerationResult``."""
    methods = {
        "jax/greedy": lambda p: engine.generate(teacher, None, p, spec),
        "jax/ngram": lambda p: engine.generate(teacher, drafter, p, spec),
        "torch/greedy": lambda p: generate_torch(model, None, p, spec),
        "torch/ngram": lambda p: generate_torch(model, drafter, p, spec),
    }
    if branches:
        methods["torch/ngram-branches"] = lambda p: generate_torch(
            model, drafter, p, spec, mode="branches"
        )
    return methods


def load_prompts(count: int) -> list[dict[str, Any]]:
    """The first ``count`` HumanEval turns under the chat template."""
    tok = tokenizer.load_tokenizer()
    turns = list(suites.iter_turns(suites.load_suite("humaneval")))[:count]
    return [
        {
            "id": t.conversation_id,
            "ids": chat.encode_chat(tok, [{"role": "user", "content": t.text}]),
        }
        for t in turns
    ]


def steady_run(method: Callable, prompt_ids: list[int]) -> engine.GenerationResult:
    """Run until a run does no compilation work (at most :data:`MAX_RUNS` runs)."""
    for _ in range(MAX_RUNS):
        watch = CompileWatch()
        with watch.active():
            result = method(prompt_ids)
        if watch.seconds == 0.0:
            break
    return result


def run_prompt(methods: dict[str, Callable], prompt: dict[str, Any]) -> dict[str, Any]:
    """Every method on one prompt, one after the other."""
    row: dict[str, Any] = {"id": prompt["id"], "prompt_tokens": len(prompt["ids"])}
    outputs = {}
    for name, method in methods.items():
        result = steady_run(method, prompt["ids"])
        outputs[name] = result.tokens
        s = result.stats
        row[name] = {
            "tokens_per_s": s.tokens_per_s,
            "new_tokens": s.new_tokens,
            "rounds": s.rounds,
            "accepted_length": s.accepted_length,
            "seconds": s.seconds,
            "prefill_seconds": s.prefill_seconds,
        }
        print(
            f"  {prompt['id']:<14} {name:<22} {s.tokens_per_s:7.2f} tok/s  "
            f"AAL {s.accepted_length:4.2f}",
            file=sys.stderr,
            flush=True,
        )
    reference = outputs["jax/greedy"]
    row["same_tokens"] = all(tokens == reference for tokens in outputs.values())
    for fw in FRAMEWORKS:
        row[f"{fw}/speedup"] = (
            row[f"{fw}/ngram"]["tokens_per_s"] / row[f"{fw}/greedy"]["tokens_per_s"]
        )
    return row


def summarize(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Means over prompts."""
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {
            key: statistics.mean(r[name][key] for r in rows)
            for key in ("tokens_per_s", "accepted_length")
        }
    for fw in FRAMEWORKS:
        out[f"{fw}/speedup"] = statistics.mean(r[f"{fw}/speedup"] for r in rows)
    if "torch/ngram-branches" in names:
        out["torch/branches_speedup"] = statistics.mean(
            r["torch/ngram-branches"]["tokens_per_s"] / r["torch/greedy"]["tokens_per_s"]
            for r in rows
        )
    out["same_tokens"] = all(r["same_tokens"] for r in rows)
    return out


def bridge_overhead(config, spec: SpecConfig, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Round-trip seconds of one step's crossings (mask in, logits out) and their share of a
    torch n-gram round."""
    n = spec.budget + 1
    window = engine.MIN_WINDOW
    logits = bridge.measure_roundtrip_overhead((n, config.vocab_size), dtype=jnp.float32)
    mask = bridge.measure_roundtrip_overhead((n, window), dtype=jnp.bool_)
    per_round = statistics.mean(
        r["torch/ngram"]["seconds"] / r["torch/ngram"]["rounds"] for r in rows
    )
    return {
        "logits_roundtrip_s": logits,
        "mask_roundtrip_s": mask,
        "per_step_s": logits + mask,
        "torch_ngram_round_s": per_round,
        "share_of_round": (logits + mask) / per_round,
    }


def format_report(report: dict[str, Any]) -> str:
    summary = report["summary"]
    names = [k for k in summary if "/" in k and isinstance(summary[k], dict)]
    lines = [
        f"device {report['device']} ({report['attention_impl']}), "
        f"{report['new_tokens']} new tokens, budget {report['budget']}, "
        f"depth {report['depth']}",
        "",
        "| prompt | " + " | ".join(names) + " | jax speed-up | torch speed-up | same |",
        "|---" * (len(names) + 4) + "|",
    ]
    for r in report["prompts"]:
        cells = [f"{r[n]['tokens_per_s']:.1f} ({r[n]['accepted_length']:.2f})" for n in names]
        lines.append(
            f"| {r['id']} | "
            + " | ".join(cells)
            + f" | {r['jax/speedup']:.2f}x | {r['torch/speedup']:.2f}x | "
            f"{'yes' if r['same_tokens'] else 'NO'} |"
        )
    cells = [
        f"{summary[n]['tokens_per_s']:.1f} ({summary[n]['accepted_length']:.2f})" for n in names
    ]
    lines.append(
        "| mean | " + " | ".join(cells) + f" | {summary['jax/speedup']:.2f}x | "
        f"{summary['torch/speedup']:.2f}x | "
        f"{'yes' if summary['same_tokens'] else 'NO'} |"
    )
    b = report["bridge"]
    lines += [
        "",
        "cells: decode tokens/s (accepted length per round)",
        f"bridge round trip per step: logits {1e6 * b['logits_roundtrip_s']:.0f} us + "
        f"mask {1e6 * b['mask_roundtrip_s']:.0f} us = {1e3 * b['per_step_s']:.3f} ms, "
        f"{100 * b['share_of_round']:.2f}% of a torch n-gram round "
        f"({1e3 * b['torch_ngram_round_s']:.1f} ms)",
    ]
    if "torch/branches_speedup" in summary:
        lines.append(
            f"torch branches mode speed-up over torch greedy: "
            f"{summary['torch/branches_speedup']:.2f}x"
        )
    return "\n".join(lines)


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write the report as indented JSON, atomically."""
    write_text_atomic(path, json.dumps(report, indent=2))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=3, help="HumanEval prompts (default 3)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16, help="tree nodes per round")
    p.add_argument("--depth", type=int, default=8, help="deepest draft node")
    p.add_argument(
        "--device", default=None, help="torch device (default: EAGLEPANGU_DEVICE, else auto)"
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads (default: torch's own choice)",
    )
    p.add_argument("--no-branches", action="store_true", help="skip branches mode")
    p.add_argument("--json", help="write the results here (atomically)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
