#!/usr/bin/env bash
# What the GPU machine needs from outside the checkout, in .carry/ (ignored; the device tool's
# `carry`): the Debian dependencies (scripts/device-deps.sh: deps.tar.xz, and deps-server.tar.xz
# for `quantmla serve`) and a slice of ../shared. The device takes at most 64 MiB of tree and
# carry together (the tree is 58 MiB: models/mla-tiny 50, data/ 3.4), so each call carries what
# it needs:
#   bash scripts/device-carry.sh          carry [".carry/deps.tar.xz", ".carry/shared"] for
#     bench/gpu/run-runner.sh's stages, with data/ moved out of the checkout for the call (the
#     tree, the dependencies and the slice pass 64 MiB by a little; only FULL=1 and calibration
#     read data/); [".carry/deps.tar.xz", ".carry/deps-server.tar.xz"] for run-serve.sh and
#     run-online.sh. (The runner stage's fixtures need tools/make_gpu_fixtures.py,
#     reference/valid.ids.i32 and models/mla-tiny/tokenizer*.json of the slice; a call that keeps
#     data/ has room for those only.)
#   LONG=1 bash scripts/device-carry.sh   for run-runner.sh's long and longcalib stages:
#     mla-tiny-v2-4k (packed) and the first 82K WikiText-2 ids; move models/mla-tiny out of the checkout
#     for that call and carry [".carry/deps.tar.xz", ".carry/shared"].
#   CALIBRATED=DIR bash scripts/device-carry.sh   for run-runner.sh's calibrated stage: the model
#     directory DIR (made here, e.g. by `quantmla calibrate --folded-dtype bf16`: an F32 fold is
#     too large) packed as models/calibrated.tar.xz, with the pass-key prompts; move
#     models/mla-tiny out of the checkout for that call and carry the same two paths.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .carry/deps.tar.xz ] && [ -f .carry/deps-server.tar.xz ] || bash scripts/device-deps.sh
shared=${SHARED:-../shared}
rm -rf .carry/shared && mkdir -p .carry/shared/tools .carry/shared/models/mla-tiny .carry/shared/reference
cp "$shared/tools/make_gpu_fixtures.py" .carry/shared/tools/
cp "$shared"/models/mla-tiny/tokenizer*.json .carry/shared/models/mla-tiny/
head -c 400000 "$shared/reference/valid.ids.i32" >.carry/shared/reference/valid.ids.i32
cp "$shared/reference/passkey-public.json" .carry/shared/reference/
if [ -n "${LONG:-}" ]; then
  rm -f .carry/shared/reference/valid.ids.i32 .carry/shared/tools/make_gpu_fixtures.py
  head -c $((4 * 4096 * 20 + 4)) "$shared/reference/wikitext2-test.ids.i32" \
    >.carry/shared/reference/wikitext2-test.ids.i32
  # Packed (xz: 52 -> ~40 MiB) so that the call stays under the device's 64 MiB; run-runner.sh
  # unpacks it.
  tar -C "$shared/models" -cf - mla-tiny-v2-4k | xz -1 -T0 >.carry/shared/models/mla-tiny-v2-4k.tar.xz
else
  # Enough for eval-ppl's first 100 windows at ctx 1024 (the whole file would pass the limit).
  head -c $((4 * 1024 * 101)) "$shared/reference/wikitext2-test.ids.i32" \
    >.carry/shared/reference/wikitext2-test.ids.i32
fi
# RUNNER_ONLY=1: the runner stage's fixtures only (for ab-runner.sh RUNNER_TEST=1): without the
# pass-key prompts and the WikiText-2 ids the slice is 0.7 MiB, which keeps the tree (58 MiB with
# data/, docs/ grown since) and deps.tar.xz under the device's 64 MiB.
if [ -n "${RUNNER_ONLY:-}" ]; then
  rm -f .carry/shared/reference/passkey-public.json .carry/shared/reference/wikitext2-test.ids.i32
fi
# PPL_ONLY=1: the WikiText-2 ids alone, for run-runner.sh's ppl stage, which
# reads the model from the checkout: the tree without data/, deps.tar.xz and the full slice would
# pass the device's 64 MiB by a little.
if [ -n "${PPL_ONLY:-}" ]; then
  rm -rf .carry/shared/tools .carry/shared/models .carry/shared/reference/passkey-public.json \
    .carry/shared/reference/valid.ids.i32
fi
if [ -n "${CALIBRATED:-}" ]; then
  rm -f .carry/shared/reference/*.ids.i32 .carry/shared/tools/make_gpu_fixtures.py \
    .carry/shared/models/mla-tiny-v2-4k.tar.xz
  [ -f "$CALIBRATED/config.json" ] || { echo "CALIBRATED=$CALIBRATED: no config.json" >&2; exit 1; }
  tar -C "$(dirname "$CALIBRATED")" -cf - "$(basename "$CALIBRATED")" | xz -1 -T0 \
    >.carry/shared/models/calibrated.tar.xz
fi
du -sh .carry
