#!/usr/bin/env bash
# One leg of the SmolLM2 drafter training campaign, for any fresh machine with 2 cores: grow the
# committed distillation set, then continue both shipped drafters (EAGLE 3.1 and EAGLE-3) with the
# same data, CPU time and seed, one core each, and ship them. Each leg adds to what the last
# one left in the repository (data/distill/, eagle_trt/drafters/); nothing else must survive.
#
#   GEN_MIN=45 TRAIN_MIN=55 bash scripts/train_smollm2_drafters.sh
#   PROMPTS=20480 GEN_MIN=120 TRAIN_MIN=0 bash scripts/train_smollm2_drafters.sh   # only more data
#   GEN_MIN=0 CHUNKS=20 TRAIN_MIN=45 bash scripts/train_smollm2_drafters.sh          # leg 2: the first 20 chunks
#   GEN_MIN=0 VARIANTS=eagle3 TRAIN_MIN=150 bash scripts/train_smollm2_drafters.sh   # one variant catching up
#   GEN_MIN=0 TRAIN_MIN=60 EXTRA_DISTILL=data/distill/smollm2-sharegpt-later bash scripts/train_smollm2_drafters.sh
#
# On a machine that did not generate the data, the target features are recomputed from the ids:
# float32 ~290 tokens/s per core, bf16 autocast (FEATURE_PRECISION=bfloat16, the default) ~750 on
# a CPU with native bf16 (AVX-512 BF16 / AMX; elsewhere bf16 is slow: set float32). CHUNKS=K
# trains on the first K chunks only, so a leg's budget is not spent on features it has no time
# to train on. EXTRA_DISTILL (folders, space-separated) adds committed sets made otherwise, e.g. the
# later-turn set of `regenerate --turns later` (docs/training.md).
#
# Stages (each resumable; run the script again after an interruption):
# 1. python -m eagle_trt.train.regenerate, two workers: the target's greedy answers to ShareGPT
#    first turns, chunk by chunk, into data/distill/smollm2-sharegpt (commit it), for GEN_MIN
#    minutes; the held-out set data/distill/smollm2-val once.
# 2. python -m eagle_trt.train for both variants from the shipped weights (--init-from), cosine
#    decay over TRAIN_MIN minutes (--schedule budget), anchored TTT and a frozen head (what
#    scripts/cpu_minute_ablation.sh found to make a CPU minute count), eval on the held-out set.
# 3. scripts/ship_drafters.py into eagle_trt/drafters/ (compact log with the lineage), unless the
#    run ended below the shipped drafter's held-out agreement.
set -euo pipefail
CACHE=${EAGLE_TRT_CACHE:-$HOME/.cache/eagle_trt}
PROMPTS=${PROMPTS:-10240}
GEN_MIN=${GEN_MIN:-45}
TRAIN_MIN=${TRAIN_MIN:-55}
# Every continued leg dipped where the learning rate restarted (6e-4, then 4e-4 in legs 7-8: leg 8's
# held-out agreement passed its start only after ~70% of the leg), so the next legs restart lower.
LR=${LR:-2e-4}
WARMUP=${WARMUP:-50}
FEATURE_PRECISION=${FEATURE_PRECISION:-bfloat16}
# LOOP_CUT=N trains each sequence only through its first N tokens of looping answer text
# (eagle_trt/train/loops.py: 41% of the committed answers' tokens repeat the answer's own 9-grams)
LOOP_CUT=${LOOP_CUT:-0}
VARIANTS=${VARIANTS:-eagle3.1 eagle3}
RUN=$CACHE/runs/leg-$(date +%Y%m%d-%H%M)
mkdir -p "$RUN"

[ -f data/distill/smollm2-val/chunk_00000.npz ] || python -m eagle_trt.train.regenerate --out data/distill/smollm2-val \
    --split val --max-prompts 64 --threads 2
if [ "$GEN_MIN" != 0 ]; then
    for w in 0 1; do
        python -m eagle_trt.train.regenerate --out data/distill/smollm2-sharegpt --max-prompts "$PROMPTS" \
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
DISTILL_ARGS=(--distill "$DATA")
for extra in ${EXTRA_DISTILL:-}; do
    [ -f "$extra/provenance.json" ] || { echo "EXTRA_DISTILL: $extra is not a distillation set (no provenance.json)" >&2; exit 2; }
    DISTILL_ARGS+=(--distill "$extra")
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
        --note "continued from the shipped weights for $TRAIN_MIN min on one core, ${CHUNKS:-all} chunks${EXTRA_DISTILL:+ + $EXTRA_DISTILL}, loop cut $LOOP_CUT (scripts/train_smollm2_drafters.sh)" \
        || echo "$variant: not shipped (see above); the run is in $RUN/$variant"
done
python scripts/plot_training.py eagle_trt/drafters/smollm2-eagle3.1 eagle_trt/drafters/smollm2-eagle3 \
    --out docs/results/training/agreement.png --json docs/results/training/agreement.json
