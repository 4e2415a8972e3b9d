#!/usr/bin/env bash
# The fragment decode kernel's page loop counted from its SASS, on any machine with nvcc (no GPU,
# no disassembler): builds a cubin of the one kernel instantiated for CONTENT and ROPE, prints the
# instructions of one page's loop body per warp by opcode (bench/gpu/sass_census.py loop, static)
# and where its register spills are. The kernel is built as it runs without RoPE pairs kept in BF16
# (every measured shape): from a copy of src/ whose kept-pairs loop has the bound 0, so that the
# compiler drops it with its inlined helpers (leaving its source lines out missed ~270 helper
# instructions; the ptxas figures printed are the copy's). Compare two trees (e.g. a waiting patch
# applied in a worktree) by running it in each. --transposed counts the transposed kernel's
# converting form instead (decode_transposed.cu, int content: one consuming warpgroup's page).
#   bash bench/gpu/census-fragments.sh [CONTENT] [ROPE] [--three-blocks | --transposed] [--by-line]
#     [--as-built]
#   (default "ContentInt<4, 64>" RopeInt4; --three-blocks: the kernel's form without a producer
#   warp, three blocks an SM (int content); --by-line also counts each source line; --as-built
#   builds the kernel as the library does, kept-pairs loop and all, and prints every instruction's
#   offset and source line instead: sass_census.py lines, to join with a profile's samples)
set -euo pipefail
cd "$(dirname "$0")/../.."
by_line=()
as_built=0
three_blocks=false
transposed=0
args=()
for a in "$@"; do
  case $a in
    --three-blocks) three_blocks=true ;;
    --transposed) transposed=1 ;;
    --by-line) by_line=(--by-line) ;;
    --as-built) as_built=1 ;;
    *) args+=("$a") ;;
  esac
done
content=${args[0]:-ContentInt<4, 64>}
rope=${args[1]:-RopeInt4}
source bench/gpu/library-nvcc-flags.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source=src/kernels/cuda/decode_fragments.cuh
((transposed)) && source=src/kernels/cuda/decode_transposed.cu
kept_loop='for (int n = 0; n < p.kept.count; ++n) {'
if ! grep -qF "$kept_loop" $source; then
  echo "census-fragments.sh: no '$kept_loop' in $source" >&2
  exit 1
fi
cp -r src "$work/src"
((as_built)) ||
  sed -i 's/for (int n = 0; n < p\.kept\.count; ++n) {/for (int n = 0; n < 0; ++n) {/' "$work/$source"
if ((transposed)); then
  # The file's explicit instantiations (every format, both row-tile forms) out; the one kernel in.
  perl -0pi -e 's/template void launch_decode_transposed<[^;]*;\n//g' "$work/$source"
  cat >"$work/one.cu" <<EOF
#include "kernels/cuda/decode_transposed.cu"
namespace quantmla::gpu {
namespace {
template __global__ void mla_decode_transposed_kernel<$content, $rope, 1>(
    const __grid_constant__ DecodeKernelParams, const __grid_constant__ CUtensorMap);
}
}
EOF
else
  cat >"$work/one.cu" <<EOF
#include "kernels/cuda/decode_fragments.cuh"
namespace quantmla::gpu {
template void launch_fragments_form<$content, $rope, $three_blocks>(const DecodeKernelParams&, int,
                                                                  cudaStream_t);
}
EOF
fi
if ! "$nvcc" -I"$PWD/include" -I"$work/src" "${library_nvcc_flags[@]}" -Xptxas=-v -x cu -cubin \
  "$work/one.cu" -o "$work/one.cubin" >"$work/nvcc.txt" 2>&1; then
  cat "$work/nvcc.txt" >&2
  exit 1
fi
grep -E "registers|spill" "$work/nvcc.txt" >&2 || true
if ((as_built)); then
  python3 bench/gpu/sass_census.py lines "$work/one.cubin"
  exit
fi
if ((transposed)); then
  # A warpgroup's page: the loop over its pages, less the kernel's own lines before and after it
  # that the compiler placed among the loop's (sass_census.py --strict).
  first=$(grep -n 'for (int i = wg; i < num_pages; i += L::kWarpgroups) {' $source | cut -d: -f1)
  after=$(grep -n 'if constexpr (L::kWarpgroups == 2) {' $source | cut -d: -f1)
  start=$(grep -n 'mla_decode_transposed_kernel(const __grid_constant__' $source | cut -d: -f1)
  python3 bench/gpu/sass_census.py loop "$work/one.cubin" $source "$first" $((after - 1)) --strict \
    --exclude "$start-$((first - 1))" --exclude "$after-$(wc -l <$source)" "${by_line[@]}"
else
  # The consumers' page loop body, whose parts are lambdas: from the first line of the first part
  # a page runs (the wait for it) to the stage's release (the three-block form's refill).
  first=$(($(grep -n 'const auto await_page = ' $source | cut -d: -f1) + 1))
  last=$(grep -n 'issue_page(i + L::kStages);' $source | cut -d: -f1)
  python3 bench/gpu/sass_census.py loop "$work/one.cubin" $source "$first" "$last" "${by_line[@]}"
fi
python3 bench/gpu/sass_census.py spills "$work/one.cubin"
