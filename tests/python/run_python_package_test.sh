#!/usr/bin/env bash
# The attnserve Python package as a user gets it: `cmake --install --component python` into a
# scratch prefix, then its pytest suite (python/tests; Debian's python3-pytest) with only
# that prefix added to Debian's python3 path. The tests start their own attnserve servers
# (plain; mutual TLS with a token) on free loopback ports.
#
# usage: run_python_package_test.sh CMAKE BUILD_DIR PYTHON_INSTALL_DIR ATTNSERVE TESTS_DIR
set -euo pipefail

cmake=$1
build_dir=$2
python_dir=$3
attnserve=$4
tests_dir=$5
python=/usr/bin/python3
workdir=$(mktemp -d)
trap 'rm -rf "${workdir}"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"${python}" -c "import grpc, numpy, google.protobuf, pytest" ||
  fail "${python} lacks grpc, numpy, protobuf or pytest: run scripts/install-deps"
"${cmake}" --install "${build_dir}" --component python --prefix "${workdir}/prefix" \
  >"${workdir}/install.log" || fail "cmake --install --component python failed"
package_dir=${workdir}/prefix/${python_dir}
[[ -f ${package_dir}/attnserve/v1/attention_pb2.py ]] ||
  fail "the install has no attnserve/v1 stubs under ${package_dir}"
[[ -z $(find "${workdir}/prefix" -name '*.pyc' -o -name '__pycache__') ]] ||
  fail "the install carries compiled Python files"

# -p no:cacheprovider: nothing written into the source tree.
cd "${workdir}"
PYTHONPATH=${package_dir} PYTHONDONTWRITEBYTECODE=1 ATTNSERVE_BINARY=${attnserve} \
  ATTNSERVE_EXPECTED_PACKAGE_DIR=${package_dir} \
  timeout 240 "${python}" -m pytest -q -p no:cacheprovider "${tests_dir}"
