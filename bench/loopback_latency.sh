#!/usr/bin/env bash
# Tiny-call latency and server cost over loopback, client and server in separate
# processes (as deployed): each named attnserve binary is started on a free
# port, then `attnctl bench` sends the tiny Attend (1, 1, 16, 64) at
# concurrency 1, ROUNDS times per server, the servers taking turns so that the
# host's drift hits them alike. Per server: the median of the rounds' p50s, the
# server's CPU time and context switches per call (from /proc).
#
#   bench/loopback_latency.sh [--rounds=N] [--requests=N] [--shape='ATTNCTL FLAGS'] \
#       build/server/attnserve [other/attnserve ...] [-- server flags]
#
# --shape replaces the tiny Attend's attnctl flags, e.g.
#   --shape='--heads=8 --kv_heads=8 --query_len=128 --key_len=128 --precision=bf16'
#
# Example (this session's comparison with the previous server):
#   bench/loopback_latency.sh --rounds=10 /tmp/attnserve_before build/server/attnserve
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
attnctl=${ATTNCTL:-${root}/build/client/attnctl}
rounds=8
requests=2000
shape_flags="--batch=1 --heads=1 --kv_heads=1 --query_len=16 --key_len=16 --key_dim=64 --value_dim=64"
servers=()
flags=()
while (($#)); do
  case $1 in
    --rounds=*) rounds=${1#*=} ;;
    --requests=*) requests=${1#*=} ;;
    --shape=*) shape_flags=${1#*=} ;;
    --) shift; flags=("$@"); break ;;
    *) servers+=("$1") ;;
  esac
  shift
done
((${#servers[@]})) || { echo "usage: $0 [--rounds=N] attnserve... [-- flags]" >&2; exit 2; }

source "${root}/bench/servers_lib.sh"
for server in "${servers[@]}"; do
  OMP_WAIT_POLICY=PASSIVE start_server "${server}" --metrics_port=0 "${flags[@]}"
done

# Context switches of every thread of process $1.
switches() { cat /proc/"$1"/task/*/status | awk '/ctxt_switches/ {s += $2} END {print s}'; }

tick_hz=$(getconf CLK_TCK)
read -r -a shape <<<"${shape_flags}"
for round in $(seq 1 "${rounds}"); do
  for i in "${!servers[@]}"; do
    pid=${pids[$i]}
    "${attnctl}" --target="127.0.0.1:${ports[$i]}" --wait_for_ready bench --rpc=attend --concurrency=1 \
      --requests=200 --warmup=0s "${shape[@]}" >/dev/null
    ticks=$(cpu_ticks "${pid}")
    cs=$(switches "${pid}")
    p50=$("${attnctl}" --target="127.0.0.1:${ports[$i]}" --wait_for_ready bench --rpc=attend --concurrency=1 \
      --requests="${requests}" --warmup=0s "${shape[@]}" | sed -n 's/^latency p50 \([0-9.]*\)ms.*/\1/p')
    echo "$i ${p50} $(($(cpu_ticks "${pid}") - ticks)) $(($(switches "${pid}") - cs))" \
      >>"${workdir}/rounds"
  done
done

python3 - "${workdir}/rounds" "${requests}" "${tick_hz}" "${servers[@]}" <<'EOF'
import collections, statistics, sys
path, requests, hz, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
rows = collections.defaultdict(list)
for line in open(path):
    i, p50, ticks, cs = line.split()
    rows[int(i)].append((float(p50) * 1000, int(ticks) / hz * 1e6 / requests, int(cs) / requests))
for i, name in enumerate(names):
    p50s = sorted(r[0] for r in rows[i])
    print(f"{name}: p50 median {statistics.median(p50s):.0f} us "
          f"(rounds {', '.join(f'{p:.0f}' for p in p50s)}); "
          f"server CPU {statistics.median(r[1] for r in rows[i]):.0f} us/call, "
          f"{statistics.median(r[2] for r in rows[i]):.1f} context switches/call")
EOF
