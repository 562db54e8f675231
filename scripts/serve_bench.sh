#!/usr/bin/env bash
# tpmoe bench serve against tpmoe serve, shared-expert fusion on and off, next to tpmoe bench at the
# same batches (what the server costs over the bare engine). Writes serve_on.json, serve_off.json
# and engine.json (full precision) into OUT_DIR and prints the tables.
#   scripts/serve_bench.sh TPMOE OUT_DIR [model flags, e.g. --device cuda --preset m3 --layers 4]
set -euo pipefail
tpmoe=$1 out=$2
shift 2
model=("$@")
mkdir -p "$out"
for fusion in on off; do
  log="$out/serve_$fusion.log"
  # A step budget that prefills a whole wave of 64 prompts at once, as tpmoe bench does.
  "$tpmoe" serve "${model[@]}" --shared-expert-fusion "$fusion" --port 0 --max-batch 64 --max-step-tokens 8192 \
    >"$log" 2>&1 &
  pid=$!
  url=""
  for _ in $(seq 600); do  # model build + weight generation: up to 5 minutes
    url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1) && [ -n "$url" ] && break
    kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
  done
  echo "== shared-expert fusion $fusion: $url"
  "$tpmoe" bench serve --url "$url" --concurrency 1,16,64 --input-len 128 --output-len 64 \
    --json "$out/serve_$fusion.json" || echo "bench serve failed"
  kill -INT "$pid"
  wait "$pid" || true
done
echo "== tpmoe bench (the engine alone, same batches and lengths)"
"$tpmoe" bench "${model[@]}" --batch 1,16,64 --prompt-len 128 --new-tokens 64 --compare-fusions \
  --json "$out/engine.json"
