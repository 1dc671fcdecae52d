"""Teacher speed: JAX greedy decoding against transformers greedy on the same GGUF weights.

For each prompt (the first turns of a few MT-Bench questions and HumanEval problems, under the
chat template) both generate the same number of new tokens, interleaved prompt by prompt so
that machine noise hits both alike. Reported per prompt: end-to-end tokens/s of each and their
ratio, decode-only milliseconds per token (prefill subtracted) and the fraction of the
memory-bandwidth floor that JAX reaches (floor = weight bytes read per token / copy bandwidth
measured with numpy). With ``--verify-curve``, the cost of one verification forward over N
tree nodes relative to N = 1, at a few committed context lengths.

    python bench/greedy.py --json greedy.json --verify-curve
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

from eaglepangu_jax import cache as kv_cache
from eaglepangu_jax.calibration.measure import measure_grid
from eaglepangu_jax.engine.config import SpecConfig
from eaglepangu_jax.engine.decode import Teacher, generate, prefill
from eaglepangu_jax.evaluation import suites
from eaglepangu_jax.files import write_text_atomic
from eaglepangu_jax.methods import peers
from eaglepangu_jax.models import chat, llama, smollm2, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    config, params = smollm2.load_smollm2()
    params = jax.block_until_ready(llama.prepare_params(params))
    bandwidth = measure_bandwidth()
    weight_bytes = _streamed_bytes(params)
    result = {
        # The machine may be shared: the load average says how much the numbers can be trusted.
        "load_average_start": os.getloadavg()[0],
        "bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes": weight_bytes,
        "floor_ms_per_token": 1e3 * weight_bytes / bandwidth,
        "new_tokens": args.new_tokens,
    }
    if not args.no_greedy:
        result["greedy"] = _greedy_rows(args, config, params)
    if args.verify_curve:
        result["verify_curve"] = verify_curve(
            params, config, args.contexts, args.nodes, args.repeats_verify
        )
    result["load_average_end"] = os.getloadavg()[0]
    _print_report(result)
    if args.json:
        _write_json(args.json, result)
    return 0


def measure_bandwidth(megabytes: int = 256, repeats: int = 10) -> float:
    """Memory bandwidth in bytes/s: a numpy copy reads and writes ``megabytes`` each."""
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * src.nbytes / best


def _streamed_bytes(params: dict) -> int:
    """Bytes one decode step reads: every layer weight, final norm and the output head (the
    embedding table is only gathered, one row)."""
    leaves = jax.tree.leaves((params["layers"], params["final_norm"], params["lm_head"]))
    return sum(x.nbytes for x in leaves)


def _greedy_rows(args, config, params) -> list[dict]:
    prompts = _prompts(args.mtbench, args.humaneval)
    peers.set_torch_threads(args.torch_threads)
    model = peers.load_transformers_teacher()
    rows = []
    for name, ids in prompts:
        # Warm-up run of both: compilation (JAX) and allocator warm-up (torch) are not timed.
        _jax_generate(params, config, ids, args.new_tokens)
        _hf_generate(model, ids, args.new_tokens, config.eos_id)
        jax_times, hf_times, jax_pre, hf_pre = [], [], [], []
        for _ in range(args.repeats):
            jax_pre.append(
                _timed(lambda ids=ids: _jax_prefill(params, config, ids, args.new_tokens))
            )
            t0 = time.perf_counter()
            ours = _jax_generate(params, config, ids, args.new_tokens)
            jax_times.append(time.perf_counter() - t0)
            hf_pre.append(_timed(lambda ids=ids: _hf_generate(model, ids, 1, config.eos_id)))
            t0 = time.perf_counter()
            theirs = _hf_generate(model, ids, args.new_tokens, config.eos_id)
            hf_times.append(time.perf_counter() - t0)
        n = args.new_tokens
        jax_t, hf_t = min(jax_times), min(hf_times)
        jax_step = (jax_t - min(jax_pre)) / max(n - 1, 1)
        hf_step = (hf_t - min(hf_pre)) / max(n - 1, 1)
        rows.append(
            {
                "prompt": name,
                "prompt_tokens": len(ids),
                "new_tokens": n,
                "jax_tokens_per_s": n / jax_t,
                "hf_tokens_per_s": n / hf_t,
                "ratio": hf_t / jax_t,
                "jax_decode_ms": 1e3 * jax_step,
                "hf_decode_ms": 1e3 * hf_step,
                "same_tokens_until_eos": _same_until_eos(ours, theirs, config.eos_id),
            }
        )
        print(
            f"  {name}: jax {n / jax_t:.1f} tok/s, transformers {n / hf_t:.1f} tok/s",
            file=sys.stderr,
        )
    return rows


def verify_curve(params, config, contexts, nodes, repeats) -> list[dict]:
    """Milliseconds of one verify forward over ``N`` nodes after ``c`` committed tokens.

    Timed by :func:`eaglepangu_jax.calibration.measure.measure_grid`: the engine's own verify
    forward, every point compiled first, then timed round-robin (so that load from other processes
    biases no single ``N``) and the median of ``repeats`` runs kept.
    """
    samples = measure_grid(Teacher(config, params), nodes, contexts, repeats)
    rows = []
    for c in contexts:
        base = next(x.seconds for x in samples if x.context == c and x.slots == nodes[0])
        for x in (x for x in samples if x.context == c):
            rows.append(
                {
                    "context": c,
                    "nodes": x.slots,
                    "window": x.window,
                    "ms": 1e3 * x.seconds,
                    "relative": x.seconds / base,
                }
            )
        print(f"  verify curve, context {c}: done", file=sys.stderr)
    return rows


def _jax_prefill(params, config, ids, new_tokens):
    slots = 1 << (len(ids) + new_tokens - 1).bit_length()
    cache = kv_cache.init(config.num_layers, slots, config.num_kv_heads, config.head_dim)
    cache, _ = prefill(params, config, np.asarray(ids, np.int32), cache)
    jax.block_until_ready(cache)


def _jax_generate(params, config, ids, new_tokens):
    """Plain greedy decoding through the engine (no drafter), stopping at eos."""
    spec = SpecConfig(max_new_tokens=new_tokens)
    return np.asarray(generate(Teacher(config, params), None, list(ids), spec).tokens)


def _prompts(n_mtbench: int, n_humaneval: int) -> list[tuple[str, list[int]]]:
    tok = tokenizer.load_tokenizer()
    chosen = suites.load_suite("mtbench")[:n_mtbench] + suites.load_suite("humaneval")[:n_humaneval]
    return [
        (f"{c.category}:{c.id}", chat.encode_chat(tok, [{"role": "user", "content": c.turns[0]}]))
        for c in chosen
    ]


def _hf_generate(model, ids, new_tokens, eos_id) -> list[int]:
    # Forced to the full length (eos suppressed): both sides time the same token count.
    return peers.transformers_generate(
        model, ids, max_new_tokens=new_tokens, eos_id=eos_id, force_length=True
    ).tokens


def _same_until_eos(ours, theirs, eos_id) -> bool:
    """Equal up to our first EOS (transformers is forced past EOS to match the count)."""
    ours = list(ours)
    stop = ours.index(eos_id) if eos_id in ours else len(ours)
    return ours[:stop] == list(theirs)[:stop]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _print_report(result: dict) -> None:
    floor = result["floor_ms_per_token"]
    print(
        f"\nload average {result['load_average_start']:.1f} -> "
        f"{result['load_average_end']:.1f}; "
        f"bandwidth {result['bandwidth_gb_s']:.1f} GB/s, weights streamed per token "
        f"{result['weight_bytes'] / 1e6:.0f} MB, floor {floor:.1f} ms/token"
    )
    if "greedy" in result:
        print(
            "\n| prompt | P | new | JAX tok/s | HF tok/s | ratio | JAX ms/tok | HF ms/tok "
            "| floor frac | same |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in result["greedy"]:
            print(
                f"| {r['prompt']} | {r['prompt_tokens']} | {r['new_tokens']} "
                f"| {r['jax_tokens_per_s']:.1f} | {r['hf_tokens_per_s']:.1f} "
                f"| {r['ratio']:.2f} | {r['jax_decode_ms']:.1f} | {r['hf_decode_ms']:.1f} "
                f"| {floor / r['jax_decode_ms']:.2f} | {r['same_tokens_until_eos']} |"
            )
        jax_total = statistics.mean(r["jax_tokens_per_s"] for r in result["greedy"])
        hf_total = statistics.mean(r["hf_tokens_per_s"] for r in result["greedy"])
        print(
            f"| mean | | | {jax_total:.1f} | {hf_total:.1f} | {jax_total / hf_total:.2f} | | | | |"
        )
    if "verify_curve" in result:
        contexts = sorted({r["context"] for r in result["verify_curve"]})
        nodes = sorted({r["nodes"] for r in result["verify_curve"]})
        cell = {(r["context"], r["nodes"]): r for r in result["verify_curve"]}
        print("\nverify forward, ms (relative to N=1)")
        print("| context | " + " | ".join(f"N={n}" for n in nodes) + " |")
        print("|---" * (len(nodes) + 1) + "|")
        for c in contexts:
            print(
                f"| {c} | "
                + " | ".join(
                    f"{cell[c, n]['ms']:.1f} ({cell[c, n]['relative']:.2f}x)" for n in nodes
                )
                + " |"
            )


def _write_json(path: str, result: dict) -> None:
    """Write the report as indented JSON, atomically."""
    write_text_atomic(path, json.dumps(result, indent=2))


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mtbench", type=int, default=2, help="MT-Bench first turns to run")
    p.add_argument("--humaneval", type=int, default=2, help="HumanEval prompts to run")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per prompt (best kept)")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy comparison")
    p.add_argument("--verify-curve", action="store_true")
    p.add_argument("--contexts", type=_int_list, default=[128, 512, 1024])
    p.add_argument("--nodes", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--repeats-verify", type=int, default=5)
    p.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", help="write the results here (atomically)")
    return p.parse_args(argv)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    raise SystemExit(main())
