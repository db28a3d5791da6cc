#!/usr/bin/python3
"""Runs the attnctl commands that docs/client.md shows, against a live server.

  attnctl_docs_test.py --docs docs/client.md --attnctl ATTNCTL --target HOST:PORT --workdir DIR

Every `attnctl ...` line of a ```sh block (with its backslash continuations)
is run in DIR, in the order the page shows them, with --target pointed at the
test's server (a --target the page gives is dropped) and must exit with the
status its trailing comment documents ("# ..., exit N"), else 0. The input
files the page names (q.npy, m.npy, my_weights/, ...) are written to DIR
first; a command that names a file this script does not make fails, so a page
that starts needing a new file fails here until the file is added below.

Session ids are random, so the page writes SESSION for the id the last
`session create` printed (the first word of its output) and CHILD for the one
the last `session fork` printed; such an argument is replaced before the
command runs.

The sample outputs are checked against what attnctl prints: the attend sample
(the block starting "output shape") against the first attend command, the
bench text report against the first bench command without --json or
--rpc=step, the decode report (the block starting "bench step") against the
first bench --rpc=step command, and the ```json sample's keys against the
first bench --json line. In samples every
number (with a duration's unit) stands for any number; a line holding
"(only when" is skipped.

Exits 0 when every command and sample holds; otherwise prints each that does
not and exits 1.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np

# Fewer commands than this means the extraction broke, not that the page
# shrank: the page shows 31 today.
MIN_COMMANDS = 25
COMMAND_TIMEOUT_S = 60


def fenced_blocks(markdown):
    """(language, [lines]) for every ``` block of the page."""
    blocks, language, lines = [], None, None
    for line in markdown.splitlines():
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and lines is None:
            language, lines = fence.group(1), []
        elif fence:
            blocks.append((language, lines))
            lines = None
        elif lines is not None:
            lines.append(line)
    if lines is not None:
        sys.exit("FAIL: the page ends inside a ``` block")
    return blocks


def commands_of(lines):
    """The attnctl commands of a sh block: (argv after "attnctl", status)."""
    commands, pending = [], ""
    for line in lines:
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        text, pending = pending.strip(), ""
        if not text.startswith("attnctl "):
            continue
        argv = shlex.split(text, comments=True)[1:]
        comment = text.partition(" #")[2]
        status = re.search(r"\bexit (\d+)\b", comment)
        commands.append((argv, int(status.group(1)) if status else 0))
    return commands


def write_inputs(directory):
    """The files the page's commands read, in shapes that fit each other."""
    rng = np.random.default_rng(7)

    def uniform(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float32)

    # attend, bench, grid: B=2 (--key_lengths=5,7), H=4, Hkv=2, Lq=5, Lk=8.
    q, k, v = uniform(2, 4, 5, 6), uniform(2, 2, 8, 6), uniform(2, 2, 8, 6)
    for name, array in (("q", q), ("k", k), ("v", v)):
        np.save(f"{directory}/{name}.npy", array)
        bits = array.view(np.uint32).astype(np.uint64)
        np.save(f"{directory}/{name}_bf16.npy",
                ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))
    np.save(f"{directory}/m.npy", rng.uniform(0, 1, (5, 8)) < 0.8)
    # session step: H=8, Hkv=2, Dk=Dv=64; a 16-token prefill, then one token.
    for name, shape in (("sk", (2, 16, 64)), ("sv", (2, 16, 64)), ("sk1", (2, 1, 64)),
                        ("sv1", (2, 1, 64)), ("sq1", (8, 1, 64))):
        np.save(f"{directory}/{name}.npy", uniform(*shape))
    # mha: E = Ekv = 64, the built-in demo set's width; my_weights/ has H=2,
    # Dk=Dv=4 and is the folder layout the weights section documents.
    np.save(f"{directory}/x.npy", uniform(2, 3, 64))
    np.save(f"{directory}/y.npy", uniform(2, 6, 64))
    folder = f"{directory}/my_weights"
    os.makedirs(folder, exist_ok=True)
    for name, shape in (("w_q", (8, 64)), ("w_k", (8, 64)), ("w_v", (8, 64)),
                        ("w_o", (64, 8))):
        np.save(f"{folder}/{name}.npy", uniform(*shape) / 8)
    with open(f"{folder}/config.txt", "w") as config:
        config.write("num_heads=2\n")


NUMBER = r"-?[0-9][0-9.]*(?:e[+-]?[0-9]+)?(?:[a-z]+(?:[0-9.]+[a-z]+)*)?"


def line_pattern(sample_line):
    """A regex for a sample line: a number (not inside a word such as FLOAT32
    or p50), with any unit after it, matches any number."""
    pattern, at = "", 0
    for number in re.finditer(r"(?<![A-Za-z0-9_.])-?[0-9][0-9.]*[a-z]*", sample_line):
        pattern += re.escape(sample_line[at:number.start()]) + NUMBER
        at = number.end()
    return pattern + re.escape(sample_line[at:])


def check_sample(name, sample, output, failures):
    expected = [line.rstrip() for line in sample if "(only when" not in line]
    actual = output.splitlines()
    for index, line in enumerate(expected):
        got = actual[index] if index < len(actual) else "<nothing>"
        if not re.fullmatch(line_pattern(line), got):
            failures.append(f"{name} sample line {index + 1}: the page shows "
                            f"'{line}', attnctl printed '{got}'")
            return


def check_json_sample(sample, output, failures):
    try:
        documented = json.loads(" ".join(sample))
        printed = json.loads(output.splitlines()[0])
    except (ValueError, IndexError) as error:
        failures.append(f"bench --json sample: {error}: {output!r}")
        return
    if list(documented) != list(printed):
        failures.append(f"bench --json keys: the page shows {list(documented)}, "
                        f"attnctl printed {list(printed)}")
    for key, value in documented.items():
        if isinstance(value, dict) and value and list(value) != list(printed.get(key, {})):
            failures.append(f"bench --json {key}: the page shows {list(value)}, "
                            f"attnctl printed {list(printed.get(key, {}))}")


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--docs", "--attnctl", "--target", "--workdir"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()

    blocks = fenced_blocks(open(args.docs, encoding="utf-8").read())
    commands = [command for language, lines in blocks if language == "sh"
                for command in commands_of(lines)]
    if len(commands) < MIN_COMMANDS:
        sys.exit(f"FAIL: found {len(commands)} attnctl commands in {args.docs}, "
                 f"expected at least {MIN_COMMANDS}: the extraction is broken")
    write_inputs(args.workdir)

    failures, outputs, ids = [], [], {}
    for argv, status in commands:
        shown = "attnctl " + " ".join(argv)
        run = [args.attnctl, f"--target={args.target}"] + [
            ids.get(arg, arg) for arg in argv if not arg.startswith("--target=")]
        try:
            result = subprocess.run(run, cwd=args.workdir, capture_output=True, text=True,
                                    timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            failures.append(f"'{shown}' ran past {COMMAND_TIMEOUT_S} s")
            continue
        print(f"exit {result.returncode}: {shown}")
        if result.returncode != status:
            failures.append(f"'{shown}' exited {result.returncode}, the page documents "
                            f"{status}: {result.stderr.strip() or result.stdout.strip()}")
        outputs.append((argv, result.stdout))
        if argv[:2] in (["session", "create"], ["session", "fork"]) and result.stdout:
            ids["SESSION" if argv[1] == "create" else "CHILD"] = result.stdout.split()[0]

    def first_output(command, wanted):
        return next((out for argv, out in outputs if argv[:1] == [command] and wanted(argv)),
                    None)

    checks = {
        "attend": first_output("attend", lambda argv: True),
        "bench": first_output("bench", lambda argv: "--json" not in argv
                              and "--rpc=step" not in argv),
        "step": first_output("bench", lambda argv: "--rpc=step" in argv
                             and "--json" not in argv),
        "json": first_output("bench", lambda argv: "--json" in argv),
    }
    checked = set()
    for language, lines in blocks:
        if not lines:
            continue
        kind = ("json" if language == "json" else
                "attend" if language == "" and lines[0].startswith("output shape") else
                "step" if language == "" and lines[0].startswith("bench step ") else
                "bench" if language == "" and lines[0].startswith("bench ") else None)
        if kind is None:
            continue
        checked.add(kind)
        if checks[kind] is None:
            failures.append(f"no command on the page prints the {kind} sample")
        elif kind == "json":
            check_json_sample(lines, checks[kind], failures)
        else:
            check_sample(kind, lines, checks[kind], failures)
    for kind in sorted(set(checks) - checked):
        failures.append(f"the {kind} sample output is no longer on the page")

    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if failures:
        sys.exit(1)
    print(f"ok: {len(commands)} commands and {len(checked)} sample outputs of {args.docs}")


if __name__ == "__main__":
    main()
