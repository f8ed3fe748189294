#!/usr/bin/env python3
"""Clang's thread-safety analysis over the code whose state absl::Mutex guards.

Every source file that annotates what its mutexes guard (ABSL_GUARDED_BY,
ABSL_EXCLUSIVE_LOCKS_REQUIRED, ABSL_LOCKS_EXCLUDED, ...), in itself or in its own header
(foo.cc beside foo.h), and everything under the control plane's folders (server/control,
server/state, server/auth), is checked: GCC ignores the annotations, so this check compiles
those files with clang++ -fsyntax-only -Wthread-safety -Werror, each with its flags from the
build's compile_commands.json, so that touching guarded state without its lock fails the test
suite. No annotated file is skipped: a file that annotates and is not in the build is reported.

  tests/thread_safety_check.py BUILD_DIR [CLANG++]
  tests/thread_safety_check.py --self-test BUILD_DIR [CLANG++]

Exit 0 when every file passes, 1 naming the files and clang's findings, 77 (skipped) when
clang++ is missing. --self-test compiles a planted read of guarded state without its lock and
fails unless clang reports it.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

FOLDERS = ("server/control/", "server/state/", "server/auth/")
LAYERS = ("core/", "proto/", "server/", "worker/", "client/")
ANNOTATIONS = re.compile(r"\bABSL_(GUARDED_BY|PT_GUARDED_BY|EXCLUSIVE_LOCKS_REQUIRED|"
                         r"SHARED_LOCKS_REQUIRED|LOCKS_EXCLUDED|ACQUIRED_AFTER|ACQUIRED_BEFORE)\b")


def annotated(path):
    """Whether `path` or its own header annotates guarded state."""
    for candidate in (path, os.path.splitext(path)[0] + ".h"):
        try:
            with open(candidate, errors="replace") as f:
                if ANNOTATIONS.search(f.read()):
                    return True
        except OSError:
            pass
    return False


def annotated_sources(root):
    """Every project .cc (tests aside) that annotation covers, relative to root."""
    out = set()
    for layer in LAYERS:
        for dirpath, _, names in os.walk(os.path.join(root, layer)):
            for name in names:
                if name.endswith(".cc"):
                    path = os.path.join(dirpath, name)
                    if annotated(path):
                        out.add(os.path.relpath(path, root))
    return out

PLANTED = """#include "absl/synchronization/mutex.h"
class Counter {
 public:
  int Read() { return value_; }  // no lock: clang must say so
 private:
  absl::Mutex mu_;
  int value_ ABSL_GUARDED_BY(mu_) = 0;
};
int main() { return Counter().Read(); }
"""


def clang_args(entry, clang):
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    out = [clang]
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD") or a.startswith("-O"):
            continue
        out.append(a)
    return out + ["-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
                  "-Wno-unknown-warning-option"]


def check(build, clang):
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = json.load(f)
    root = os.path.dirname(os.path.abspath(__file__)).rsplit("/tests", 1)[0] + "/"
    wanted = annotated_sources(root)
    chosen = [e for e in entries
              if e["file"].startswith(root)
              and (e["file"][len(root):].startswith(FOLDERS) or e["file"][len(root):] in wanted)
              and "/tests/" not in e["file"]]
    if not chosen:
        print("FAIL: no annotated source in compile_commands.json", file=sys.stderr)
        return 1
    built = {e["file"][len(root):] for e in chosen}
    missing = sorted(wanted - built)
    if missing:
        print("FAIL: annotated sources the build does not compile (so not checked): "
              + ", ".join(missing), file=sys.stderr)
        return 1
    failed = 0
    seen = set()
    for e in chosen:
        if e["file"] in seen:
            continue
        seen.add(e["file"])
        done = subprocess.run(clang_args(e, clang), cwd=e["directory"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            failed += 1
            print(f"FAIL: {e['file']}:\n{done.stderr}", file=sys.stderr)
    if failed:
        return 1
    print(f"thread safety: {len(seen)} files pass clang -Wthread-safety")
    return 0


def self_test(build, clang):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "planted.cc")
        with open(path, "w") as f:
            f.write(PLANTED)
        entry = {"command": f"c++ -std=c++20 -c {path}", "directory": d, "file": path}
        done = subprocess.run(clang_args(entry, clang) + [path], capture_output=True, text=True)
    if done.returncode != 0 and "requires holding mutex" in done.stderr:
        print("self-test: the planted unguarded read is reported")
        return 0
    print(f"FAIL: the planted unguarded read was not reported:\n{done.stderr}", file=sys.stderr)
    return 1


def main():
    argv = sys.argv[1:]
    planted = bool(argv) and argv[0] == "--self-test"
    if planted:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    build = argv[0]
    clang = argv[1] if len(argv) > 1 else (shutil.which("clang++") or "")
    if not clang or not shutil.which(clang):
        print("SKIP: clang++ is missing")
        return 77
    return self_test(build, clang) if planted else check(build, clang)


if __name__ == "__main__":
    sys.exit(main())
