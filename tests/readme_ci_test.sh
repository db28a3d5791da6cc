#!/usr/bin/env bash
# The README opens with the server command and the test command, and .ci/run runs exactly the
# test command. This keeps the three from drifting apart.
#
# usage: readme_ci_test.sh REPO_ROOT
set -euo pipefail
root=$1

commands=$(awk '/^```/ { if (inside) exit; inside = 1; next } inside' "${root}/README.md")
[[ $(wc -l <<<"${commands}") -eq 2 ]] || { echo "FAIL: README's first block is not two commands"; exit 1; }
serve=$(sed -n 1p <<<"${commands}")
test_command=$(sed -n 2p <<<"${commands}")
ci_command=$(grep -v '^\s*#' "${root}/.ci/run" | grep -v '^set \|^cd ' | sed '/^\s*$/d')

[[ ${serve} == *"scripts/install-deps"*"build/server/attnserve"*"--port=50051"* ]] ||
  { echo "FAIL: first README command does not install, build and start the server: ${serve}"; exit 1; }
[[ ${test_command} == *"scripts/install-deps"*"ctest"* ]] ||
  { echo "FAIL: second README command does not install, build and test: ${test_command}"; exit 1; }
[[ ${ci_command} == "${test_command}" ]] ||
  { echo "FAIL: .ci/run runs '${ci_command}', README says '${test_command}'"; exit 1; }
echo PASS
