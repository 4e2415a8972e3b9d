#!/usr/bin/env bash
# What the GPU machine needs from outside the checkout, in .carry/ (ignored; the device tool's
# `carry`): the Debian dependencies (scripts/device-deps.sh) and a slice of ../shared.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .carry/deps.tar.xz ] || bash scripts/device-deps.sh
shared=${SHARED:-../shared}
rm -rf .carry/shared && mkdir -p .carry/shared/tools .carry/shared/models/mla-tiny .carry/shared/reference
cp "$shared/tools/make_gpu_fixtures.py" .carry/shared/tools/
cp "$shared"/models/mla-tiny/tokenizer*.json .carry/shared/models/mla-tiny/
head -c 400000 "$shared/reference/valid.ids.i32" >.carry/shared/reference/valid.ids.i32
cp "$shared/reference/wikitext2-test.ids.i32" .carry/shared/reference/
du -sh .carry
