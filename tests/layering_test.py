#!/usr/bin/env python3
"""The direction of dependencies (docs/architecture.md, "What may depend on what").

    core  <-  proto  <-  { server, worker, client }

with nothing between server, worker and client, checked four ways:

  includes  every `#include "..."` of the project's own code, every spelling:
            a project header must be named from the repository root
            ("core/plan/types.h", never "plan/types.h" or "types.h"), and the
            folder it lives in must be one the includer may depend on;
            core/ includes no protobuf, gRPC, BLAS or CUDA header at all, and
            inside core/, base <- plan <- {optim, model};
  links     the link graph CMake holds (cmake/link_graph.cmake writes it at
            configure time): a target may link only targets of the folders
            its own folder may depend on, and the coordinator's and clients'
            targets link no OpenBLAS, NCCL, Gloo or CUDA;
  binaries  the built coordinator and muonmeshctl need no OpenBLAS, Gloo,
            CUDA or NCCL shared library (read from their ELF headers);
  namespaces every folder of sources is listed in NAMESPACES, and its files
            declare only its namespace (or one nested in it as `internal`):
            a program's folder and its parts share the program's namespace,
            a library has its own, named for its folder, used nowhere else.

    tests/layering_test.py ROOT [--link-graph FILE] [--binary PATH]...
    tests/layering_test.py --self-test

--self-test plants one forbidden edge of each kind in a scratch tree and
fails unless every one of them is reported.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

LAYERS = ("core", "proto", "server", "worker", "client")

# The folders each layer may depend on (itself included).
ALLOWED = {
    "core": {"core"},
    "proto": {"core", "proto"},
    "server": {"core", "proto", "server"},
    "worker": {"core", "proto", "worker"},
    "client": {"core", "proto", "client"},
}

# Inside core/: what each part may include of the others.
CORE_ALLOWED = {
    "base": {"base"},
    "plan": {"base", "plan"},
    "optim": {"base", "plan", "optim"},
    "model": {"base", "plan", "model"},
}

# The namespace of each folder of sources (docs/architecture.md, "Folders
# and namespaces"). The programs' own parts share the program's namespace
# (server/ -> coordinator, worker/ -> worker, client/ -> client); every
# library has one of its own, named for its folder. core/base is the root's
# vocabulary (Status macros, flags, addresses) with its text helpers apart.
NAMESPACES = {
    "core/base": {"muonmesh", "muonmesh::text"},
    "core/plan": {"muonmesh::plan"},
    "core/model": {"muonmesh::model"},
    "core/optim": {"muonmesh::optim"},
    "proto/convert": {"muonmesh::convert"},
    "proto/credentials": {"muonmesh::credentials"},
    "proto/http": {"muonmesh::http"},
    "proto/io": {"muonmesh::protoio"},
    "proto/job": {"muonmesh::job"},
    "proto/job/kinds": {"muonmesh::job::kinds", "muonmesh::job"},
    "proto/rpc": {"muonmesh::rpc"},
    "server": {"muonmesh::coordinator"},
    "server/control": {"muonmesh::coordinator"},
    "server/state": {"muonmesh::coordinator"},
    "server/auth": {"muonmesh::auth"},
    "worker": {"muonmesh::worker"},
    "worker/job": {"muonmesh::worker"},
    "worker/model": {"muonmesh::worker"},
    "worker/runtime": {"muonmesh::worker"},
    "worker/comm": {"muonmesh::comm"},
    "worker/cuda": {"muonmesh::cuda"},
    "worker/io": {"muonmesh::io"},
    "worker/math": {"muonmesh::math"},
    "client": {"muonmesh::client"},
}
NAMESPACE = re.compile(r"^\s*namespace\s+([A-Za-z_][\w:]*)\s*\{")

# Quoted includes that are not the project's own sources: third-party
# headers and what the build generates (the API stubs under muonmesh/v1,
# muonmesh/config.h).
EXTERNAL_PREFIXES = ("absl/", "gtest/", "gmock/", "benchmark/", "grpcpp/", "grpc/", "google/",
                     "prometheus/", "gloo/", "muonmesh/")

# What core/ must never include, quoted or angled: it stays plain C++ and
# Abseil.
CORE_FORBIDDEN = re.compile(
    r"^(google/protobuf|grpc|grpcpp|muonmesh/|cblas|openblas|cuda|cublas|nccl|gloo|prometheus|"
    r"sqlite3|yaml-cpp|re2|openssl)")

# Targets of the project that wrap libraries the coordinator must not link.
HEAVY_TARGETS = {"muonmesh_openblas", "muonmesh_nccl"}
HEAVY_LIBRARIES = re.compile(r"lib(openblas|blas|gloo|cudart|cublas|cublasLt|nccl|cuda)\b")

SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')


def layer_of(rel):
    top = rel.split("/", 1)[0]
    return top if top in LAYERS else None


def sources(root):
    for top in LAYERS + ("tests",):
        base = os.path.join(root, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(SOURCE_SUFFIXES):
                    path = os.path.join(dirpath, name)
                    yield os.path.relpath(path, root)


def check_include(root, rel, kind, target):
    """The problem with one include of file `rel`, or None."""
    layer = layer_of(rel)
    if layer == "core" and CORE_FORBIDDEN.match(target):
        return f"core/ includes {target} (core is plain C++ and Abseil)"
    if kind == "<":
        return None
    if target.startswith(EXTERNAL_PREFIXES):
        return None
    if not os.path.isfile(os.path.join(root, target)):
        here = os.path.join(root, os.path.dirname(rel), target)
        spelled = "relative to its own folder" if os.path.isfile(here) else "not from the root"
        return f'includes "{target}", {spelled}: name project headers from the repository root'
    to = layer_of(target)
    if to is None:
        if target.startswith("tests/") and rel.startswith("tests/"):
            return None
        return f'includes "{target}", outside {", ".join(LAYERS)}'
    if layer is None:  # tests may use any layer
        return None
    if to not in ALLOWED[layer]:
        return f"{layer}/ includes {to}/ ({target}): {layer} may depend on " + \
               ", ".join(sorted(ALLOWED[layer]))
    if layer == "core":
        part, to_part = rel.split("/")[1], target.split("/")[1]
        if to_part not in CORE_ALLOWED.get(part, {part}):
            return f"core/{part} includes core/{to_part} ({target})"
    return None


def check_includes(root):
    problems = []
    for rel in sources(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if m:
                    problem = check_include(root, rel, m.group(1), m.group(2))
                    if problem:
                        problems.append(f"{rel}:{number}: {problem}")
    return problems


# Namespaces of other projects a header may forward-declare into.
EXTERNAL_NAMESPACES = ("std", "google", "grpc", "re2", "absl", "prometheus", "gloo")


def namespace_problem(name, folder, allowed):
    """The problem with `namespace NAME {` in a file of `folder`, or None."""
    first = name.split("::")[0]
    if first in EXTERNAL_NAMESPACES:
        return None  # a forward declaration
    if first != "muonmesh":
        # nested: `internal`, `something_internal`, or a part named in full
        # in the folder's row (proto/job/kinds: `kinds` inside muonmesh::job)
        if name == "internal" or name.endswith("_internal"):
            return None
        if any(a.endswith("::" + name) for a in allowed):
            return None
        return f"namespace {name} nested without its full name (write namespace muonmesh::...)"
    base = name[:-len("::internal")] if name.endswith("::internal") else name
    if base in allowed:
        return None
    return f"namespace {name} in {folder}/, whose namespace is {' or '.join(sorted(allowed))}"


def check_namespaces(root):
    problems = []
    folders_of = {}
    for folder, names in NAMESPACES.items():
        for name in names:
            folders_of.setdefault(name, []).append(folder)
    for name, folders in sorted(folders_of.items()):
        top = min(folders, key=len)  # one library, or one program and its parts
        strays = [f for f in folders if f != top and not f.startswith(top + "/")]
        if strays:
            problems.append(f"NAMESPACES gives {name} to {top} and {', '.join(strays)}")
    for rel in sources(root):
        folder = os.path.dirname(rel)
        if layer_of(rel) is None:
            continue
        if folder not in NAMESPACES:
            problems.append(f"{rel}: folder {folder}/ has no namespace in NAMESPACES")
            continue
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                m = NAMESPACE.match(line)
                problem = m and namespace_problem(m.group(1), folder, NAMESPACES[folder])
                if problem:
                    problems.append(f"{rel}:{number}: {problem}")
    return problems


def check_link_graph(path):
    folder, deps = {}, {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 3:
                continue
            name, where, linked = parts
            folder[name] = where
            deps[name] = [d for d in linked.split(";") if d]
    problems = []
    for name, linked in sorted(deps.items()):
        layer = layer_of(folder[name])
        if layer is None:  # tests, the root's wrappers
            continue
        for dep in linked:
            dep_layer = layer_of(folder.get(dep, "."))
            if dep in HEAVY_TARGETS:
                if layer != "worker":
                    problems.append(f"{name} ({folder[name]}) links {dep}")
            elif dep_layer is not None and dep_layer not in ALLOWED[layer]:
                problems.append(f"{name} ({folder[name]}) links {dep} ({folder[dep]})")
    if not folder:
        problems.append(f"{path}: no targets (was it written by cmake/link_graph.cmake?)")
    return problems


def check_binary(path):
    try:
        out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return [f"{path}: cannot read its dynamic section ({e})"]
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    return [f"{path} needs {lib}" for lib in needed if HEAVY_LIBRARIES.search(lib)]


PLANTS = [
    # (file to write, its text, what must be reported)
    ("core/plan/planted.h", '#include "proto/job/job.h"\n', "core/ includes proto/"),
    ("core/base/planted.h", '#include "core/plan/types.h"\n', "core/base includes core/plan"),
    ("core/plan/planted2.h", "#include <cblas.h>\n", "core/ includes cblas.h"),
    ("proto/job/planted.h", '#include "server/control/fleet.h"\n', "proto/ includes server/"),
    ("proto/job/planted2.h", '#include "worker/model/mlp.h"\n', "proto/ includes worker/"),
    ("server/planted.h", '#include "worker/model/mlp.h"\n', "server/ includes worker/"),
    ("server/planted2.h", '#include "client/json_writer.h"\n', "server/ includes client/"),
    ("worker/planted.h", '#include "server/control/fleet.h"\n', "worker/ includes server/"),
    ("worker/planted2.h", '#include "client/json_writer.h"\n', "worker/ includes client/"),
    ("client/planted.h", '#include "server/control/fleet.h"\n', "client/ includes server/"),
    ("client/planted2.h", '#include "worker/model/mlp.h"\n', "client/ includes worker/"),
    ("worker/model/planted3.h", '#include "plan/types.h"\n', "not from the root"),
    ("worker/model/planted4.h", '#include "mlp.h"\n', "relative to its own folder"),
]

NAMESPACE_PLANTS = [
    ("core/optim/planted.h", "namespace muonmesh::math {\n}\n", "namespace muonmesh::math in core/optim/"),
    ("worker/io/planted.h", "namespace muonmesh::worker {\n}\n", "namespace muonmesh::worker in worker/io/"),
    ("client/planted.h", "namespace muonmesh {\n}\n", "namespace muonmesh in client/"),
    ("worker/newroom/planted.h", "namespace muonmesh::worker {\n}\n", "has no namespace"),
    ("server/planted.h", "namespace control {\n}\n", "nested without its full name"),
    ("proto/io/planted.h", "namespace muonmesh::worker {\n}\n",
     "namespace muonmesh::worker in proto/io/"),
]

LINK_PLANTS = [
    ("muonmesh_control\tserver/control\tmuonmesh_model\n", "links muonmesh_model"),
    ("muonmesh_plan\tcore/plan\tmuonmesh_proto\n", "links muonmesh_proto"),
    ("muonmesh_job\tproto/job\tmuonmesh_control\n", "links muonmesh_control"),
    ("muonmesh_cli\tclient\tmuonmesh_openblas\n", "links muonmesh_openblas"),
    ("muonmesh_standalone\tworker\tmuonmesh_cli\n", "links muonmesh_cli"),
]
LINK_TARGETS = ("muonmesh_model\tworker/model\t\nmuonmesh_proto\tproto\t\n"
                "muonmesh_control\tserver/control\t\nmuonmesh_openblas\t.\t\n"
                "muonmesh_cli\tclient\t\n")


def self_test():
    failures = []
    with tempfile.TemporaryDirectory() as root:
        for rel in ("proto/job/job.h", "server/control/fleet.h", "worker/model/mlp.h",
                    "client/json_writer.h", "core/plan/types.h"):
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            open(os.path.join(root, rel), "w").close()
        if check_includes(root):
            failures.append(f"a clean tree is reported: {check_includes(root)}")
        for plants, check in ((PLANTS, check_includes), (NAMESPACE_PLANTS, check_namespaces)):
            for rel, text, expected in plants:
                path = os.path.join(root, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
                found = [p for p in check(root) if expected in p]
                os.remove(path)
                if not found:
                    failures.append(
                        f"planted {rel} ({text.strip()}) was not reported as '{expected}'")
        graph = os.path.join(root, "link_graph.txt")
        for line, expected in LINK_PLANTS:
            with open(graph, "w") as f:
                f.write(LINK_TARGETS + line)
            if not any(expected in p for p in check_link_graph(graph)):
                failures.append(f"planted link {line.strip()} was not reported")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    if not failures:
        print(f"self-test: all {len(PLANTS)} planted includes, {len(NAMESPACE_PLANTS)} planted "
              f"namespaces and {len(LINK_PLANTS)} planted links reported")
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?")
    parser.add_argument("--link-graph")
    parser.add_argument("--binary", action="append", default=[])
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    if not args.root:
        parser.error("ROOT is required")
    problems = check_includes(args.root) + check_namespaces(args.root)
    if args.link_graph:
        problems += check_link_graph(args.link_graph)
    for binary in args.binary:
        problems += check_binary(binary)
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    if problems:
        return 1
    print("layering: includes and links point core <- proto <- {server, worker, client}, "
          "namespaces match folders; "
          f"{len(args.binary)} binaries need no BLAS, Gloo or CUDA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
