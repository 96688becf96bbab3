#!/usr/bin/env bash
# Serving figures for docs/performance.md: `pluginfer bench serve` at concurrency 1, 4 and 16 against
# `pluginfer serve` on the ~0.5B-shaped random llama (the checkpoint offline_throughput.py builds).
#   bash benchmarks/serve_figures.sh CHECKPOINT_DIR [PORT]
# With AIPERF=/path/to/aiperf set, also runs NVIDIA's aiperf against the same server.
set -euo pipefail
model=${1:?checkpoint directory}
port=${2:-8011}
out=${OUT:-/tmp/pluginfer-serve-figures}
mkdir -p "$out"
pluginfer serve --model "$model" --dtype float32 --port "$port" --max-model-len 1024 --max-num-seqs 16 \
    --served-model-name bench >"$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
for c in 1 4 16; do
    pluginfer bench serve --base-url "http://127.0.0.1:$port" --concurrency "$c" --input-len 128 \
        --output-len 64 --num-prompts $((c * 4 > 8 ? c * 4 : 8)) --tokenizer "$model" --json "$out/c$c.json"
done
if [ -n "${AIPERF:-}" ]; then
    "$AIPERF" profile --model bench --url "http://127.0.0.1:$port" --endpoint-type completions --streaming \
        --tokenizer "$model" --isl 128 --osl 64 --concurrency 4 --request-count 16 \
        --extra-inputs ignore_eos:true --use-server-token-count --artifact-dir "$out/aiperf"
fi
