#!/usr/bin/env bash
# Does the captured (CUDA-graph) iteration make speculative decoding fast on a GPU? The GPU check
# of the static-shape runtime (eagle_trt/runtime/static.py), as one prepared script that fits a
# 15-minute device window in under 8 minutes:
#   1. SmolLM2-135M-Instruct converted from the carried GGUF, the machine described;
#   2. bf16: captured speculative decoding (trees 3,2,4 and 5,8,60) against captured plain decoding,
#      transformers with a StaticCache (compiled) and transformers eager, 10 MT-bench prompts x 128
#      tokens, then the captured rows 8 streams at once (python -m eagle_trt.bench --rows ...: the rows
#      it measures on a GPU, eagle_trt/bench_rows.py; --concurrency 8);
#   3. parity of the exported fp32 graphs (target, drafter tree, iteration) on ONNX Runtime's CUDA
#      provider against PyTorch, output by output (python -m eagle_trt.parity --provider cuda);
#   4. fp32: the same captured rows (speculative must equal plain decoding token for token) and
#      the graphs decoding on ONNX Runtime's CUDA provider, plain and through the iteration graph,
#      with the KV caches on the GPU and (host-kv) in host memory, against the same graphs on its
#      CPU provider (`same as cpu`: must be every prompt);
#   5. the captured rows with torch.compile (inductor) under the capture: warm-up and tok/s.
# Each step has its own timeout and writes its log and JSON under $OUT (what the device tool
# brings back); summary.txt collects every table.
#
#   on the GPU machine, after the carried parts (../shared/gpu/carry.sh calls):
#     bash .device/kit/carry.sh unpack && PYTHONPATH=/root/ortsite:/root/site:$PWD bash scripts/gpu_check.sh
#   dry run on a CPU (small sizes, no capture; checks the script and the code paths):
#     DRY=1 OUT=/tmp/gpu-check bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if [ "${DRY:-0}" = 1 ]; then CACHE=$HOME/.cache/eagle_trt; else CACHE=/root/cache; fi
export EAGLE_TRT_CACHE=${EAGLE_TRT_CACHE:-$CACHE} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}   # the venv here, the image's python there
if [ "${DRY:-0}" = 1 ]; then
  DEV="--device cpu --threads 1"; PROMPTS=2; TOKENS=16; TREES="3,2,4"; STREAMS=2; SCALE=4; PROVIDER=cpu
else
  DEV="--device cuda"; PROMPTS=10; TOKENS=128; TREES="3,2,4;5,8,60"; STREAMS=8; SCALE=1; PROVIDER=cuda
fi
BENCH="$PY -m eagle_trt.bench $DEV --workloads mtbench --prompts $PROMPTS --max-new-tokens $TOKENS --tree $TREES --repeats 1"
BATCHED="--concurrency $STREAMS --concurrency-prompts $PROMPTS --concurrency-repeats 1"   # the captured rows batched
summary=$OUT/summary.txt
: > "$summary"

step() {   # step NAME SECONDS COMMAND...: run it with a timeout, its log in $OUT, its tail in the summary
  local name=$1 limit=$(($2 * SCALE)); shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  { echo "== $name: exit $rc in $((SECONDS - start)) s (limit $limit s)"; tail -n 25 "$OUT/$name.log"; echo; } >> "$summary"
  tail -n 25 "$OUT/$name.log"
}

step setup 150 "$PY" - <<'PYEOF'
import os, sys, time, torch
from pathlib import Path
from eagle_trt.checkpoints import cache_dir, convert_gguf, smollm2_gguf
folder = cache_dir() / "smollm2-135m-instruct"
gguf = next(iter(sorted(Path("/root/stash").glob("*.gguf"))), None) if Path("/root/stash").is_dir() else None
start = time.perf_counter()
if not (folder / "config.json").is_file():
    convert_gguf(gguf or smollm2_gguf(), folder)
print(f"target in {folder} ({time.perf_counter() - start:.0f} s)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, {os.cpu_count()} cores")
import onnxruntime as ort
print(f"onnxruntime {ort.__version__} from {ort.__file__}: {ort.get_available_providers()}")
PYEOF

step bf16 240 $BENCH --dtype bfloat16 $BATCHED \
  --rows captured-plain,captured-speculative,transformers-compiled,transformers-eager --out "$OUT/bf16"
# the exported fp32 graphs on ONNX Runtime's CUDA provider against PyTorch, output by output
# (tree 3,2,4; the graphs stay in $GRAPHS for the fp32 bench's ONNX Runtime rows)
GRAPHS=$EAGLE_TRT_CACHE/parity-$PROVIDER
step parity 150 "$PY" -m eagle_trt.parity --provider "$PROVIDER" --iteration-graph --prompts 2 \
  --depth 3 --tree-top-k 2 --total-tokens 4 --out "$GRAPHS"
step fp32 300 $BENCH --dtype float32 $BATCHED --onnx-dir "$GRAPHS/graphs" --drafter-weights float32 \
  --rows captured-plain,captured-speculative,onnxruntime-cuda,onnxruntime-cuda-host-kv,onnxruntime-cpu --out "$OUT/fp32"
[ "${DRY:-0}" = 1 ] && { echo "== compiled: skipped in the dry run (inductor on 2 CPU cores takes many minutes)" >> "$summary"; } ||
step compiled 150 $BENCH --dtype bfloat16 --tree "${TREES%%;*}" --compile \
  --rows captured-plain,captured-speculative --out "$OUT/compiled"
echo "summary: $summary"
