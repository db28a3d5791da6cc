#!/usr/bin/env bash
# attnserve's /metrics as Prometheus sees it: promtool lints the scraped text, then a real
# Prometheus server on loopback scrapes attnserve every second, and its HTTP API must answer
# attnserve_requests_total and a histogram_quantile over the request-duration histogram.
#
# usage: prometheus_scrape_test.sh ATTNSERVE ATTNCTL
set -euo pipefail

attnserve=$1
attnctl=$2
workdir=$(mktemp -d)
pids=()

cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "${pid}" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    timeout 10 tail --pid="${pid}" -f /dev/null 2>/dev/null || kill -KILL "${pid}" 2>/dev/null || true
  done
  rm -rf "${workdir}"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  for log in "${workdir}"/*.log; do echo "--- ${log}" >&2; tail -20 "${log}" >&2; done
  exit 1
}

# A loopback port nothing answers on (tried at random; the servers fail loudly if it is taken).
free_port() {
  local port
  for _ in $(seq 1 50); do
    port=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/${port}") 2>/dev/null; then
      echo "${port}"
      return 0
    fi
  done
  return 1
}

# GET http://127.0.0.1:PORT/PATH and print the body.
http_get() {
  local response
  response=$(timeout 10 bash -c '
    exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
    printf "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" "$2" >&3
    cat <&3' _ "$1" "$2") || return 1
  printf '%s\n' "${response}" | sed '1,/^\r*$/d'
}

wait_for() {  # SECONDS COMMAND...: retry every 0.5 s
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

grpc_port=$(free_port)
metrics_port=$(free_port)
"${attnserve}" --address=127.0.0.1 --port="${grpc_port}" --metrics_port="${metrics_port}" \
  --threads=1 >"${workdir}/attnserve.log" 2>&1 &
pids+=($!)
wait_for 20 "${attnctl}" --target="127.0.0.1:${grpc_port}" --timeout=2s health ||
  fail "attnserve did not start"

for _ in 1 2 3; do
  "${attnctl}" --target="127.0.0.1:${grpc_port}" attend --demo --query_len=16 --key_len=16 \
    >/dev/null || fail "attend failed"
done
"${attnctl}" --target="127.0.0.1:${grpc_port}" attend --demo --heads=3 --kv_heads=2 \
  >/dev/null 2>&1 && fail "a bad request succeeded"

http_get "${metrics_port}" /metrics >"${workdir}/metrics.txt" || fail "scrape failed"
grep -q '^attnserve_requests_total{code="OK",rpc="Attend"} 3$' "${workdir}/metrics.txt" ||
  fail "scraped counters: $(grep attnserve_requests_total "${workdir}/metrics.txt" | grep -v ' 0$')"
promtool check metrics <"${workdir}/metrics.txt" >"${workdir}/promtool.log" 2>&1 ||
  fail "promtool check metrics: $(cat "${workdir}/promtool.log")"
echo "promtool check metrics: OK"

prometheus_port=$(free_port)
cat >"${workdir}/prometheus.yml" <<CONFIG
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: attnserve
    static_configs:
      - targets: ['127.0.0.1:${metrics_port}']
CONFIG
promtool check config "${workdir}/prometheus.yml" >/dev/null || fail "bad prometheus.yml"
prometheus --config.file="${workdir}/prometheus.yml" --storage.tsdb.path="${workdir}/tsdb" \
  --web.listen-address="127.0.0.1:${prometheus_port}" --log.level=warn \
  >"${workdir}/prometheus.log" 2>&1 &
pids+=($!)

query() { http_get "${prometheus_port}" "/api/v1/query?query=$1"; }
has_attend_series() { query attnserve_requests_total | grep -q '"rpc":"Attend"'; }
wait_for 60 has_attend_series || fail "Prometheus never scraped attnserve_requests_total"
echo "Prometheus: $(query 'attnserve_requests_total%7Bcode%3D%22OK%22%2Crpc%3D%22Attend%22%7D')"

# histogram_quantile(0.99, sum by (le) (attnserve_request_duration_seconds_bucket{rpc="Attend"}))
p99=$(query 'histogram_quantile(0.99%2C%20sum%20by%20(le)%20(attnserve_request_duration_seconds_bucket%7Brpc%3D%22Attend%22%7D))')
echo "p99 query: ${p99}"
grep -q '"status":"success"' <<<"${p99}" || fail "histogram_quantile query failed"
grep -Eq '"value":\[[0-9.]+,"[0-9.e+-]+"\]' <<<"${p99}" || fail "histogram_quantile gave no number"
echo "PASS"
