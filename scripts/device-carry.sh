#!/usr/bin/env bash
# What the GPU machine needs from outside the checkout, in .carry/ (ignored; the device tool's
# `carry`): the Debian dependencies (scripts/device-deps.sh) and a slice of ../shared.
#   bash scripts/device-carry.sh          for bench/gpu/run-runner.sh's default stages, calib, passkey
#   LONG=1 bash scripts/device-carry.sh   for its `long` stage: mla-tiny-v2-4k (54 MB) and the first
#     82K WikiText-2 ids only. The device takes at most 64 MiB of tree and carry together, and
#     models/mla-tiny is 52 MB of the tree: move it out of the checkout for that one call.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .carry/deps.tar.xz ] || bash scripts/device-deps.sh
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
  cp -r "$shared/models/mla-tiny-v2-4k" .carry/shared/models/
else
  # Enough for eval-ppl's first 100 windows at ctx 1024 (the whole file would pass the limit).
  head -c $((4 * 1024 * 101)) "$shared/reference/wikitext2-test.ids.i32" \
    >.carry/shared/reference/wikitext2-test.ids.i32
fi
du -sh .carry
