#!/usr/bin/env python3
"""check_layers.py - kiln's layering rule, checked on the #include lines of src/.

Usage: check_layers.py [SRC_DIR] [--known FILE]
  SRC_DIR defaults to the src/ beside this script's tests/. --known names a
  list of "file: include" lines still waiting to be fixed: they are printed as
  known, not failed on (the list should be empty).

Every file under src/<layer>/ may include only headers of its own layer, of
the layers listed for it below, and the public headers (include/kiln.h,
include/kiln_nn.h). An include that points up or across the list is printed
as file:line with the rule it breaks, and the script exits 1. The layers
(docs/design.md, "Layers"):

  tools -> api, nn        nn -> (public headers only)
  dist -> backend, core (a library of its own beside libkiln; kiln_dist.h)
  api -> capture, runtime, backend, plan, graph, core
  capture -> runtime, graph, core
  runtime -> lower, codegen, backend, plan, graph, core
  lower -> plan, graph, core
  codegen -> lower's kernel IR header only, plan, graph, core
  backend -> plan, graph, core (backend/cpu and backend/cuda not each other)
  plan -> graph, core     graph -> core     core -> nothing of kiln
"""
import os
import re
import sys

ALLOWED = {
    "tools": {"api", "nn"},
    "nn": set(),
    "dist": {"backend", "core"},
    "api": {"capture", "runtime", "backend", "plan", "graph", "core"},
    "capture": {"runtime", "graph", "core"},
    "runtime": {"lower", "codegen", "backend", "plan", "graph", "core"},
    "lower": {"plan", "graph", "core"},
    "codegen": {"lower", "plan", "graph", "core"},
    "backend": {"plan", "graph", "core"},
    "plan": {"graph", "core"},
    "graph": {"core"},
    "core": set(),
}
# What codegen may see of lower: the kernel IR, nothing else.
CODEGEN_FROM_LOWER = {"lower/kernel_ir.h"}
PUBLIC = {"kiln.h", "kiln_nn.h", "kiln_dist.h"}
# Made by the build (CMakeLists.txt), named by the layer that includes it.
GENERATED = {"runtime": {"kiln_source_digest.h"}}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(rel):
    """src-relative path -> (layer, sublayer) e.g. backend/cuda/x.c -> (backend, cuda)"""
    parts = rel.split("/")
    sub = parts[1] if parts[0] == "backend" and len(parts) > 2 else None
    return parts[0], sub


def check(src):
    problems = []
    for root, _dirs, files in os.walk(src):
        for name in sorted(files):
            if not name.endswith((".c", ".h", ".def")):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            if "/" not in rel:
                problems.append(f"{rel}:1: a file outside every layer folder")
                continue
            layer, sub = layer_of(rel)
            if layer not in ALLOWED:
                problems.append(f"{rel}:1: folder src/{layer}/ is not a layer of the list")
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    inc = m.group(1)
                    why = judge(src, rel, layer, sub, inc)
                    if why:
                        problems.append(f"{rel}:{lineno}: #include \"{inc}\": {why}")
    return problems


def judge(src, rel, layer, sub, inc):
    if "/" not in inc:
        # beside the including file, a public header, or a generated one
        if os.path.exists(os.path.join(src, os.path.dirname(rel), inc)):
            return None
        if inc in PUBLIC:
            return None
        if inc in GENERATED.get(layer, set()):
            return None
        return "not beside the file, not a public header (name it by its layer: \"<layer>/<file>\")"
    if ".." in inc.split("/"):
        return "a relative path out of the folder (name it by its layer: \"<layer>/<file>\")"
    target, tsub = layer_of(inc)
    if target not in ALLOWED:
        return f"src/{target}/ is not a layer"
    if target == layer:
        if layer == "backend" and sub and tsub and sub != tsub:
            return f"backend/{sub} may not include backend/{tsub} (backends know nothing of each other)"
        return None
    allowed = ALLOWED[layer]
    if target not in allowed:
        may = ", ".join(sorted(allowed)) if allowed else "no other layer of kiln"
        return f"layer {layer} may not include {target} ({layer} may include: {may})"
    if layer == "codegen" and target == "lower" and inc not in CODEGEN_FROM_LOWER:
        return "codegen may include of lower only its kernel IR (" + ", ".join(sorted(CODEGEN_FROM_LOWER)) + ")"
    return None


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    args = sys.argv[1:]
    known = set()
    if "--known" in args:
        i = args.index("--known")
        with open(args[i + 1], encoding="utf-8") as f:
            known = {l.strip() for l in f if l.strip() and not l.startswith("#")}
        del args[i:i + 2]
    src = args[0] if args else os.path.join(here, "..", "src")
    if not os.path.isdir(src):
        print(f"check_layers: {src}: no such directory", file=sys.stderr)
        return 2
    problems = []
    for p in check(src):
        m = re.match(r'([^:]+):\d+: #include "([^"]+)"', p)
        if m and f"{m.group(1)}: {m.group(2)}" in known:
            print("known, not yet fixed: " + p)
        else:
            problems.append(p)
    for p in problems:
        print(p)
    if problems:
        print(f"check_layers: {len(problems)} include(s) break the layering (docs/design.md)")
        return 1
    print("check_layers: every #include of src/ points down the layer list")
    return 0


if __name__ == "__main__":
    sys.exit(main())
