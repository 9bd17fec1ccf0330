#!/usr/bin/env python3
"""Checks that RoundPipe's module graph points one way (docs/architecture.md, "Module graph").

    base <- scheduler, optim, comm <- amp <- runtime (roundpipe/) <- models <- launcher

1. Includes: a file of module M may include only project headers of M and of the modules below it
   (scheduler, optim and comm are siblings: none includes another). The umbrella header
   roundpipe/roundpipe.h may include every library module; tests, bench and examples anything.
2. Links: every roundpipe::X that a module's CMakeLists names in PUBLIC_DEPS / PRIVATE_DEPS must be
   below that module.
3. Public headers (installed: <module>/*.h, not detail/) may point to a `Note [Name]` only if an
   installed header defines it; otherwise they should point to docs/.
4. Build macros: a file that tests ROUNDPIPE_WITH_CUDA (or another macro of base/config.h) must
   include base/config.h, directly or through project headers. Otherwise `#if` reads the undefined
   macro as 0 and silently compiles the CUDA path out (it happened: the NCCL backend was missing
   from every CUDA build until a GPU run found it).
5. No arrow back up: a file under a module's detail/ folder never includes a facade header of its
   own module, directly or through other project headers. A module's facade headers are its public
   headers that are implemented by its detail/: those that include a header of the module's
   detail/, and those whose class keeps its state behind a pimpl (`struct Impl;` or
   `class Impl;`, defined in the .cpp over detail/), plus the umbrella roundpipe/roundpipe.h for
   the runtime. What detail/ needs from the facade (e.g. roundpipe::LossFn, layer_seed) belongs
   in a smaller public header that the facade includes (roundpipe/loss_fn.h, layer_seed.h).
Exit status 1 with one line per violation, naming the file, the line and the rule.
`--self-test` checks, on small trees written to a temporary folder, that each rule catches what it
should (CTest `module_graph_self_test`).
"""
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# module -> the modules it may use (itself included)
BELOW = {
    "base": {"base"},
    "scheduler": {"base", "scheduler"},
    "optim": {"base", "optim"},
    "comm": {"base", "comm"},
    "amp": {"base", "scheduler", "optim", "comm", "amp"},
    "runtime": {"base", "scheduler", "optim", "comm", "amp", "runtime"},
    "models": {"base", "scheduler", "optim", "comm", "amp", "runtime", "models"},
    "launcher": {"base", "scheduler", "optim", "comm", "amp", "runtime", "models", "launcher"},
}
# CMake target names (roundpipe::X) -> module
TARGETS = {"base": "base", "scheduler": "scheduler", "optim": "optim", "comm": "comm", "amp": "amp",
           "runtime": "runtime", "models": "models", "launcher_core": "launcher", "launcher": "launcher"}
UMBRELLA = "roundpipe/roundpipe.h"


def module_of(rel: str):
    """The module a project path (root-relative) belongs to, or None (tests, bench, ...)."""
    parts = rel.split("/")
    if parts[0] in ("base", "scheduler", "optim", "comm", "amp"):
        return parts[0]
    if parts[0] == "roundpipe":
        if len(parts) > 1 and parts[1] == "models":
            return "models"
        if len(parts) > 1 and parts[1] == "launcher":
            return "launcher"
        return "runtime"
    return None


INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
NOTE_REF = re.compile(r"Note \[([^\]]+)\]")
NOTE_DEF = re.compile(r"//\s*Note \[([^\]]+)\]:")


PIMPL = re.compile(r"^\s*(?:struct|class)\s+Impl\s*;", re.M)


def sources(root: pathlib.Path):
    for ext in ("*.h", "*.cpp", "*.cu"):
        for path in root.rglob(ext):
            rel = path.relative_to(root).as_posix()
            if rel.split("/")[0].startswith(("build", ".")):
                continue
            yield rel, path


def is_public_header(rel: str, mod: str) -> bool:
    """Installed headers: <module>/*.h, or roundpipe/{models,launcher}/*.h (not detail/)."""
    return rel.endswith(".h") and "/detail/" not in rel and rel.count("/") == (2 if mod in ("models", "launcher") else 1)


def facade_violations(texts: dict, includes: dict) -> list:
    """Rule 5: files under M/detail/ that reach a facade header of M (see the module docstring)."""
    facades = {UMBRELLA} if UMBRELLA in texts else set()
    for rel, text in texts.items():
        mod = module_of(rel)
        if mod is None or not is_public_header(rel, mod):
            continue
        own_detail = any("/detail/" in t and module_of(t) == mod for t in includes[rel])
        if own_detail or PIMPL.search(text):
            facades.add(rel)
    errors = []
    for rel in sorted(texts):
        mod = module_of(rel)
        if mod is None or "/detail/" not in rel:
            continue
        for lineno, line in enumerate(texts[rel].splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            # Breadth-first through public headers: the first facade of `mod` reached, and how. A
            # header of detail/ is not followed: it is checked (and reported) on its own.
            path = {m.group(1): [m.group(1)]}
            queue = [m.group(1)]
            while queue:
                cur = queue.pop(0)
                if cur in facades and module_of(cur) == mod:
                    via = " (through " + " -> ".join(path[cur][:-1]) + ")" if len(path[cur]) > 1 else ""
                    errors.append(f"{rel}:{lineno}: detail/ includes \"{cur}\"{via}, a facade header of module "
                                  f"'{mod}' (implemented by its detail/: no arrow back up); move what it needs "
                                  "into a smaller public header that the facade includes")
                    break
                if "/detail/" in cur:
                    continue
                for nxt in includes.get(cur, []):
                    if nxt not in path:
                        path[nxt] = path[cur] + [nxt]
                        queue.append(nxt)
    return errors


def check(root: pathlib.Path) -> list:
    errors = []
    public_headers = {}
    for rel, path in sources(root):
        mod = module_of(rel)
        if mod is None:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if is_public_header(rel, mod):
            public_headers[rel] = text
        allowed = set(BELOW) if rel == UMBRELLA else BELOW[mod]
        for lineno, line in enumerate(text.splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            target = m.group(1)
            target_mod = module_of(target)
            if target_mod is None:
                if target.startswith("tests/"):
                    errors.append(f"{rel}:{lineno}: includes test code \"{target}\"")
                continue
            if target_mod not in allowed:
                errors.append(f"{rel}:{lineno}: module '{mod}' includes \"{target}\" of module '{target_mod}', "
                              f"which is not below it (allowed: {', '.join(sorted(allowed - {mod}))})")
    # Links
    for cml in root.rglob("CMakeLists.txt"):
        rel = cml.relative_to(root).as_posix()
        mod = module_of(rel)
        if mod is None:
            continue
        text = cml.read_text()
        for call in re.finditer(r"roundpipe_add_module\((\w+)(.*?)\)", text, re.S):
            own = TARGETS.get(call.group(1), mod)
            for dep in re.findall(r"roundpipe::(\w+)", call.group(2)):
                dep_mod = TARGETS.get(dep)
                if dep_mod is None or dep_mod not in BELOW[own]:
                    errors.append(f"{rel}: roundpipe::{call.group(1)} links roundpipe::{dep}, which is not below it")
    # Notes named in installed headers must be installed too
    defined = set()
    for text in public_headers.values():
        defined.update(NOTE_DEF.findall(text))
    for rel, text in sorted(public_headers.items()):
        for lineno, line in enumerate(text.splitlines(), 1):
            for name in NOTE_REF.findall(line):
                if name not in defined:
                    errors.append(f"{rel}:{lineno}: public header points to Note [{name}], which no installed "
                                  "header defines (point to docs/ instead)")
    # Build macros need their header (rule 4)
    config_macros = set(re.findall(r"#\s*(?:define|cmakedefine01)\s+(ROUNDPIPE_\w+)",
                                   (root / "base" / "config.h.in").read_text()))
    includes = {}
    texts = {}
    for rel, path in sources(root):
        texts[rel] = path.read_text(encoding="utf-8", errors="replace")
        includes[rel] = [m.group(1) for m in map(INCLUDE.match, texts[rel].splitlines()) if m]

    def reaches_config(rel):
        seen, stack = set(), [rel]
        while stack:
            cur = stack.pop()
            if cur == "base/config.h":
                return True
            if cur in seen:
                continue
            seen.add(cur)
            stack.extend(t for t in includes.get(cur, []) if t == "base/config.h" or t in includes)
        return False

    for rel, text in sorted(texts.items()):
        for lineno, line in enumerate(text.splitlines(), 1):
            used = [m for m in config_macros if re.search(rf"#\s*(?:el)?if.*\b{m}\b|\b{m}\b\s*[=!)&|]", line)]
            if used and not line.lstrip().startswith(("//", "#define", "#cmakedefine")) and not reaches_config(rel):
                errors.append(f"{rel}:{lineno}: uses {used[0]} without including base/config.h (an undefined "
                              "macro reads as 0 in #if: the code it guards is silently compiled out)")
                break
    errors.extend(facade_violations(texts, includes))
    return errors


# --self-test: (files of a small tree, substrings the violations must contain; none: no violation).
_SELF_TEST_BASE = {"base/config.h.in": "#cmakedefine01 ROUNDPIPE_WITH_CUDA\n",
                   "roundpipe/run_config.h": "#pragma once\n",
                   "roundpipe/round_pipe.h": "#pragma once\n#include \"roundpipe/loss_fn.h\"\n"
                                             "class RoundPipe {\n  struct Impl;\n};\n",
                   "roundpipe/loss_fn.h": "#pragma once\n",
                   "roundpipe/roundpipe.h": "#pragma once\n#include \"roundpipe/round_pipe.h\"\n",
                   "roundpipe/detail/jobs.h": "#pragma once\n#include \"roundpipe/loss_fn.h\"\n"
                                              "#include \"roundpipe/run_config.h\"\n",
                   "roundpipe/round_pipe.cpp": "#include \"roundpipe/round_pipe.h\"\n"
                                               "#include \"roundpipe/detail/jobs.h\"\n",
                   "roundpipe/models/tokenizer.h": "#pragma once\n#include \"roundpipe/round_pipe.h\"\n",
                   "roundpipe/models/detail/bpe.h": "#pragma once\n#include \"roundpipe/round_pipe.h\"\n"}
_SELF_TEST_CASES = [
    ("clean tree (detail/ uses the small public header; a higher module's detail/ uses the facade)", {}, []),
    ("detail/ includes its facade",
     {"roundpipe/detail/jobs.h": "#pragma once\n#include \"roundpipe/round_pipe.h\"\n"},
     ["roundpipe/detail/jobs.h:2: detail/ includes \"roundpipe/round_pipe.h\", a facade header of module 'runtime'"]),
    ("detail/ includes the umbrella", {"roundpipe/detail/x.cpp": "#include \"roundpipe/roundpipe.h\"\n"},
     ["roundpipe/detail/x.cpp:1: detail/ includes \"roundpipe/roundpipe.h\""]),
    ("detail/ reaches its facade through a public header",
     {"roundpipe/run_config.h": "#pragma once\n#include \"roundpipe/round_pipe.h\"\n"},
     ["roundpipe/detail/jobs.h:3: detail/ includes \"roundpipe/round_pipe.h\" (through roundpipe/run_config.h)"]),
    ("reported once, where detail/ includes it", {"roundpipe/detail/jobs.h": "#pragma once\n#include \"roundpipe/round_pipe.h\"\n",
                                                   "roundpipe/detail/run.h": "#pragma once\n#include \"roundpipe/detail/jobs.h\"\n"},
     ["roundpipe/detail/jobs.h:2: detail/ includes \"roundpipe/round_pipe.h\""]),
    ("a public header that includes detail/ is a facade",
     {"roundpipe/models/chat.h": "#pragma once\n#include \"roundpipe/models/detail/jinja.h\"\n",
      "roundpipe/models/detail/jinja.h": "#pragma once\n",
      "roundpipe/models/detail/lexer.cpp": "#include \"roundpipe/models/chat.h\"\n"},
     ["roundpipe/models/detail/lexer.cpp:1: detail/ includes \"roundpipe/models/chat.h\", a facade header of "
      "module 'models'"]),
    ("rule 1: an include against the graph",
     {"scheduler/plan.h": "#pragma once\n#include \"roundpipe/run_config.h\"\n"},
     ["scheduler/plan.h:2: module 'scheduler' includes \"roundpipe/run_config.h\""]),
    ("rule 2: a link against the graph",
     {"scheduler/CMakeLists.txt": "roundpipe_add_module(scheduler SOURCES a.cpp PUBLIC_DEPS roundpipe::runtime)\n"},
     ["scheduler/CMakeLists.txt: roundpipe::scheduler links roundpipe::runtime"]),
    ("rule 3: an installed header names an internal Note",
     {"roundpipe/run_config.h": "#pragma once\n// See Note [Inside].\n",
      "roundpipe/detail/jobs.h": "#pragma once\n// Note [Inside]: why.\n"},
     ["roundpipe/run_config.h:2: public header points to Note [Inside]"]),
    ("rule 4: a config macro without base/config.h",
     {"roundpipe/detail/io.cpp": "#if ROUNDPIPE_WITH_CUDA\n#endif\n"},
     ["roundpipe/detail/io.cpp:1: uses ROUNDPIPE_WITH_CUDA without including base/config.h"]),
]


def self_test() -> int:
    failures = 0
    for name, overrides, expected in _SELF_TEST_CASES:
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            for rel, text in {**_SELF_TEST_BASE, **overrides}.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(text)
            errors = check(root)
        ok = len(errors) == len(expected) and all(any(want in e for e in errors) for want in expected)
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f": expected {expected}, got {errors}"))
    print(f"check_module_graph --self-test: {failures} failure(s) in {len(_SELF_TEST_CASES)} cases")
    return 1 if failures else 0


def main() -> int:
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    errors = check(ROOT)
    for e in errors:
        print(e)
    print(f"check_module_graph: {len(errors)} violation(s) in {sum(1 for _ in sources(ROOT))} files")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
