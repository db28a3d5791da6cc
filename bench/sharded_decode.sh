#!/usr/bin/env bash
# One KV-cache session sharded over K replicas against one replica holding one shard's tokens:
# the decode step's p50 on each and their ratio (BENCHMARKS.md, "Sessions over replicas").
# Each replica is pinned to a core with taskset and runs one compute thread; with fewer cores
# than K, replicas share cores and the ratio is bounded below by K / cores.
#
# usage: bench/sharded_decode.sh [--attnserve=PATH] [--bench=PATH] [--shards=4]
#                                [--tokens=131072] [--steps=40] [--dtype=bf16]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
attnserve=${here}/../build/server/attnserve
bench=${here}/../build/bench/sharded_decode_bench
shards=4
tokens=131072
steps=40
dtype=bf16
for arg in "$@"; do
  case ${arg} in
    --attnserve=*) attnserve=${arg#*=} ;;
    --bench=*) bench=${arg#*=} ;;
    --shards=*) shards=${arg#*=} ;;
    --tokens=*) tokens=${arg#*=} ;;
    --steps=*) steps=${arg#*=} ;;
    --dtype=*) dtype=${arg#*=} ;;
    *) echo "unknown argument ${arg}" >&2; exit 2 ;;
  esac
done
source "${here}/servers_lib.sh"

cores=$(nproc)
echo "CPU: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1), ${cores} cores"
if ((cores < shards)); then
  echo "note: ${shards} replicas share ${cores} cores; the ratio cannot fall below $((shards / cores))x here"
fi
# The replicas of the sharded session, then the single one, each on a core of its own where
# there are enough (the single one shares core 0 otherwise).
flags=(--metrics_port=0 --demo_weights=false --kv_cache_bytes=$((1 << 30))
  --max_session_tokens=$((tokens > 131072 ? tokens : 131072)))
# start_server runs its first argument with the server flags: a launcher per core.
pinned() {
  local launcher="${workdir}/core$1.sh"
  printf '#!/bin/sh\nOMP_NUM_THREADS=1 exec taskset -c %d "%s" "$@"\n' "$1" "${attnserve}" \
    >"${launcher}"
  chmod +x "${launcher}"
  echo "${launcher}"
}
for ((i = 0; i <= shards; i++)); do
  start_server "$(pinned $((i % cores)))" "${flags[@]}"
done
sharded="ipv4:"
for ((i = 0; i < shards; i++)); do
  sharded+="127.0.0.1:${ports[i]}"
  ((i + 1 < shards)) && sharded+=","
done
"${bench}" --sharded="${sharded}" --single="127.0.0.1:${ports[shards]}" --tokens="${tokens}" \
  --shards="${shards}" --steps="${steps}" --dtype="${dtype}"
