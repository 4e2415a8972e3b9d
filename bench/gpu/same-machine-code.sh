#!/usr/bin/env bash
# Whether the working tree's CUDA kernels compile to the same machine code as REV's, on any
# machine with nvcc (no GPU): a refactor whose kernels all stay byte-identical needs no device
# time to land. Builds each translation unit as a cubin in both trees with the library's flags
# (bench/gpu/library-nvcc-flags.sh) and compares them kernel by kernel
# (bench/gpu/compare_cubins.py). Exits 1 if any kernel differs.
#   bash bench/gpu/same-machine-code.sh [--map PATTERN REPLACEMENT]... [REV] [FILE.cu ...]
#   (default HEAD and every src/kernels/cuda/*.cu; about a minute a file on two cores; --map: the
#   working tree's kernel names renamed before pairing, compare_cubins.py)
set -euo pipefail
cd "$(dirname "$0")/../.."
maps=()
while [[ ${1:-} == --map ]]; do
  (($# >= 3)) || { echo "same-machine-code.sh: --map takes PATTERN REPLACEMENT" >&2; exit 2; }
  maps+=(--map "$2" "$3")
  shift 3
done
rev=${1:-HEAD}
shift || true
files=("$@")
((${#files[@]})) || files=(src/kernels/cuda/*.cu)
source bench/gpu/library-nvcc-flags.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/old" "$work/new"
git archive "$rev" | tar -x -C "$work/old"
git ls-files -co --exclude-standard -z | xargs -0 tar -cf - | tar -x -C "$work/new"
build() {  # TREE FILE: FILE's cubin in TREE/cubins, or a line saying it does not compile there
  local tree=$1 file=$2
  [[ -f $tree/$file ]] || { echo "$file: not in the $(basename "$tree") tree"; return; }
  mkdir -p "$tree/cubins"
  "$nvcc" -I"$tree/include" -I"$tree/src" "${library_nvcc_flags[@]}" -x cu -cubin "$tree/$file" \
    -o "$tree/cubins/$(basename "$file" .cu).cubin" >"$tree/cubins/$(basename "$file").log" 2>&1 ||
    echo "$file: does not compile in the $(basename "$tree") tree"
}
jobs_max=$(nproc)
for file in "${files[@]}"; do
  for tree in "$work/old" "$work/new"; do
    build "$tree" "$file" &
    while (($(jobs -r | wc -l) >= jobs_max)); do sleep 1; done
  done
done
wait
python3 bench/gpu/compare_cubins.py "${maps[@]}" "$work/old/cubins" "$work/new/cubins"
