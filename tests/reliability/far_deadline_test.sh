#!/usr/bin/env bash
# Starts attnserve on a free loopback port and runs far_deadline_test.py against it (raw HTTP/2
# through Debian's python3-h2), then stops the server with SIGTERM and expects exit status 0.
#
# usage: far_deadline_test.sh ATTNSERVE STUBS_DIR
set -euo pipefail

attnserve=$1
stubs_dir=$2
python=/usr/bin/python3  # Debian's, with python3-h2 and python3-protobuf.
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

"${python}" -c "import h2, google.protobuf" || fail "${python} lacks h2 or protobuf: run scripts/install-deps"
start_attnserve "${attnserve}" --threads=2 --drain_grace_seconds=0

set +e
timeout 60 "${python}" "${here}/far_deadline_test.py" "${port}" "${stubs_dir}"
status=$?
set -e
[[ ${status} -eq 0 ]] || fail "far_deadline_test.py exited ${status}"
kill -0 "${server_pid}" 2>/dev/null || fail "attnserve died"
stop_attnserve
echo "PASS"
