#!/usr/bin/env bash
# Compression end to end, measured on the wire: attnctl (the C++ client library) through a
# byte-counting loopback proxy (byte_counting_proxy.py) to attnserve.
#
# - --accept_compressed_requests --response_compression=gzip: `attnctl --compression=gzip`
#   (and deflate) sends an Attend whose keys and values are zeros in under a tenth of its raw
#   bytes, and the all-zero output comes back in under a tenth of its own; the output is right;
#   without --compression the request crosses whole. The access log (and so
#   attnserve_request_bytes_total, which counts the same figure) gives each request's bytes as
#   they arrived, compressed.
# - --response_compression=gzip alone: a gzip request is refused UNIMPLEMENTED naming
#   accept_compressed_requests; plain requests still get compressed answers.
# - neither: responses cross whole, a gzip request gets gRPC's UNIMPLEMENTED.
# - --response_compression=brotli stops start-up (exit 2); attnctl --compression=zstd is a
#   usage error (exit 2).
#
# usage: compression_e2e_test.sh ATTNSERVE ATTNCTL
set -euo pipefail

attnserve=$1
attnctl=$2
python=/usr/bin/python3
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

# Query random, keys and values zeros: the output is zeros.
"${python}" - "${workdir}" <<'PY'
import sys
import numpy as np
folder = sys.argv[1]
rng = np.random.default_rng(7)
np.save(f"{folder}/q.npy", rng.standard_normal((1, 8, 64, 64)).astype(np.float32))
np.save(f"{folder}/k.npy", np.zeros((1, 8, 1024, 64), np.float32))
np.save(f"{folder}/v.npy", np.zeros((1, 8, 1024, 64), np.float32))
PY
raw_request=$(((8 * 64 * 64 + 2 * 8 * 1024 * 64) * 4))
raw_output=$((8 * 64 * 64 * 4))

proxy_pid=""
start_proxy() {
  [[ -z ${proxy_pid} ]] || kill -KILL "${proxy_pid}" 2>/dev/null || true
  : >"${workdir}/proxy.out"
  "${python}" "${here}/byte_counting_proxy.py" "${port}" "${workdir}/counts" --seconds=300 \
    >"${workdir}/proxy.out" 2>&1 &
  proxy_pid=$!
  cleanup_pids+=("${proxy_pid}")
  proxy_port=""
  for _ in $(seq 1 100); do
    proxy_port=$(awk '/^port / { print $2 }' "${workdir}/proxy.out")
    [[ -n ${proxy_port} ]] && break
    sleep 0.1
  done
  [[ -n ${proxy_port} ]] || fail "the proxy did not start: $(cat "${workdir}/proxy.out")"
}

# Runs attnctl attend through the proxy with the given flags; sets up and down (bytes each way
# for this call alone) and the exit status.
attend_through_proxy() {
  read -r up_before down_before <"${workdir}/counts"
  set +e
  timeout 60 "${attnctl}" --target="127.0.0.1:${proxy_port}" "$@" attend \
    --query="${workdir}/q.npy" --key="${workdir}/k.npy" --value="${workdir}/v.npy" \
    --output="${workdir}/out.npy" >"${workdir}/attnctl.log" 2>&1
  status=$?
  set -e
  # The proxy writes its totals once the connection has closed.
  for _ in $(seq 1 50); do
    read -r up_after down_after <"${workdir}/counts"
    [[ ${up_after} -ne ${up_before} ]] && break
    sleep 0.1
  done
  up=$((up_after - up_before))
  down=$((down_after - down_before))
  echo "attnctl $*: exit ${status}, ${up} bytes up, ${down} down"
}

expect_zero_output() {
  "${python}" -c "import numpy as np, sys; o = np.load(sys.argv[1]);
sys.exit(0 if o.shape == (1, 8, 64, 64) and not o.any() else 1)" "${workdir}/out.npy" ||
    fail "the output is not the expected zeros"
}

# --- Both ways compressed.
start_attnserve "${attnserve}" --threads=2 --drain_grace_seconds=0 \
  --accept_compressed_requests --response_compression=gzip --access_log="${workdir}/access.log"
grep -q "compressed_requests=on response_compression=gzip" "${workdir}/server.log" ||
  fail "the start-up line does not show the compression"
start_proxy
for compression in gzip deflate; do
  attend_through_proxy --compression="${compression}"
  [[ ${status} -eq 0 ]] || fail "--compression=${compression}: $(cat "${workdir}/attnctl.log")"
  ((up * 10 < raw_request)) ||
    fail "--compression=${compression} sent ${up} bytes for ${raw_request} of tensors"
  ((down * 10 < raw_output)) ||
    fail "the gzip response took ${down} bytes for ${raw_output} of output"
  expect_zero_output
done
attend_through_proxy
[[ ${status} -eq 0 ]] || fail "an uncompressed call: $(cat "${workdir}/attnctl.log")"
((up >= raw_request)) || fail "an uncompressed call sent only ${up} bytes"
((down * 10 < raw_output)) || fail "the response to a plain request took ${down} bytes"
stop_attnserve
"${python}" - "${workdir}/access.log" "${raw_request}" <<'PY' || fail "the access log's request_bytes"
import json, sys
raw = int(sys.argv[2])
sizes = [line["request_bytes"] for line in map(json.loads, open(sys.argv[1]))
         if line["rpc"] == "Attend"]
print("access log request_bytes:", sizes)
# gzip, deflate, then plain: the compressed ones as they arrived, not inflated.
sys.exit(0 if len(sizes) == 3 and all(size * 10 < raw for size in sizes[:2])
         and sizes[2] >= raw else 1)
PY

# --- Compressed responses only.
start_attnserve "${attnserve}" --threads=2 --drain_grace_seconds=0 --response_compression=gzip
start_proxy
attend_through_proxy --compression=gzip
[[ ${status} -eq 1 ]] || fail "a gzip request without --accept_compressed_requests exited ${status}"
grep -q "UNIMPLEMENTED: the request is gzip-compressed.*accept_compressed_requests" \
  "${workdir}/attnctl.log" || fail "the refusal: $(cat "${workdir}/attnctl.log")"
attend_through_proxy
[[ ${status} -eq 0 ]] || fail "a plain call: $(cat "${workdir}/attnctl.log")"
((down * 10 < raw_output)) || fail "the response took ${down} bytes"
expect_zero_output
stop_attnserve

# --- Neither (the defaults).
start_attnserve "${attnserve}" --threads=2 --drain_grace_seconds=0
start_proxy
attend_through_proxy
[[ ${status} -eq 0 ]] || fail "a plain call: $(cat "${workdir}/attnctl.log")"
((down >= raw_output)) || fail "a response crossed in ${down} bytes with compression off"
attend_through_proxy --compression=gzip
[[ ${status} -eq 1 ]] || fail "a gzip request to the defaults exited ${status}"
grep -q "UNIMPLEMENTED" "${workdir}/attnctl.log" || fail "$(cat "${workdir}/attnctl.log")"
stop_attnserve

# --- Bad values.
set +e
"${attnserve}" --response_compression=brotli >"${workdir}/bad.log" 2>&1
status=$?
set -e
[[ ${status} -eq 2 ]] || fail "--response_compression=brotli exited ${status}, expected 2"
grep -q -- '--response_compression is "brotli", expected none, gzip or deflate' \
  "${workdir}/bad.log" || fail "$(cat "${workdir}/bad.log")"
set +e
"${attnctl}" --compression=zstd health >"${workdir}/bad.log" 2>&1
status=$?
set -e
[[ ${status} -eq 2 ]] || fail "attnctl --compression=zstd exited ${status}, expected 2"
grep -q -- '--compression is "zstd", expected none, gzip or deflate' "${workdir}/bad.log" ||
  fail "$(cat "${workdir}/bad.log")"
echo "PASS"
