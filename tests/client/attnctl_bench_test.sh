#!/usr/bin/env bash
# attnctl bench end to end on loopback: a counted run with --json (every request accounted
# for, latency percentiles ordered, FLOPs by the FlashAttention convention), the error
# breakdown of a request the server rejects, a timed run with warm-up, MHA, the text report,
# and the bounds on its flags.
#
# usage: attnctl_bench_test.sh ATTNSERVE ATTNCTL
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/attnctl_test_lib.sh"

# check_json FILE PYTHON_EXPRESSION...: each expression, over the JSON object `r`, must be true.
check_json() {
  local file=$1
  shift
  timeout 30 /usr/bin/python3 - "${file}" "$@" <<'PY' || fail "bench JSON: $(cat "${file}")"
import json, sys
text = open(sys.argv[1]).read()
lines = text.splitlines()
assert len(lines) == 1, f"expected one line of JSON, got {len(lines)}"
r = json.loads(lines[0])
for expression in sys.argv[2:]:
    assert eval(expression), f"{expression} is false for {r}"
PY
}

start_server "$1" "$2"
cd "${workdir}"

# 200 counted requests from 4 workers: B=1 H=4 Hkv=2 Lq=16 Lk=32 Dk=16 Dv=8.
ctl bench --requests=200 --concurrency=4 --json --heads=4 --kv_heads=2 --query_len=16 \
  --key_len=32 --key_dim=16 --value_dim=8 >counted.json
check_json counted.json 'r["rpc"] == "attend"' 'r["requests"] == 200' 'r["ok"] == 200' \
  'r["error_count"] == 0' 'r["errors"] == {}' 'r["concurrency"] == 4' \
  'r["warmup_requests"] == 0' 'r["shape"] == "B=1 H=4 Hkv=2 Lq=16 Lk=32 Dk=16 Dv=8"' \
  'r["flops_per_request"] == 2 * 1 * 4 * 16 * 32 * (16 + 8)' \
  '0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p90"] <= r["latency_ms"]["p99"] <= r["latency_ms"]["max"]' \
  'r["throughput_rps"] > 0 and r["gflops_per_s"] > 0 and r["elapsed_s"] > 0' \
  'abs(r["throughput_rps"] - 200 / r["elapsed_s"]) < 1e-3 * r["throughput_rps"] + 1e-3'

# Causal counts the pairs the mask leaves: 36 of the 8 x 8; bfloat16 inputs are
# reported.
ctl bench --requests=8 --concurrency=2 --json --causal --input_dtype=bfloat16 --heads=2 \
  --kv_heads=2 --query_len=8 --key_len=8 --key_dim=8 --value_dim=8 >causal.json
check_json causal.json 'r["ok"] == 8' 'r["input_dtype"] == "BFLOAT16"' \
  'r["flops_per_request"] == 2 * 2 * 8 * 8 * 16 * 36 / 64'

# Every request rejected: counted by code, exit 1 since nothing succeeded.
expect_exit 1 '"errors":{"INVALID_ARGUMENT":40}' ctl bench --requests=40 --concurrency=3 \
  --json --heads=3 --kv_heads=2 --query_len=4 --key_len=4
# A deadline no call can meet in time: the calls end DEADLINE_EXCEEDED (gRPC may let one
# that answers within its timer's granularity through), never a hang.
timeout 60 "${attnctl}" --target="${target}" --timeout=1us bench --requests=6 --concurrency=2 \
  --json --query_len=256 --key_len=256 >deadline.json || true
check_json deadline.json 'r["requests"] == 6' 'set(r["errors"]) == {"DEADLINE_EXCEEDED"}' \
  'r["ok"] + r["errors"]["DEADLINE_EXCEEDED"] == 6'

# A timed run with warm-up: bounded by --duration, warm-up calls not counted.
ctl bench --duration=400ms --warmup=200ms --concurrency=2 --json --heads=2 --kv_heads=2 \
  --query_len=8 --key_len=8 --key_dim=8 --value_dim=8 >timed.json
check_json timed.json 'r["requests"] > 0 and r["ok"] == r["requests"]' \
  'r["warmup_requests"] > 0' '0.4 <= r["elapsed_s"] < 20' 'r["warmup_s"] == 0.2'

# MHA on the built-in demo set: projections count too.
ctl bench --rpc=mha --requests=12 --concurrency=2 --json --query_len=4 >mha.json
check_json mha.json 'r["rpc"] == "mha"' 'r["ok"] == 12' \
  'r["shape"] == "B=1 Lq=4 Lk=4 E=64 Ekv=64 H=8 Hkv=8 Dk=8 Dv=8"' \
  'r["flops_per_request"] == 2 * (4*64*64 + 4*64*(64+64) + 4*64*64) + 2*8*4*4*16'

# The text report.
ctl bench --requests=10 --concurrency=1 --query_len=4 --key_len=4 >text.out
grep -qx "requests 10 ok 10 errors 0 in .*" text.out || fail "text report: $(cat text.out)"
grep -q "^throughput [0-9.]* req/s, [0-9.]* GFLOP/s$" text.out || fail "$(cat text.out)"
grep -q "^latency p50 [0-9.]*ms p90 [0-9.]*ms p99 [0-9.]*ms max [0-9.]*ms" text.out ||
  fail "$(cat text.out)"

# Bounds.
expect_exit 2 "needs --duration" ctl bench
expect_exit 2 "expected 1 to 1024" ctl bench --requests=1 --concurrency=1025
expect_exit 2 "expected 1 to 1024" ctl bench --requests=1 --concurrency=0
expect_exit 2 "up to 1h" ctl bench --duration=2h
expect_exit 2 "expected 0 to 10m" ctl bench --requests=1 --warmup=11m
expect_exit 2 "expected attend, mha or step" ctl bench --requests=1 --rpc=grpc
expect_exit 2 "would not fit" ctl bench --requests=1 --query_len=1048576 --key_dim=1024

# Workers the system will not start (an address-space limit too small for 1,024 thread stacks)
# end the run with a message and exit 1, measuring nothing (before: an uncaught exception, and
# the workers already started waited at a barrier for ones that never came). With a warm-up the
# workers started first used to call while the system refused threads, gRPC was refused its own,
# and the run aborted or never ended; now no call is made before every thread exists. Three
# tries each, for the window in which gRPC asks for a thread is short. A sanitizer's shadow
# memory does not fit such a limit at all, so sanitized builds skip it.
if [[ $(ldd "${attnctl}") != *lib[at]san* ]]; then
  for try in 1 2 3; do
    for warmup in 0s 1s; do
      expect_exit 1 "RESOURCE_EXHAUSTED: started [0-9]* of --concurrency=1024 worker threads" \
        bash -c 'ulimit -v 600000 && exec "$@"' limited timeout 30 "${attnctl}" \
        --target="${target}" bench --requests=50 --concurrency=1024 --warmup="${warmup}" \
        --query_len=4 --key_len=4
    done
  done
fi

stop_server
echo "PASS"
