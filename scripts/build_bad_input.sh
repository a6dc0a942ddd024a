#!/usr/bin/env bash
# Issue 53's bad input, by hand on a real-size build (tests/test_build_bad_input.py runs the same
# code paths on a tiny target). After `python scripts/build_memory.py --out OUT --shape ...`:
#
#     sudo scripts/build_bad_input.sh OUT [CONFIG]      # CONFIG: default OUT/memory-default-fp8-fp16.yaml
#
# SMALL_GB (default 6) sizes the full file system, KILL_AT_MB (default 4000) how much of the
# export's temporary folder is written when it is killed; a 0.83 B target needs 2 and 1000.
#
# 1. a shard missing, 2. a shard truncated (a copy of its first half in its place): each run must
#    stop at validate with one line naming the file, and the rerun with the file back keeps every
#    stage;
# 3. a full disk in the middle of the export: the build writes into a 6 GB loop-mounted ext4 file
#    system (room for the validate stage, not for the target graph's weights); after the error
#    the file system is grown (as a user frees space) and
# 4. the rerun is killed (kill -9) in the middle of the export, and
# 5. the next rerun removes what the killed one left and completes the export.
# Needs root for the loop mount, and free disk of about the export stage's size plus 2 GB.
set -u
OUT=$(realpath "$1")
CFG=${2:-$OUT/memory-default-fp8-fp16.yaml}
PY=${PYTHON:-python}
TARGET=$(grep -A1 '^target:' "$CFG" | sed -n 's/^ *source: *//p')
log() { printf '\n== %s\n' "$*"; }
statuses() {
    $PY -c "import json, sys; print({s['name']: s['status'] for s in json.load(open(sys.argv[1]))['stages']})" "$1"
}
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
statuses "$(sed -n 's/^ *dir: *//p' "$CFG")/manifest.json"

SMALL=$OUT/small-fs
log "3. a full disk in the middle of the export ($SMALL, ${SMALL_GB:-6} GB)"
mkdir -p "$SMALL"
truncate -s "${SMALL_GB:-6}G" "$OUT/small-fs.img"
mkfs.ext4 -q -F "$OUT/small-fs.img"
mount -o loop "$OUT/small-fs.img" "$SMALL"
build --output "$SMALL/out" --stages export
echo "left in the output: $(ls -A "$SMALL/out" | tr '\n' ' '); $(df -h --output=used,avail "$SMALL" | tail -1)"
statuses "$SMALL/out/manifest.json"
umount "$SMALL"                               # space freed: the file system grown to 30 GB
truncate -s 30G "$OUT/small-fs.img"          # (offline: this VM refuses an online resize)
e2fsck -f -y "$OUT/small-fs.img" > /dev/null 2>&1
resize2fs "$OUT/small-fs.img" > /dev/null 2>&1
mount -o loop "$OUT/small-fs.img" "$SMALL"
df -h "$SMALL" | tail -1

log "4. the rerun killed (kill -9) in the middle of the export"
$PY -m eagle_trt.build --config "$CFG" --output "$SMALL/out" --stages export > /dev/null 2> "$OUT/bad-input.stderr" &
PID=$!
until ls -d "$SMALL"/out/.tmp-export-* > /dev/null 2>&1 && \
      [ "$(du -sm "$SMALL"/out/.tmp-export-* | cut -f1)" -gt "${KILL_AT_MB:-4000}" ]; do sleep 2; done
kill -9 $PID
wait $PID 2> /dev/null
echo "after kill -9: $(ls -A "$SMALL/out" | tr '\n' ' ') ($(du -sh "$SMALL"/out/.tmp-export-* | cut -f1) in the temporary folder)"

log "5. the next rerun"
build --output "$SMALL/out" --stages export
echo "after the rerun: $(ls -A "$SMALL/out" | tr '\n' ' ')"
cat "$OUT/bad-input.stdout"
statuses "$SMALL/out/manifest.json"
umount "$SMALL"
rm -r "$OUT/small-fs.img" "$SMALL"
