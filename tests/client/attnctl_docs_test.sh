#!/usr/bin/env bash
# The attnctl commands docs/client.md shows, run against attnserve on a free loopback port (each
# must exit 0, or the status its comment documents), and the sample outputs it shows checked
# against what attnctl prints: attnctl_docs_test.py says how.
#
# usage: attnctl_docs_test.sh ATTNSERVE ATTNCTL DOCS_MD
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
docs=$(realpath "$3")
source "${here}/attnctl_test_lib.sh"

start_server "$1" "$2"
# The page's bench runs for 11 s; the others take well under a second each.
timeout 150 /usr/bin/python3 "${here}/attnctl_docs_test.py" --docs "${docs}" \
  --attnctl "${attnctl}" --target "${target}" --workdir "${workdir}" ||
  fail "the commands or sample outputs of ${docs} do not hold (above)"
stop_server
echo "PASS"
