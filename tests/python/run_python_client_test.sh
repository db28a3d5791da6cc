#!/usr/bin/env bash
# Runs the Python client example against a live server: starts attnserve on a free loopback
# port, runs examples/python/attnserve_client.py (its checks compare Attend and
# MultiHeadAttention with a NumPy reference), then stops the server with SIGTERM and expects
# exit status 0.
#
# usage: run_python_client_test.sh ATTNSERVE STUBS_DIR EXAMPLE
set -euo pipefail

attnserve=$1
stubs_dir=$2
example=$3
# Debian's interpreter, explicitly: a pyenv or virtualenv python3 earlier on PATH would lack
# python3-grpcio and python3-numpy.
python=/usr/bin/python3
workdir=$(mktemp -d)
server_pid=""

cleanup() {
  if [[ -n ${server_pid} ]] && kill -0 "${server_pid}" 2>/dev/null; then
    kill -KILL "${server_pid}" 2>/dev/null || true
  fi
  rm -rf "${workdir}"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  echo "--- server log" >&2
  cat "${workdir}/server.log" >&2 || true
  exit 1
}

[[ -f ${stubs_dir}/attnserve/v1/attention_pb2_grpc.py ]] ||
  fail "no stubs in ${stubs_dir}: build the attnserve_python_stubs target"
"${python}" -c "import grpc, numpy, google.protobuf" ||
  fail "${python} lacks grpc, numpy or protobuf: run scripts/install-deps"

# Create the log before starting the server: the `>` redirection of a background job happens
# in the child after the fork, so without this the first poll below may find no file yet.
: >"${workdir}/server.log"
"${attnserve}" --address=127.0.0.1 --port=0 --metrics_port=0 --threads=2 \
  >"${workdir}/server.log" 2>&1 &
server_pid=$!

port=""
for _ in $(seq 1 100); do
  port=$(sed -n 's/^attnserve [^ ]* listening on 127\.0\.0\.1:\([0-9]*\),.*/\1/p' "${workdir}/server.log" || true)
  [[ -n ${port} ]] && break
  kill -0 "${server_pid}" 2>/dev/null || fail "attnserve exited during start-up"
  sleep 0.1
done
[[ -n ${port} ]] || fail "attnserve did not report its port within 10 s"

set +e
timeout 60 "${python}" "${example}" --target "127.0.0.1:${port}" --stubs "${stubs_dir}"
status=$?
set -e
[[ ${status} -eq 0 ]] || fail "the Python client exited ${status}"
kill -0 "${server_pid}" 2>/dev/null || fail "attnserve died during the Python checks"

kill -TERM "${server_pid}"
for _ in $(seq 1 300); do
  kill -0 "${server_pid}" 2>/dev/null || break
  sleep 0.1
done
kill -0 "${server_pid}" 2>/dev/null && fail "attnserve still running 30 s after SIGTERM"
set +e
wait "${server_pid}"
exit_status=$?
set -e
server_pid=""
[[ ${exit_status} -eq 0 ]] || fail "attnserve exited ${exit_status} after SIGTERM, expected 0"
echo "PASS"
