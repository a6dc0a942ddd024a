#!/usr/bin/env bash
# One leg of the SmolLM2 drafter training campaign, for any fresh machine with 2 cores: grow a
# committed distillation set, then continue both shipped drafters (EAGLE 3.1 and EAGLE-3) with the
# same data, CPU time and seed, one core each, and ship them. Each leg adds to what the last
# one left in the repository (data/distill/, eagle_trt/drafters/); nothing else must survive.
#
#   GEN_MIN=45 TRAIN_MIN=55 bash scripts/train_smollm2_drafters.sh
#   GEN_SET=sampled GEN_MIN=120 TRAIN_MIN=0 bash scripts/train_smollm2_drafters.sh  # only more data
#   GEN_MIN=0 CHUNKS=20 TRAIN_MIN=45 bash scripts/train_smollm2_drafters.sh          # the first 20 chunks only
#   GEN_MIN=0 VARIANTS=eagle3 TRAIN_MIN=150 bash scripts/train_smollm2_drafters.sh   # one variant catching up
#   GEN_MIN=0 TRAIN_MIN=60 SETS="data/distill/smollm2-sharegpt data/distill/smollm2-sharegpt-later" bash ...
#
# The sets (docs/training.md#the-data): GEN_SET=first, the greedy answers to
# ShareGPT first turns (data/distill/smollm2-sharegpt, all 14,283 answered); later (the default),
# greedy answers to second and later turns after their conversation (smollm2-sharegpt-later);
# sampled, the first turns answered again at temperature 0.7 (smollm2-sharegpt-t07). A leg trains
# on every committed set (SETS overrides: folders, space-separated).
#
# On a machine that did not generate the data, the target features are recomputed from the ids:
# float32 ~290 tokens/s per core, bf16 autocast ~750 on a CPU with native bf16 (AVX-512 BF16 /
# AMX) and ~40 elsewhere: FEATURE_PRECISION=auto (the default) picks bfloat16 only where it is native. CHUNKS=K
# trains on the first K chunks only, so a leg's budget is not spent on features it has no time
# to train on (of the first-turn set; the other sets are trained on whole).
#
# Stages (each resumable; run the script again after an interruption):
# 1. python -m eagle_trt.train.regenerate, two workers: the target's answers for GEN_SET, chunk
#    by chunk (commit them), for GEN_MIN minutes; the held-out set data/distill/smollm2-val once.
# 2. python -m eagle_trt.train for both variants from the shipped weights (--init-from), cosine
#    decay over TRAIN_MIN minutes (--schedule budget), anchored TTT and a frozen head (what
#    docs/training.md#what-makes-a-cpu-minute-count found to pay), eval on the held-out set.
# 3. scripts/ship_drafters.py into eagle_trt/drafters/ (compact log with the lineage), unless the
#    run ended below the shipped drafter's held-out agreement.
set -euo pipefail
CACHE=${EAGLE_TRT_CACHE:-$HOME/.cache/eagle_trt}
GEN_MIN=${GEN_MIN:-45}
GEN_SET=${GEN_SET:-later}
TRAIN_MIN=${TRAIN_MIN:-55}
# Every continued leg dipped where the learning rate restarted (6e-4, 4e-4, 2e-4: held-out agreement
# passed its start only after 40-70% of a leg, and a 45-minute leg on 2026-11-26 never did); the
# leg of 2026-11-27 restarted at 5e-5 and did not dip (docs/training.md#findings-tried-and-dropped).
LR=${LR:-5e-5}
WARMUP=${WARMUP:-50}
FEATURE_PRECISION=${FEATURE_PRECISION:-auto}
# LOOP_CUT=N trains each sequence only through its first N tokens of looping answer text
# (eagle_trt/train/loops.py: 41% of the committed answers' tokens repeat the answer's own 9-grams)
LOOP_CUT=${LOOP_CUT:-0}
VARIANTS=${VARIANTS:-eagle3.1 eagle3}
RUN=$CACHE/runs/leg-$(date +%Y%m%d-%H%M)
mkdir -p "$RUN"

[ -f data/distill/smollm2-val/chunk_00000.npz ] || python -m eagle_trt.train.regenerate --out data/distill/smollm2-val \
    --split val --max-prompts 64 --threads 2
case "$GEN_SET" in
    first) GEN_ARGS=(--out data/distill/smollm2-sharegpt) ;;
    later) GEN_ARGS=(--out data/distill/smollm2-sharegpt-later --turns later --stop-loops 16 --max-prompt-tokens 512) ;;
    sampled) GEN_ARGS=(--out data/distill/smollm2-sharegpt-t07 --temperature 0.7 --top-p 0.95 --seed 0 --stop-loops 16) ;;
    *) echo "GEN_SET must be first, later or sampled, got '$GEN_SET'" >&2; exit 2 ;;
esac
if [ "$GEN_MIN" != 0 ]; then
    for w in 0 1; do
        python -m eagle_trt.train.regenerate "${GEN_ARGS[@]}" --max-prompts 20480 \
            --workers 2 --worker $w --threads 1 --time-budget-min "$GEN_MIN" > "$RUN/regenerate-$w.log" 2>&1 &
    done
    wait
fi
[ "$TRAIN_MIN" != 0 ] || exit 0
# the chunks this leg trains on: all, or the first CHUNKS as a snapshot folder of the same name
# (the feature cache is keyed by the set's folder name, so it is shared with the full set)
DATA=data/distill/smollm2-sharegpt
if [ -n "${CHUNKS:-}" ]; then
    DATA=$RUN/snapshot/smollm2-sharegpt
    mkdir -p "$DATA"
    cp data/distill/smollm2-sharegpt/provenance.json "$DATA/"
    for f in $(ls data/distill/smollm2-sharegpt/chunk_*.npz | sort | head -n "$CHUNKS"); do ln -s "$(realpath "$f")" "$DATA/"; done
fi
DISTILL_ARGS=()
for folder in ${SETS:-data/distill/smollm2-sharegpt data/distill/smollm2-sharegpt-*}; do
    [ -f "$folder/provenance.json" ] || { echo "SETS: $folder is not a distillation set (no provenance.json)" >&2; exit 2; }
    [ "$folder" = data/distill/smollm2-sharegpt ] && folder=$DATA      # or its CHUNKS snapshot
    DISTILL_ARGS+=(--distill "$folder")
done
# target features of every chunk (those written on the side by regenerate on this machine are reused)
python -m eagle_trt.train --target smollm2 "${DISTILL_ARGS[@]}" \
    --eval-distill data/distill/smollm2-val --features-only --threads 2 --feature-precision "$FEATURE_PRECISION"
for variant in $VARIANTS; do
    python -m eagle_trt.train --target smollm2 --variant "$variant" --out "$RUN/$variant" \
        "${DISTILL_ARGS[@]}" --eval-distill data/distill/smollm2-val \
        --init-from "eagle_trt/drafters/smollm2-$variant" --batch-size 4 --lr "$LR" --warmup-steps "$WARMUP" \
        --ttt-steps 5 --ttt-share 0.25 --freeze-head --length-groups 16 --loop-cut "$LOOP_CUT" --seed 0 --steps 1000000 --save-every 200 --log-every 20 --threads 1 \
        --time-budget-min "$TRAIN_MIN" --schedule budget --feature-precision "$FEATURE_PRECISION" > "$RUN/$variant.log" 2>&1 &
done
wait
for variant in $VARIANTS; do   # a leg that ends below the shipped drafter's held-out agreement stays in $RUN
    python scripts/ship_drafters.py "$RUN/$variant" "eagle_trt/drafters/smollm2-$variant" \
        --note "continued from the shipped weights for $TRAIN_MIN min on one core, sets ${SETS:-all} (first-turn chunks: ${CHUNKS:-all}), loop cut $LOOP_CUT (scripts/train_smollm2_drafters.sh)" \
        || echo "$variant: not shipped (see above); the run is in $RUN/$variant"
done
python scripts/plot_training.py eagle_trt/drafters/smollm2-eagle3.1 eagle_trt/drafters/smollm2-eagle3 \
    --out docs/results/training/agreement.png --json docs/results/training/agreement.json
