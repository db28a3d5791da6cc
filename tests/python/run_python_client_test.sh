#!/usr/bin/env bash
# Runs the Python client example, which uses the attnserve package, against a live server:
# starts attnserve on a free loopback port, runs examples/python/attnserve_client.py (its
# checks compare Attend and
# MultiHeadAttention with a NumPy reference, then run a decode loop over a KV-cache session:
# create, prefill in chunks, decode, fork, a stale expected_length, delete), then stops the
# server with SIGTERM and expects exit status 0.
#
# usage: run_python_client_test.sh ATTNSERVE PACKAGE_DIR EXAMPLE
set -euo pipefail

attnserve=$1
package_dir=$2
example=$3
# Debian's interpreter, explicitly: a pyenv or virtualenv python3 earlier on PATH would lack
# python3-grpcio and python3-numpy.
python=/usr/bin/python3
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

[[ -f ${package_dir}/attnserve/v1/attention_pb2_grpc.py ]] ||
  fail "no attnserve package in ${package_dir}: build the attnserve_python target"
"${python}" -c "import grpc, numpy, google.protobuf" ||
  fail "${python} lacks grpc, numpy or protobuf: run scripts/install-deps"

start_attnserve "${attnserve}" --threads=2

set +e
timeout 60 "${python}" "${example}" --target "127.0.0.1:${port}" --package "${package_dir}" \
  | tee "${workdir}/checks.txt"
status=${PIPESTATUS[0]}
set -e
[[ ${status} -eq 0 ]] || fail "the Python client exited ${status}"
# The session decode loop ran, not just the stateless checks.
for check in session_decode session_fork session_expected_length session_delete; do
  grep -q "^PASS ${check}:" "${workdir}/checks.txt" || fail "no passing ${check} check"
done
kill -0 "${server_pid}" 2>/dev/null || fail "attnserve died during the Python checks"

stop_attnserve
echo "PASS"
