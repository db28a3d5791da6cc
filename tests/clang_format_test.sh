#!/usr/bin/env bash
# Every C++ file of the repository is formatted as its .clang-format says
# (`clang-format --dry-run --Werror`): in a git checkout the tracked .cc and .h
# files, in a source tree without git (a tarball) the .cc and .h files under
# its source folders (every top-level folder but build*, hidden ones and CMake
# build trees). Generated protobuf files (*.pb.h, *.pb.cc) are skipped. On
# failure it names each file that differs and shows the first lines of the
# change clang-format would make.
#
# usage: clang_format_test.sh REPO_ROOT [CLANG_FORMAT]
#   CLANG_FORMAT defaults to $CLANG_FORMAT, then to clang-format on the PATH
#   (scripts/install-deps installs it).
set -euo pipefail
root=$(cd "$1" && pwd -P)
clang_format=${2:-${CLANG_FORMAT:-clang-format}}
diff_lines=20

if ! command -v "${clang_format}" >/dev/null; then
  echo "FAIL: ${clang_format} not found; scripts/install-deps installs it"
  exit 1
fi
if [[ ! -f ${root}/.clang-format ]]; then
  echo "FAIL: ${root}/.clang-format is missing"
  exit 1
fi

# The files to check, relative to the root.
files=()
toplevel=$(git -C "${root}" rev-parse --show-toplevel 2>/dev/null || true)
if [[ -n ${toplevel} && $(cd "${toplevel}" && pwd -P) == "${root}" ]]; then
  source="tracked files (git ls-files)"
  while IFS= read -r -d '' file; do
    if [[ -f ${root}/${file} ]]; then  # Not one deleted but not yet committed.
      files+=("${file}")
    fi
  done < <(git -C "${root}" ls-files -z -- '*.cc' '*.h')
else
  source="files under the source folders (not a git checkout)"
  folders=()
  for dir in "${root}"/*/; do
    name=$(basename "${dir}")
    [[ ${name} == build* || -f ${dir}/CMakeCache.txt ]] && continue
    folders+=("${name}")
  done
  if ((${#folders[@]})); then
    while IFS= read -r -d '' file; do
      files+=("${file}")
    done < <(cd "${root}" && find "${folders[@]}" \( -name '.*' -o -name 'build*' \) -prune -o \
               -type f \( -name '*.cc' -o -name '*.h' \) -print0 | sort -z)
  fi
fi

checked=()
for file in "${files[@]}"; do
  [[ ${file} == *.pb.h || ${file} == *.pb.cc ]] || checked+=("${file}")
done
version=$("${clang_format}" --version)
if ((${#checked[@]} == 0)); then
  echo "FAIL: no C++ files found under ${root} (${source})"
  exit 1
fi

# One run over all the files; only if it fails, one run a file to name them.
failed=()
if ! (cd "${root}" && "${clang_format}" --style=file --dry-run --Werror "${checked[@]}") \
    >/dev/null 2>&1; then
  for file in "${checked[@]}"; do
    if ! "${clang_format}" --style=file --dry-run --Werror "${root}/${file}" >/dev/null 2>&1; then
      failed+=("${file}")
    fi
  done
  if ((${#failed[@]} == 0)); then
    echo "FAIL: ${clang_format} failed on the files together, on none alone:"
    (cd "${root}" && "${clang_format}" --style=file --dry-run --Werror "${checked[@]}" 2>&1) |
      head -n "${diff_lines}" || true
    exit 1
  fi
fi

count=${#checked[@]}
if ((${#failed[@]} == 0)); then
  echo "PASS: ${count} C++ files formatted as .clang-format says (${source}; ${version})"
  exit 0
fi

for file in "${failed[@]}"; do
  echo "== ${file} is not formatted; the first lines of clang-format's change:"
  # diff exits 1 when the files differ; head may close the pipe early.
  diff -u --label "${file}" --label "${file} (formatted)" "${root}/${file}" \
    <("${clang_format}" --style=file "${root}/${file}") | head -n "${diff_lines}" || true
done
echo
echo "FAIL: ${#failed[@]} of ${count} C++ files are not formatted as .clang-format says" \
  "(${source}; ${version}):"
printf '  %s\n' "${failed[@]}"
echo "Fix with: (cd ${root} && ${clang_format} -i ${failed[*]})"
exit 1
