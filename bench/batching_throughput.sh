#!/usr/bin/env bash
# What dynamic batching buys under load (#5 item 2): one attnserve per
# --max_batch value is started on loopback, then `attnctl bench` runs CLIENTS
# closed-loop clients of one Attend shape (by default the small (1, 8, 128, 64);
# --shape=B,H,Hkv,Lq,Lk,D picks another) against each in turn,
# ROUNDS times, the servers taking turns so that the host's drift hits them
# alike. Per server: the median req/s of the rounds (and their range), the
# server's and the client's CPU time per request (from /proc and the shell's
# `times`), and the mean batch the server computed (from its /metrics). Last,
# the ratio of each server's median to the first's.
#
#   bench/batching_throughput.sh [--rounds=5] [--duration=4s] [--clients=64] \
#       [--max_batch=1,32] [--shape=1,8,8,128,128,64] \
#       [--attnserve=build/server/attnserve] [-- server flags]
#
# On a machine whose clients run elsewhere, point ATTNCTL at a wrapper that
# runs attnctl there; the client CPU column then reads 0.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
attnctl=${ATTNCTL:-${root}/build/client/attnctl}
attnserve=${root}/build/server/attnserve
rounds=5
duration=4s
clients=64
max_batches=1,32
shape_text=1,8,8,128,128,64
flags=()
while (($#)); do
  case $1 in
    --rounds=*) rounds=${1#*=} ;;
    --duration=*) duration=${1#*=} ;;
    --clients=*) clients=${1#*=} ;;
    --max_batch=*) max_batches=${1#*=} ;;
    --shape=*) shape_text=${1#*=} ;;
    --attnserve=*) attnserve=${1#*=} ;;
    --) shift; flags=("$@"); break ;;
    *) echo "usage: $0 [--rounds=N] [--duration=D] [--clients=N]" \
         "[--max_batch=A,B,...] [--shape=B,H,Hkv,Lq,Lk,D] [--attnserve=BIN]" \
         "[-- server flags]" >&2; exit 2 ;;
  esac
  shift
done
IFS=, read -r -a batches <<<"${max_batches}"
IFS=, read -r -a dims <<<"${shape_text}"
if ((${#dims[@]} != 6)); then
  echo "--shape: expected six sizes B,H,Hkv,Lq,Lk,D, got '${shape_text}'" >&2
  exit 2
fi

source "${root}/bench/servers_lib.sh"
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
metrics_ports=()
for batch in "${batches[@]}"; do
  metrics_ports+=("$(free_port)")
  start_server "${attnserve}" --metrics_port="${metrics_ports[-1]}" --max_batch="${batch}" \
    "${flags[@]}"
done

shape=(--batch="${dims[0]}" --heads="${dims[1]}" --kv_heads="${dims[2]}" --query_len="${dims[3]}"
  --key_len="${dims[4]}" --key_dim="${dims[5]}" --value_dim="${dims[5]}")
tick_hz=$(getconf CLK_TCK)
for round in $(seq 1 "${rounds}"); do
  for i in "${!batches[@]}"; do
    ticks=$(cpu_ticks "${pids[$i]}")
    # The subshell's `times` second line: its children's user and system time.
    (
      "${attnctl}" --target="127.0.0.1:${ports[$i]}" --wait_for_ready bench --rpc=attend \
        --concurrency="${clients}" --duration="${duration}" --warmup=1s --json \
        "${shape[@]}" >"${workdir}/bench"
      times >"${workdir}/times"  # not in a pipe: a forked shell counts none
    )
    echo "$i $(($(cpu_ticks "${pids[$i]}") - ticks)) $(sed -n 2p "${workdir}/times")" \
      "$(cat "${workdir}/bench")" >>"${workdir}/rounds"
  done
done
for i in "${!batches[@]}"; do
  python3 - "${metrics_ports[$i]}" >>"${workdir}/metrics" "$i" <<'EOF'
import sys, urllib.request
port, index = sys.argv[1], sys.argv[2]
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
values = {}
for line in text.splitlines():
    if line.startswith("attnserve_batch_size_"):
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
print(index, values.get("attnserve_batch_size_sum", 0), values.get("attnserve_batch_size_count", 0))
EOF
done

python3 - "${workdir}/rounds" "${workdir}/metrics" "${tick_hz}" "${clients}" "${shape_text}" \
  "${batches[@]}" <<'EOF'
import collections, json, re, statistics, sys
rounds_path, metrics_path, hz, clients, shape, batches = (
    sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])

def seconds(text):  # bash `times`: 0m1.234s
    minutes, secs = re.fullmatch(r"(\d+)m([\d.]+)s", text).groups()
    return int(minutes) * 60 + float(secs)

rows = collections.defaultdict(list)
for line in open(rounds_path):
    index, ticks, user, system, report = line.split(" ", 4)
    report = json.loads(report)
    requests = report["requests"] + report["warmup_requests"]
    if report["error_count"]:
        sys.exit(f"max_batch {batches[int(index)]}: {report['errors']} errors")
    rows[int(index)].append((report["throughput_rps"],
                             int(ticks) / hz * 1e6 / requests,
                             (seconds(user) + seconds(system)) * 1e6 / requests))
mean_batch = {}
for line in open(metrics_path):
    index, total, count = line.split()
    mean_batch[int(index)] = float(total) / float(count) if float(count) else 0.0

print(f"{clients} clients, (B, H, Hkv, Lq, Lk, D) = ({shape.replace(',', ', ')}), "
      f"{len(rows[0])} rounds")
print("| max_batch | req/s, median (range) | server CPU us/req | client CPU us/req | mean batch |")
print("|---:|---:|---:|---:|---:|")
medians = []
for i, batch in enumerate(batches):
    rps = sorted(r[0] for r in rows[i])
    medians.append(statistics.median(rps))
    print(f"| {batch} | {medians[-1]:,.0f} ({rps[0]:,.0f}-{rps[-1]:,.0f}) | "
          f"{statistics.median(r[1] for r in rows[i]):.0f} | "
          f"{statistics.median(r[2] for r in rows[i]):.0f} | {mean_batch[i]:.2f} |")
for i, batch in enumerate(batches[1:], start=1):
    print(f"max_batch {batch} / max_batch {batches[0]}: {medians[i] / medians[0]:.2f}x")
EOF
