#!/usr/bin/env python3
"""No function of the project's own code (core/, server/, worker/, client/, proto/;
not tests, not generated code) is longer than 80 lines, except those listed
in EXCEPTIONS with the reason they are kept.

A function is found the simple way the code is formatted: a line at
namespace or class level that ends its parameter list with ") {" (or ")
const {", "override {") opens a body, which ends where the braces balance
again; comments and string literals are ignored when counting braces.

  tests/function_length_test.py ROOT
"""
import os
import re
import subprocess
import sys

LIMIT = 80

# (file, first line of the signature's text) -> why it stays long.
EXCEPTIONS: dict = {}

OPEN = re.compile(r"\)\s*(const)?\s*(override)?\s*(noexcept)?\s*(->\s*[\w:<>]+)?\s*\{\s*$")
CONTROL = re.compile(r"\s*(if|for|while|switch|else|do|catch)\b")


def functions(path):
    lines = open(path, encoding="utf-8").read().split("\n")
    depth, start, base, out = 0, None, 0, []
    for i, line in enumerate(lines):
        code = re.sub(r"//.*", "", line)
        code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
        code = re.sub(r"'(\\.|[^'\\])*'", "''", code)
        opened = start is None and OPEN.search(code) and not CONTROL.match(code) and \
            "=" not in code.split("(")[0]
        depth += code.count("{") - code.count("}")
        if opened and depth >= 1:
            start, base = i, depth - 1
            # The signature may start on an earlier line.
            first = i
            while first > 0 and lines[first - 1].strip() and \
                    not lines[first - 1].rstrip().endswith((";", "}", "{", ":")) and \
                    not lines[first - 1].lstrip().startswith(("//", "#")):
                first -= 1
            signature = lines[first].strip()
        elif start is not None and depth <= base:
            out.append((i - start + 1, start + 1, signature))
            start = None
    return out


def main():
    root = sys.argv[1]
    files = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard",
                            "core", "server", "worker", "client", "proto"],
                           capture_output=True, text=True, check=True).stdout.split()
    # Tracked and new files that exist (a file deleted in the work tree is gone).
    files = [f for f in files if f.endswith((".cc", ".h", ".cu")) and os.path.exists(f"{root}/{f}")]
    if not files:
        print(f"FAIL: no source files under {root}", file=sys.stderr)
        return 1
    long, seen = [], set()
    for f in files:
        for n, line, signature in functions(f"{root}/{f}"):
            if n <= LIMIT:
                continue
            key = next((k for k in EXCEPTIONS if k[0] == f and signature.startswith(k[1])), None)
            if key:
                seen.add(key)
            else:
                long.append(f"{f}:{line}: {n} lines: {signature}")
    status = 0
    if long:
        print(f"FAIL: functions over {LIMIT} lines (split them, or list them in "
              f"EXCEPTIONS with a reason):", file=sys.stderr)
        print("\n".join(long), file=sys.stderr)
        status = 1
    for key in EXCEPTIONS.keys() - seen:
        print(f"FAIL: exception no longer needed (remove it): {key[0]}: {key[1]}", file=sys.stderr)
        status = 1
    if status == 0:
        print(f"function length: {len(files)} files, none over {LIMIT} lines but the "
              f"{len(EXCEPTIONS)} listed exceptions")
    return status


if __name__ == "__main__":
    sys.exit(main())
