#!/usr/bin/env bash
# Installs the npm `openai` package (once, into the build tree), starts `quantmla serve` on a free
# loopback port with the DeepSeek-V3 chat template, runs client_test.mjs, stops the server.
#   run.sh QUANTMLA_BINARY SHARED_DIR WORK_DIR      (exit 77: npm or node missing -> skipped)
set -uo pipefail
binary=$1 shared=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
command -v node >/dev/null && command -v npm >/dev/null || { echo "node/npm not installed"; exit 77; }
mkdir -p "$work"
if [ ! -d "$work/node_modules/openai" ]; then
  (cd "$work" && npm install --silent --no-audit --no-fund openai@4 >npm.log 2>&1) ||
    { echo "npm install openai failed (no registry?):"; tail -5 "$work/npm.log"; exit 77; }
fi
cp "$here/client_test.mjs" "$work/"
node -e 'process.stdout.write(require(process.argv[1]).chat_template)' \
  "$shared/tokenizers/deepseek-v3/tokenizer_config.json" >"$work/template.jinja"
cd "$here/../.."  # the source tree: the default model path resolves
"$binary" serve --port 0 --cache-memory 16MiB --api-key sesame --served-model-name mla-tiny \
  --chat-template "$work/template.jinja" 2>"$work/server.log" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
port=""
for _ in $(seq 1 600); do
  port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$work/server.log" | grep -o '[0-9]*$')
  [ -n "$port" ] && break
  kill -0 $server 2>/dev/null || { cat "$work/server.log"; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { echo "the server did not start"; cat "$work/server.log"; exit 1; }
QUANTMLA_URL="http://127.0.0.1:$port/v1" node "$work/client_test.mjs"
status=$?
kill -TERM $server
wait $server
server_status=$?
trap - EXIT
[ $status -eq 0 ] || { tail -20 "$work/server.log"; exit $status; }
[ $server_status -eq 0 ] || { echo "server exited $server_status"; tail -5 "$work/server.log"; exit 1; }
