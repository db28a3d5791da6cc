#!/usr/bin/env bash
# server/'s layers include only what server/README.md allows: each file's
# "attnserve/server/<layer>/" includes must name its own layer or one below it.
#
# usage: server_layers_test.sh SOURCE_DIR
set -euo pipefail
cd "$1/server"

declare -A allowed=(
  [rpc]="rpc"
  [tensors]="tensors"
  [weights]="weights tensors"
  [metrics]="metrics"
  [sessions]="sessions tensors metrics"
  [oip]="oip weights tensors"
  [attention]="attention oip rpc tensors weights sessions metrics"
  [process]="process attention oip rpc tensors weights sessions metrics"
)

failures=0
for layer in "${!allowed[@]}"; do
  [[ -d ${layer} ]] || { echo "FAIL: server/${layer}/ is missing"; failures=$((failures + 1)); continue; }
  files=$(find "${layer}" "include/attnserve/server/${layer}" -name '*.cc' -o -name '*.h' 2>/dev/null)
  for file in ${files}; do
    while read -r included; do
      [[ -z ${included} ]] && continue
      if [[ " ${allowed[${layer}]} " != *" ${included} "* ]]; then
        echo "FAIL: server/${file} (${layer}/) includes attnserve/server/${included}/, which ${layer}/ may not"
        failures=$((failures + 1))
      fi
    done < <(grep -o '#include "attnserve/server/[a-z_]*/' "${file}" | sed 's|.*server/||; s|/$||' | sort -u)
    # The library's entry points sit above every layer.
    if [[ ${layer} != process ]] && grep -q '#include "attnserve/server/server\(_options\)\?\.h"' "${file}"; then
      echo "FAIL: server/${file} (${layer}/) includes the server's entry point"
      failures=$((failures + 1))
    fi
  done
done
# Every source file lives in a layer.
for file in $(find . -maxdepth 1 -name '*.cc' -o -maxdepth 1 -name '*.h'); do
  echo "FAIL: server/${file#./} is in no layer"
  failures=$((failures + 1))
done
[[ ${failures} -eq 0 ]] || exit 1
echo "PASS: every include in server/ follows its layer's rule"
