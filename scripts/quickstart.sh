#!/usr/bin/env bash
# Fresh machine to first results: install the dependencies, build, then run the main job on the
# bundled model (perplexity on WikiText-2 test and a short greedy generation).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
./build/quantmla info
./build/quantmla eval-ppl --text data/wikitext2-test.raw --ctx 1024 --max-windows "${PPL_WINDOWS:-0}"
./build/quantmla generate --prompt "The Debian package manager" --max-tokens 48
