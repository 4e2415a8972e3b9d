#!/usr/bin/env bash
# Builds what changed and runs the whole test suite (unit, reference-logit and CLI tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
