#!/usr/bin/env bash
# attnctl's help and version, no server: --help (and -help, --helpshort) lists every flag that a
# source file under client/ defines, exits 0 and shows no absolute path; --helpfull adds Abseil's
# --flagfile and exits 0; --version prints "attnctl X.Y.Z" and the commit it was built from; `attnctl help` is still an unknown
# command (exit 2); an unknown flag or a value a flag cannot parse is a usage error (exit 2) that
# names the flag and what it expects.
#
# usage: attnctl_help_test.sh ATTNCTL CLIENT_SOURCE_DIR
set -euo pipefail
attnctl=$1
sources=$2
fail() { echo "FAIL: $*" >&2; exit 1; }

# Every ABSL_FLAG(type, name, ...) under client/, the type and name possibly on the next line.
mapfile -t flags < <(/usr/bin/python3 - "${sources}" <<'PY'
import pathlib, re, sys
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.cc")):
    for match in re.finditer(r"ABSL_FLAG\(\s*[\w:<>]+\s*,\s*(\w+)", path.read_text()):
        print(match.group(1))
PY
)
(( ${#flags[@]} >= 40 )) || fail "found ${#flags[@]} flags under ${sources}, expected 40 or more"

for option in --help -help --helpshort; do
  help=$(timeout 10 "${attnctl}" "${option}") || fail "attnctl ${option} exited $?"
  for flag in "${flags[@]}"; do
    grep -q -- "^    --${flag} (" <<<"${help}" || fail "attnctl ${option} does not list --${flag}"
  done
  grep -q -- "^    --flagfile (" <<<"${help}" && fail "attnctl ${option} lists Abseil's --flagfile"
  grep -q "Flags from /\|$(realpath "${sources}")" <<<"${help}" &&
    fail "attnctl ${option} shows a build path: $(grep 'Flags from' <<<"${help}")"
  grep -q "^attnctl \[--target=HOST:PORT\]" <<<"${help}" || fail "${option}: no usage line"
done

full=$(timeout 10 "${attnctl}" --helpfull) || fail "attnctl --helpfull exited $?"
grep -q -- "^    --flagfile (" <<<"${full}" || fail "--helpfull does not list --flagfile"
grep -q -- "^    --tls_ca (" <<<"${full}" || fail "--helpfull does not list --tls_ca"

version=$(timeout 10 "${attnctl}" --version) || fail "attnctl --version exited $?"
[[ ${version} =~ ^attnctl\ [0-9]+\.[0-9]+\.[0-9]+$'\n'commit\ ([0-9a-f]{12}(-dirty)?|unknown),\ [A-Za-z]+\ build,\ [A-Za-z]+\ [0-9.]+$ ]] ||
  fail "attnctl --version printed '${version}', expected 'attnctl X.Y.Z' and its commit"

set +e
timeout 10 "${attnctl}" help >/dev/null 2>&1
status=$?
set -e
[[ ${status} -eq 2 ]] || fail "'attnctl help' exited ${status}, expected 2 (unknown command)"

bad_flag() {  # EXPECTED_MESSAGE ARGUMENT...
  local expected=$1 output status
  shift
  set +e
  output=$(timeout 10 "${attnctl}" "$@" 2>&1)
  status=$?
  set -e
  [[ ${status} -eq 2 ]] || fail "attnctl $* exited ${status}, expected 2: ${output}"
  [[ ${output} == *"${expected}"* ]] || fail "attnctl $*: '${output}', expected '${expected}'"
}
bad_flag 'unknown flag "--timeout_seconds"; --help lists the flags' --timeout_seconds=5 health
bad_flag '--timeout is "abc", expected a duration (500ms, 30s, 2m, 1h30m)' --timeout=abc health
bad_flag '--timeout needs a value' health --timeout
bad_flag '"-5" is no flag, and no argument takes a negative number' session truncate \
  00112233445566778899aabbccddeeff -5
# A flag file's lines are checked as the command line's, and only a regular file is read (Abseil's
# parse read /dev/zero without end).
flags_file=$(mktemp)
trap 'rm -f "${flags_file}"' EXIT
printf -- '--timeout=abc\n' >"${flags_file}"
bad_flag "--timeout is \"abc\", expected a duration (500ms, 30s, 2m, 1h30m); --help gives its \
range (in --flagfile \"${flags_file}\")" --flagfile="${flags_file}" health
bad_flag '--flagfile: /dev/zero is a device, expected a regular file' --flagfile=/dev/zero health
echo "PASS"
