#!/usr/bin/env bash
# One `quantmla compare` split by windows into single-threaded processes that run side by side on
# a many-core machine; each writes a tally file, and `compare-merge` makes the table of the whole.
# Usage: scripts/sharded-compare.sh QUANTMLA IDS CTX SHARDS JOBS OUTDIR NAME [compare options...]
#   e.g. scripts/sharded-compare.sh build/quantmla ids.i32 1024 64 32 out rtn --cache int4 ...
# Writes OUTDIR/NAME.shard-K.tly for K = 0..SHARDS-1 and prints the merged table.
set -euo pipefail
if [ $# -lt 7 ]; then
  sed -n '2,6p' "$0" >&2
  exit 2
fi
quantmla=$1 ids=$2 ctx=$3 shards=$4 jobs=$5 outdir=$6 name=$7
shift 7
tokens=$(($(stat -c %s "$ids") / 4))
windows=$((tokens / (ctx - 1)))
per_shard=$(((windows + shards - 1) / shards))
mkdir -p "$outdir"
echo "$name: $windows windows of $ctx in $shards shards of $per_shard, $jobs at a time" >&2
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for ((k = 0; k < shards && k * per_shard < windows; ++k)); do echo $k; done |
  xargs -P "$jobs" -I{} sh -c 'q=$0 ids=$1 ctx=$2 per=$3 out=$4 name=$5; shift 5
    "$q" compare --ids "$ids" --ctx "$ctx" --first-window $(({} * per)) --max-windows "$per" \
      --save-tally "$out/$name.shard-{}.tly" "$@" >/dev/null 2>"$out/$name.shard-{}.log" ||
      { echo "shard {} failed: $(tail -1 "$out/$name.shard-{}.log")" >&2; exit 255; }' \
    "$quantmla" "$ids" "$ctx" "$per_shard" "$outdir" "$name" "$@"
"$quantmla" compare-merge "$outdir/$name".shard-*.tly
