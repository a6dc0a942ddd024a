#!/usr/bin/env bash
# Reproduces the shipped SmolLM2 drafters (eagle_trt/drafters/smollm2-eagle3.1 and -eagle3):
# the same data, budget and seed for both variants. Every stage is resumable: run the script
# again after an interruption and it continues where it stopped.
#
#   bash scripts/train_smollm2_drafters.sh            # ~2.6 h on 2 CPU cores (regen ~25 min, features ~30 min, training ~100 min)
#   STEPS=1600 bash scripts/train_smollm2_drafters.sh # continue both runs to a later step count
set -euo pipefail
CACHE=${EAGLE_TRT_CACHE:-$HOME/.cache/eagle_trt}
STEPS=${STEPS:-800}
REGEN=$CACHE/regen/smollm2-greedy.json
mkdir -p "$CACHE/runs"

# 1. The target's own greedy answers to 672 ShareGPT first turns (MT-bench guarded).
[ -f "$REGEN" ] || python -m eagle_trt.train.regenerate --target smollm2 --out "$REGEN" \
    --max-prompts 672 --max-new-tokens 192 --batch-size 48 --threads 2

# 2. Target features, computed once and shared by both runs: the regenerated answers, and 400
#    original ShareGPT conversations (ChatGPT answers, multi-turn).
python -m eagle_trt.train --target smollm2 --features-only --threads 2 \
    --data "$REGEN" --max-samples 1200 --features-dir "$CACHE/feat-smollm2-regen"
python -m eagle_trt.train --target smollm2 --features-only --threads 2 \
    --max-samples 400 --features-dir "$CACHE/feat-smollm2"

# 3. Both variants side by side, one core each, identical options apart from --variant.
for variant in eagle3.1 eagle3; do
    python -m eagle_trt.train --target smollm2 --variant "$variant" --out "$CACHE/runs/smollm2-$variant" \
        --data "$REGEN" --max-samples 1200 --features-dir "$CACHE/feat-smollm2-regen" \
        --extra-features-dir "$CACHE/feat-smollm2" --draft-vocab 8192 --steps "$STEPS" --batch-size 4 \
        --lr 1e-3 --warmup-steps 20 --ttt-steps 3 --autocast none --seed 0 --eval-sequences 16 --save-every 50 \
        --threads 1 --resume > "$CACHE/runs/smollm2-$variant.log" 2>&1 &
done
wait
echo "drafters: $CACHE/runs/smollm2-eagle3.1/drafter $CACHE/runs/smollm2-eagle3/drafter"
# 4. Into the package, with a compact train log:
#    python scripts/ship_drafters.py "$CACHE/runs/smollm2-eagle3.1" eagle_trt/drafters/smollm2-eagle3.1
#    python scripts/ship_drafters.py "$CACHE/runs/smollm2-eagle3" eagle_trt/drafters/smollm2-eagle3
