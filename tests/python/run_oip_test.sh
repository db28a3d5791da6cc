#!/usr/bin/env bash
# oip_test.py against a live server on a free loopback port, then SIGTERM and exit 0.
#
# usage: run_oip_test.sh ATTNSERVE STUBS_DIR EXAMPLES_PYTHON_DIR OIP_TEST
set -euo pipefail

attnserve=$1
stubs_dir=$2
examples_dir=$3
oip_test=$4
python=/usr/bin/python3
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

start_attnserve "${attnserve}" --threads=2 --drain_grace_seconds=0
set +e
PYTHONDONTWRITEBYTECODE=1 timeout 90 "${python}" "${oip_test}" "127.0.0.1:${port}" \
  "${stubs_dir}" "${examples_dir}"
status=$?
set -e
[[ ${status} -eq 0 ]] || fail "oip_test.py exited ${status}"
kill -0 "${server_pid}" 2>/dev/null || fail "attnserve died during the checks"
stop_attnserve
echo "PASS"
