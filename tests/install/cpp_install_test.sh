#!/usr/bin/env bash
# The C++ client library used from outside the tree, as a user would: `cmake --install` into a
# prefix, the prefix moved elsewhere (installs must not remember their path), then
# examples/cpp built against it twice, as a CMake project of its own (find_package(attnserve
# CONFIG) → attnserve::client) and with plain g++ and pkg-config, and both programs run against
# a live server (their checks compare Attend and a KV-cache session's decode steps with a
# double-precision reference computed in the example).
#
# usage: cpp_install_test.sh CMAKE CXX BUILD_DIR SOURCE_DIR
set -euo pipefail

cmake=$1
cxx=$2
build_dir=$3
source_dir=$4
here=$(cd "$(dirname "$0")" && pwd)
source "${here}/../attnserve_process_lib.sh"

"${cmake}" --install "${build_dir}" --prefix "${workdir}/staging" >"${workdir}/install.log" ||
  fail "cmake --install failed: $(tail -5 "${workdir}/install.log")"
mv "${workdir}/staging" "${workdir}/prefix"
prefix=${workdir}/prefix

for file in bin/attnserve bin/attnctl include/attnserve/client/client.h \
  include/attnserve/v1/attention.pb.h lib/cmake/attnserve/attnserveConfig.cmake \
  lib/pkgconfig/attnserve-client.pc share/attnserve/proto/attnserve/v1/attention.proto; do
  [[ -f ${prefix}/${file} ]] || fail "the install lacks ${file}"
done
# Every attnserve header an installed header includes is installed too (the build tree's
# include folders are not there to hide a missing one).
while read -r included; do
  [[ -f ${prefix}/include/${included} ]] ||
    fail "an installed header includes ${included}, which is not installed"
done < <(grep -rhoE '^#include "(attnserve|grpc/health)/[^"]+"' "${prefix}/include" |
  sed -E 's/^#include "(.*)"$/\1/' | sort -u)
# Nothing in the installed package names the build tree or the staging prefix.
if grep -rlF -e "${build_dir}" -e "${workdir}/staging" "${prefix}/lib/cmake" \
  "${prefix}/lib/pkgconfig"; then
  fail "the installed package config names the build tree or the install prefix"
fi

# A CMake project of its own; no package registry, so only the prefix can be found.
"${cmake}" -S "${source_dir}/examples/cpp" -B "${workdir}/cmake-build" \
  -DCMAKE_CXX_COMPILER="${cxx}" -DCMAKE_PREFIX_PATH="${prefix}" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"${workdir}/configure.log" 2>&1 ||
  fail "configuring examples/cpp failed: $(tail -20 "${workdir}/configure.log")"
grep -q "^attnserve_DIR:PATH=${prefix}/" "${workdir}/cmake-build/CMakeCache.txt" ||
  fail "find_package(attnserve) found $(grep '^attnserve_DIR' \
    "${workdir}/cmake-build/CMakeCache.txt"), not the prefix"
"${cmake}" --build "${workdir}/cmake-build" >"${workdir}/build.log" 2>&1 ||
  fail "building examples/cpp failed: $(tail -30 "${workdir}/build.log")"

# pkg-config, with no CMake in the way.
flags=$(PKG_CONFIG_PATH=${prefix}/lib/pkgconfig pkg-config --cflags --libs attnserve-client) ||
  fail "pkg-config does not find attnserve-client in the prefix"
# shellcheck disable=SC2086  # the flags are words
"${cxx}" -std=c++17 -O1 "${source_dir}/examples/cpp/attend_example.cc" \
  -o "${workdir}/attend_example_pkgconfig" ${flags} >"${workdir}/pkgconfig.log" 2>&1 ||
  fail "building with pkg-config's flags failed: $(tail -30 "${workdir}/pkgconfig.log")"

start_attnserve "${prefix}/bin/attnserve" --threads=2
for program in "${workdir}/cmake-build/attend_example" "${workdir}/attend_example_pkgconfig"; do
  set +e
  timeout 60 "${program}" "127.0.0.1:${port}" | tee "${workdir}/checks.txt"
  status=${PIPESTATUS[0]}
  set -e
  [[ ${status} -eq 0 ]] || fail "${program##*/} exited ${status}"
  for check in attend session; do
    grep -q "^PASS ${check}:" "${workdir}/checks.txt" ||
      fail "${program##*/} printed no passing ${check} check"
  done
done
stop_attnserve
echo "PASS"
