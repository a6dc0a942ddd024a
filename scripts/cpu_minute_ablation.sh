#!/usr/bin/env bash
# What makes a training CPU minute count: runs of equal CPU time from the same shipped EAGLE 3.1
# weights, on the same snapshot of the committed distillation set, one thread each, one
# change per run; held-out agreement per TTT step on data/distill/smollm2-val at the end.
#
#   BUDGET=8 bash scripts/cpu_minute_ablation.sh          # 8 min per run, runs one after another
#   RUNS="base share25" BUDGET=20 bash scripts/cpu_minute_ablation.sh
#   INIT=~/abl/start CHUNKS=6 RUNS="share25-freezehead groups16" taskset -c 1 bash scripts/cpu_minute_ablation.sh
# (INIT: the weights every run starts from, default the shipped ones; CHUNKS: the first N chunks
# of the set form the snapshot, default all)
set -euo pipefail
OUT=${OUT:-${EAGLE_TRT_CACHE:-$HOME/.cache/eagle_trt}/ablation-cpu-minute}
BUDGET=${BUDGET:-8}
RUNS=${RUNS:-"base share25 freezehead"}
INIT=${INIT:-eagle_trt/drafters/smollm2-eagle3.1}
CHUNKS=${CHUNKS:-100000}
SNAP="$OUT/snapshot/smollm2-sharegpt"          # the same chunks for every run, whatever is added meanwhile
if [ ! -d "$SNAP" ]; then
    mkdir -p "$SNAP"
    cp data/distill/smollm2-sharegpt/provenance.json "$SNAP/"
    for f in $(ls data/distill/smollm2-sharegpt/chunk_*.npz | head -n "$CHUNKS"); do ln -s "$(realpath "$f")" "$SNAP/"; done
fi
COMMON=(--target smollm2 --variant eagle3.1 --distill "$SNAP" --eval-distill data/distill/smollm2-val
        --init-from "$INIT" --batch-size 4 --lr 6e-4 --warmup-steps 20 --ttt-steps 3
        --seed 0 --steps 100000 --save-every 100000 --log-every 20 --threads 1
        --time-budget-min "$BUDGET" --schedule budget)
declare -A EXTRA=([base]="" [share25]="--ttt-share 0.25" [freezehead]="--freeze-head" [share50]="--ttt-share 0.5"
                  [share25-freezehead]="--ttt-share 0.25 --freeze-head"
                  [batch8]="--batch-size 8" [lr1e3]="--lr 1e-3"
                  [groups16]="--ttt-share 0.25 --freeze-head --length-groups 16"
                  [groups16-batch8]="--ttt-share 0.25 --freeze-head --length-groups 16 --batch-size 8")
for run in $RUNS; do
    # shellcheck disable=SC2086
    python -m eagle_trt.train "${COMMON[@]}" ${EXTRA[$run]} --out "$OUT/$run" > "$OUT/$run.log" 2>&1
done
python scripts/plot_training.py $(for r in $RUNS; do echo "$OUT/$r"; done) --out "$OUT/agreement.png"
