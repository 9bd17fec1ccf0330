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
Exit status 1 with one line per violation, naming the file, the line and the rule.
"""
import pathlib
import re
import sys

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


def sources():
    for ext in ("*.h", "*.cpp", "*.cu"):
        for path in ROOT.rglob(ext):
            rel = path.relative_to(ROOT).as_posix()
            if rel.split("/")[0].startswith(("build", ".")):
                continue
            yield rel, path


def main() -> int:
    errors = []
    public_headers = {}
    for rel, path in sources():
        mod = module_of(rel)
        if mod is None:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if rel.endswith(".h") and "/detail/" not in rel and rel.count("/") == (2 if mod in ("models", "launcher") else 1):
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
    for cml in ROOT.rglob("CMakeLists.txt"):
        rel = cml.relative_to(ROOT).as_posix()
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
                                   (ROOT / "base" / "config.h.in").read_text()))
    includes = {}
    texts = {}
    for rel, path in sources():
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
    for e in errors:
        print(e)
    print(f"check_module_graph: {len(errors)} violation(s) in {sum(1 for _ in sources())} files")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
