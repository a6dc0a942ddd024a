#!/usr/bin/env bash
# Issue 53's bad input, by hand on a real-size build (tests/test_build_bad_input.py runs the same
# code paths on a tiny target). After `python scripts/build_memory.py --out OUT --shape ...`:
#
#     sudo scripts/build_bad_input.sh OUT [CONFIG]      # CONFIG: default OUT/memory-default-fp8-fp16.yaml
#
# 1. a shard missing, 2. a shard truncated (a copy of its first half in its place): each run must
#    stop at validate with one line naming the file, and the rerun with the file back keeps every
#    stage;
# 3. a full disk in the middle of the export: the build writes into a loop-mounted ext4 file
#    system whose free space a filler file takes down to less than the target graph's weights;
#    after the error the filler is deleted and
# 4. the rerun is killed (kill -9) in the middle of the export, and
# 5. the next rerun removes what the killed one left and completes the export.
# Needs root for the loop mount, and free disk of about the target graph's size plus 2 GB.
set -u
OUT=$(realpath "$1")
CFG=${2:-$OUT/memory-default-fp8-fp16.yaml}
PY=${PYTHON:-python}
TARGET=$(grep -A1 '^target:' "$CFG" | sed -n 's/^ *source: *//p')
log() { printf '\n== %s\n' "$*"; }
build() {   # prints the last stderr line and the exit status
    $PY -m eagle_trt.build --config "$CFG" --quiet "$@" > "$OUT/bad-input.stdout" 2> "$OUT/bad-input.stderr"
    local code=$?
    tail -n 1 "$OUT/bad-input.stderr"
    echo "exit $code"
    return 0
}

SHARD=$(ls "$TARGET"/model-*.safetensors | sed -n 2p)
log "1. $SHARD missing"
mv "$SHARD" "$SHARD.away"
build --stages validate
mv "$SHARD.away" "$SHARD"

log "2. $SHARD truncated to its first half"
mv "$SHARD" "$SHARD.orig"
head -c $(( $(stat -c %s "$SHARD.orig") / 2 )) "$SHARD.orig" > "$SHARD"
build --stages validate
rm "$SHARD"
mv "$SHARD.orig" "$SHARD"      # the file as it was (size and mtime): the rerun keeps every stage
build --stages validate
grep -o '"name": "validate", "status": "[a-z]*"' "$OUT"/build-*/manifest.json | head -1

SMALL=$OUT/small-fs
log "3. a full disk in the middle of the export ($SMALL)"
mkdir -p "$SMALL"
truncate -s 40G "$OUT/small-fs.img"
mkfs.ext4 -q -F "$OUT/small-fs.img"
mount -o loop "$OUT/small-fs.img" "$SMALL"
# leave 8 GB: room for the validate stage, not for the target graph's weights
fallocate -l $(( $(df --output=avail -B1 "$SMALL" | tail -1) - (8 << 30) )) "$SMALL/filler"
df -h "$SMALL" | tail -1
build --output "$SMALL/out" --stages export
echo "left in the output: $(ls -A "$SMALL/out" | tr '\n' ' ')"
rm "$SMALL/filler"

log "4. the rerun killed (kill -9) in the middle of the export"
$PY -m eagle_trt.build --config "$CFG" --output "$SMALL/out" --stages export > /dev/null 2> "$OUT/bad-input.stderr" &
PID=$!
until ls -d "$SMALL"/out/.tmp-export-* > /dev/null 2>&1 && \
      [ "$(du -sm "$SMALL"/out/.tmp-export-* | cut -f1)" -gt 4000 ]; do sleep 5; done
kill -9 $PID
wait $PID 2> /dev/null
echo "after kill -9: $(ls -A "$SMALL/out" | tr '\n' ' ') ($(du -sh "$SMALL"/out/.tmp-export-* | cut -f1) in the temporary folder)"

log "5. the next rerun"
build --output "$SMALL/out" --stages export
grep -m1 "removed leftovers" "$OUT/bad-input.stderr"
cat "$OUT/bad-input.stdout"
umount "$SMALL"
rm -r "$OUT/small-fs.img" "$SMALL"
