#!/usr/bin/env bash
# The calibration table of docs/results.md on a many-core machine (the GPU machine's CPUs, through
# the device tool): calibrates mla-tiny for each variant, then evaluates each calibrated model on
# the full WikiText-2 test text (ctx 1024, all windows) against the original model's BF16 cache,
# split over all cores with scripts/sharded-compare.sh. A variant whose model is missing is
# calibrated first, so `eval` works on a fresh machine too.
# Usage: scripts/device-calibration.sh BIN IDS WORK OUT calibrate|eval VARIANT...
#   BIN: a static quantmla (scripts/static-quantmla.sh); IDS: wikitext2-test.ids.i32;
#   WORK: where calibrated models go; OUT: tallies, tables and logs.
set -euo pipefail
if [ $# -lt 6 ]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
bin=$1 ids=$2 work=$3 out=$4 stage=$5
shift 5
cores=$(nproc)
here=$(dirname "$0")

# shellcheck source=scripts/calibration-variants.sh
source "$(dirname "$0")/calibration-variants.sh"

calibrate() {  # VARIANT THREADS
  [ -f "$work/$1/config.json" ] && return 0
  # shellcheck disable=SC2046
  "$bin" calibrate --out "$work/$1" --force --threads "$2" $(args_of "$1") \
    >"$out/$1.calibrate.txt" 2>"$out/$1.calibrate.log"
}

mkdir -p "$work" "$out"
missing=()
for v in "$@"; do [ -f "$work/$v/config.json" ] || missing+=("$v"); done
if [ ${#missing[@]} -gt 0 ]; then
  threads=$((cores / ${#missing[@]}))
  [ "$threads" -ge 1 ] || threads=1
  for v in "${missing[@]}"; do calibrate "$v" "$threads" & done
  wait
  for v in "${missing[@]}"; do
    [ -f "$work/$v/config.json" ] || { echo "$v: calibration failed" >&2; tail -3 "$out/$v.calibrate.log" >&2; exit 1; }
  done
fi
[ "$stage" = eval ] || exit 0
for v in "$@"; do
  "$here/sharded-compare.sh" "$bin" "$ids" 1024 "$cores" "$cores" "$out" "$v" \
    --model "$work/$v" --baseline-model models/mla-tiny >"$out/$v.table.txt"
  "$bin" compare-merge "$out/$v".shard-*.tly --json "$out/$v.json" >/dev/null
  cat "$out/$v.table.txt"
done
