#!/usr/bin/env bash
# The fragment decode kernel's page loop counted from its SASS, on any machine with nvcc (no GPU,
# no disassembler): builds a cubin of the one kernel instantiated for CONTENT and ROPE, prints the
# instructions of one page's loop body per warp by opcode (bench/gpu/sass_census.py loop, static:
# the RoPE's kept-pairs loop, which runs zero times without kept pairs, left out) and where its
# register spills are. Compare two trees (e.g. a waiting patch applied in a worktree) by running
# it in each.
#   bash bench/gpu/census-fragments.sh [CONTENT] [ROPE]   (default "ContentInt<4, 64>" RopeInt4)
set -euo pipefail
cd "$(dirname "$0")/../.."
content=${1:-ContentInt<4, 64>}
rope=${2:-RopeInt4}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/one.cu" <<EOF
#include "kernels/cuda/decode_fragments.cuh"
namespace quantmla::gpu {
template void launch_decode_fragments<$content, $rope>(const DecodeKernelParams&, int,
                                                       cudaStream_t);
}
EOF
"$nvcc" -I"$PWD/include" -I"$PWD/src" -O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a \
  --expt-relaxed-constexpr -lineinfo -std=c++20 -Xptxas=-v -x cu -cubin "$work/one.cu" \
  -o "$work/one.cubin" 2>&1 | grep -E "registers|spill" || true
source=src/kernels/cuda/decode_fragments.cuh
# The consumers' page loop body: from the line after its `for` (whose line also holds hoisted
# set-up) to the stage's release; the kept pairs' loop inside it.
first=$(($(grep -n '^  for (int i = 0; i < num_pages; ++i) {' $source | cut -d: -f1) + 1))
last=$(grep -n 'mbarrier_arrive(empty + stage_index)' $source | cut -d: -f1)
kept=$(grep -n 'for (int n = 0; n < p.kept.count; ++n) {' $source | cut -d: -f1)
python3 bench/gpu/sass_census.py loop "$work/one.cubin" $source "$first" "$last" \
  --exclude "$kept-$((kept + 10))"
python3 bench/gpu/sass_census.py spills "$work/one.cubin"
