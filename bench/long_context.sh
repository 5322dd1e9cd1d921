#!/usr/bin/env bash
# Long prompts and load, kvfence next to llama.cpp's llama-server: the same
# GGUF file, 2 threads each, the same client (`kvfence bench`: token-id
# prompts, streamed, greedy, ignore_eos), one server loaded at a time.
#
#   bash bench/long_context.sh GGUF LLAMA_SERVER [OUT_DIR]
#
# kvfence runs colocated with the prefix cache off; llama-server restarts
# before each long prompt and each load, so its slot cache cannot reuse an
# earlier prompt (the bench's prompts of one length are prefixes of the
# longer ones, and request i of every load sends the same prompt).
#
# Each time to first token is the median of three requests in a row (their
# prompts share at most a few first tokens, so no cache reuses one for the
# next): the first request after a server starts pays for its page faults
# and thread start-up, and one cold request used to decide a row. Loads run
# four requests a slot (at least eight), each on a fresh connection, so a
# run is several waves rather than one wave's slowest first token.
# Results: one JSON report per run in OUT_DIR, and a table.
set -euo pipefail
GGUF=${1:?GGUF file}
LLAMA=${2:?path to llama-server}
OUT=${3:-target/long-context}
KVFENCE=${KVFENCE:-target/release/kvfence}
mkdir -p "$OUT"
KPORT=18200
LPORT=18300

wait_up() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "server on $1 did not come up" >&2
  return 1
}

bench() { # name port prompt output concurrency requests
  "$KVFENCE" bench --base-url "http://127.0.0.1:$2" --prompt-len "$3" \
    --output-len "$4" --concurrency "$5" --requests "$6" --slo-ttft-ms 600000 \
    --fresh-connections --json "$OUT/$1.json" > "$OUT/$1.txt" 2>&1 || true
  python3 - "$OUT/$1.json" "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:28s} ok {r['succeeded']}/{r['requests']}  ttft p50 {r['ttft_ms']['p50']:9.1f} ms"
      f"  tpot p50 {r['tpot_ms']['p50']:7.2f} ms  out {r['output_token_throughput']:7.1f} tok/s")
PY
}

"$KVFENCE" serve --model "$GGUF" --mode colocated --port $KPORT --prefix-cache off \
  --kv-pool-tokens 16384 > "$OUT/kvfence-serve.log" 2>&1 &
KPID=$!
trap 'kill $KPID ${LPID:-} 2>/dev/null || true' EXIT
wait_up $KPORT

llama_up() { # parallel slots, context
  if [ -n "${LPID:-}" ]; then
    kill "$LPID" 2>/dev/null || true
    wait "$LPID" 2>/dev/null || true
  fi
  "$LLAMA" -m "$GGUF" -t 2 -tb 2 -fa on -np "$1" -c "$2" --port $LPORT \
    > "$OUT/llama-server.log" 2>&1 &
  LPID=$!
  wait_up $LPORT
}

for n in 512 2048 8176; do
  bench "kvfence-ttft-$n" $KPORT $n 16 1 3
  llama_up 1 8192
  bench "llama-ttft-$n" $LPORT $n 16 1 3
done
bench kvfence-decode-4096 $KPORT 4096 64 1 1
llama_up 1 8192
bench llama-decode-4096 $LPORT 4096 64 1 1
for c in 1 8 32; do
  bench "kvfence-load-$c" $KPORT 128 128 $c $((c * 4 > 8 ? c * 4 : 8))
  # A server that had run the previous load would skip part of this one's
  # prefill: its slots keep the prompts it saw.
  llama_up 32 16384
  bench "llama-load-$c" $LPORT 128 128 $c $((c * 4 > 8 ? c * 4 : 8))
done
