#!/usr/bin/env bash
# Builds what changed and runs the whole test suite (unit, reference-logit and CLI tests). Where
# nvcc is installed (CI included) it also builds the CUDA kernels (build-cuda/, sm_90a) and runs
# their tests: the host-side ones always, the GPU ones only where a CUDA device is present (ctest
# reports them skipped otherwise). Last, the waiting kernel patches must still apply.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"

nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc" ]; then
  generator=()
  command -v ninja >/dev/null && [ ! -f build-cuda/CMakeCache.txt ] && generator=(-G Ninja)
  cmake -S . -B build-cuda "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DQUANTMLA_CUDA=ON \
    -DQUANTMLA_KERNELS_ONLY=ON -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
  cmake --build build-cuda -j "$(nproc)"
  ctest --test-dir build-cuda --output-on-failure
else
  echo "test.sh: no nvcc, CUDA kernels not built"
fi

# The kernel changes waiting for device time (bench/gpu/patches/README.md) must apply to this tree,
# together: a patch that no longer applies is rebased or deleted, never left stale. One after the
# other, on a copy of the files they touch (`git apply --check` of several patches checks each
# against the tree alone, so two that touch the same lines would both pass it).
patches=(bench/gpu/patches/*.diff)
if [ -e "${patches[0]}" ]; then
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  for patch in "${patches[@]}" bench/gpu/patches/stacked/*.diff; do
    [ -e "$patch" ] || continue
    git apply --numstat "$patch" | cut -f3 | while read -r file; do
      [ -e "$file" ] && mkdir -p "$scratch/$(dirname "$file")" && cp "$file" "$scratch/$file"
      true
    done
  done
  for patch in "${patches[@]}"; do
    (cd "$scratch" && git apply "$OLDPWD/$patch") || {
      echo "test.sh: $patch does not apply after the waiting patches before it" >&2
      exit 1
    }
  done
  # A stacked patch (patches/stacked/) is a variant's difference from the one it sits on: the
  # device step builds the variant by reversing it from the tree with all of the above applied.
  for patch in bench/gpu/patches/stacked/*.diff; do
    [ -e "$patch" ] || continue
    (cd "$scratch" && git apply -R --check "$OLDPWD/$patch") || {
      echo "test.sh: $patch does not reverse from the tree with the waiting patches" >&2
      exit 1
    }
  done
  echo "test.sh: ${#patches[@]} waiting patches apply, one after the other (and the stacked ones reverse)"
fi
# The measurement probes (bench/gpu/probes/README.md) apply to this tree, each alone.
for probe in bench/gpu/probes/*.diff; do
  [ -e "$probe" ] || continue
  git apply --check "$probe" || { echo "test.sh: $probe does not apply to this tree" >&2; exit 1; }
done
