#!/usr/bin/env bash
# What each CPU training choice buys: {noise, target-layer} drafter init x {fp32, bf16 autocast},
# same data, steps and seed, EAGLE 3.1, 5 TTT steps. Prints held-out top-1 agreement per TTT step
# at each evaluation and the wall time per step (scripts/cpu_train_ablation.py reads the logs).
#
#   bash scripts/cpu_train_ablation.sh        # ~15 min on 2 idle CPU cores
#   DEVICE=cuda STEPS=400 bash scripts/cpu_train_ablation.sh
set -euo pipefail
OUT=${OUT:-${EAGLE_TRT_CACHE:-$HOME/.cache/eagle_trt}/ablation}
STEPS=${STEPS:-60}
DEVICE=${DEVICE:-cpu}
COMMON=(--target smollm2 --variant eagle3.1 --max-samples 100 --max-len 256 --features-dir "$OUT/feat"
        --draft-vocab 8192 --steps "$STEPS" --batch-size 4 --lr 1e-3 --warmup-steps 10 --ttt-steps 5 --seed 0
        --eval-sequences 16 --save-every 20 --device "$DEVICE" --threads 2)
mkdir -p "$OUT"
python -m eagle_trt.train "${COMMON[@]}" --features-only
for init in noise target-layer; do
    for amp in none bf16; do
        python -m eagle_trt.train "${COMMON[@]}" --init "$init" --autocast "$amp" --out "$OUT/$init-$amp" --resume \
            > "$OUT/$init-$amp.log" 2>&1
    done
done
python scripts/cpu_train_ablation.py "$OUT"
