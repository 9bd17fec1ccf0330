#!/usr/bin/env python3
"""Checks RoundPipe's C++ style with the committed .clang-format and .clang-tidy (../shared/STYLE.md).

    check_style.py format                  every tracked C++ file not in scripts/format-exempt.txt
                                           must be clang-format clean (CTest style_format)
    check_style.py naming BUILD_DIR        clang-tidy's readability-identifier-naming (.clang-tidy) on
                                           the lean translation units of BUILD_DIR's
                                           compile_commands.json and the project headers they include
                                           (CTest style_naming)
    check_style.py naming BUILD_DIR FILE.. the same on the named .cpp files (any of them; a file that
                                           includes <torch/...> takes ~10 s of CPU)
    check_style.py fix FILE..              formats the files in place and drops them from the exempt list
    check_style.py --self-test             checks that both checks catch a violation (CTest style_self_test)

Formatting is a ratchet (issue 27 item 9): reformatting the ~215 hand-formatted files at once would
bury their history under whitespace, so files that were not clang-format clean when the check
arrived are listed in scripts/format-exempt.txt. New files must be clean; a file you edit leaves
the list with `check_style.py fix FILE` (in its own commit when the diff is large). The list may
only shrink: a listed file that is already clean is reported, so the list stays true.

Naming runs on the translation units built without the precompiled header (scheduler/, base/, the
optimizer kernels, the tokenizer and chat-template code: ~30 files, ~30 s of CPU), which is what a
test run can afford; the rules (.clang-tidy) are STYLE.md's: types CamelCase, functions and
variables snake_case, private members name_, constants kName. `naming BUILD_DIR FILE...` checks
any other file on demand (scripts/check_style.py strips the precompiled-header flags, which
clang cannot read from GCC).

Exit status 0 when clean, 1 with one line per violation, 2 when a tool is missing (the message
says which package installs it: scripts/setup.sh installs both).
"""
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXEMPT = ROOT / "scripts" / "format-exempt.txt"
CXX_SUFFIXES = (".cpp", ".h", ".cu", ".cuh")
# Library folders whose headers clang-tidy reports on (tests may use gtest's macro names freely).
LIBRARY_DIRS = ("base", "scheduler", "optim", "comm", "amp", "roundpipe")
CLANG_MAJOR = "14"  # Debian 12's; another major formats some constructs differently


def tool(name: str) -> str:
    for candidate in (f"{name}-{CLANG_MAJOR}", name):
        path = shutil.which(candidate)
        if path:
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            if f"version {CLANG_MAJOR}." in version:
                return path
    print(f"check_style.py: {name} {CLANG_MAJOR} not found; install Debian's {name} package "
          f"(scripts/setup.sh does)", file=sys.stderr)
    sys.exit(2)


def tracked_cxx_files(root: pathlib.Path):
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if f.endswith(CXX_SUFFIXES)]


def read_exempt(path: pathlib.Path):
    if not path.exists():
        return []
    return [l.strip() for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]


def is_clean(clang_format: str, root: pathlib.Path, rel: str) -> bool:
    r = subprocess.run([clang_format, "--dry-run", "-Werror", f"--style=file:{root / '.clang-format'}", rel],
                       cwd=root, capture_output=True, text=True)
    return r.returncode == 0


def check_format(root: pathlib.Path, exempt_path: pathlib.Path) -> list:
    clang_format = tool("clang-format")
    exempt = set(read_exempt(exempt_path))
    files = tracked_cxx_files(root)
    problems = []
    for rel in files:
        clean = is_clean(clang_format, root, rel)
        if rel in exempt and clean:
            problems.append(f"{rel}: clang-format clean but listed in {exempt_path.name}; "
                            f"remove the line (the list only shrinks)")
        elif rel not in exempt and not clean:
            problems.append(f"{rel}: not clang-format clean; run scripts/check_style.py fix {rel} "
                            f"(or clang-format -i {rel})")
    for rel in sorted(exempt - set(files)):
        problems.append(f"{exempt_path.name}: lists {rel}, which is not a tracked file; remove the line")
    return problems


def fix(root: pathlib.Path, exempt_path: pathlib.Path, rels: list) -> None:
    clang_format = tool("clang-format")
    rels = [str(pathlib.Path(r).resolve().relative_to(root)) if pathlib.Path(r).is_absolute() else r for r in rels]
    subprocess.run([clang_format, "-i", f"--style=file:{root / '.clang-format'}", *rels], cwd=root, check=True)
    keep = [l for l in exempt_path.read_text().splitlines() if l.strip() not in rels]
    exempt_path.write_text("\n".join(keep) + "\n")


def lean_units(build_dir: pathlib.Path, root: pathlib.Path) -> list:
    """Library translation units compiled without the precompiled header."""
    db = json.loads((build_dir / "compile_commands.json").read_text())
    units = []
    for entry in db:
        path = pathlib.Path(entry["file"])
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        if rel.parts[0] in LIBRARY_DIRS and "cmake_pch" not in entry["command"]:
            units.append(str(path))
    return sorted(set(units))


def check_naming(root: pathlib.Path, build_dir: pathlib.Path, files: list) -> list:
    clang_tidy = tool("clang-tidy")
    db_path = build_dir / "compile_commands.json"
    if not db_path.exists():
        print(f"check_style.py: {db_path} not found; configure the build first (scripts/build.sh)",
              file=sys.stderr)
        sys.exit(2)
    units = [str((root / f).resolve()) for f in files] if files else lean_units(build_dir, root)
    with tempfile.TemporaryDirectory() as tmp:
        # GCC's precompiled header is unreadable to clang: drop it (the TU includes what it uses).
        db = json.loads(db_path.read_text())
        for entry in db:
            entry["command"] = re.sub(r" -Winvalid-pch -include \S+cmake_pch\.hxx", "", entry["command"])
        (pathlib.Path(tmp) / "compile_commands.json").write_text(json.dumps(db))
        header_filter = "^" + re.escape(str(root)) + "/(" + "|".join(LIBRARY_DIRS) + ")/"
        r = subprocess.run([clang_tidy, "--quiet", f"--config-file={root / '.clang-tidy'}", "-p", tmp,
                            f"--header-filter={header_filter}", *units],
                           cwd=root, capture_output=True, text=True)
    problems = sorted({l for l in r.stdout.splitlines() if re.search(r": (error|warning): ", l)})
    if r.returncode != 0 and not problems:
        problems = [f"clang-tidy failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}"]
    return problems


def self_test() -> int:
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        t = pathlib.Path(tmp)
        shutil.copy(ROOT / ".clang-format", t / ".clang-format")
        shutil.copy(ROOT / ".clang-tidy", t / ".clang-tidy")
        subprocess.run(["git", "init", "-q"], cwd=t, check=True)
        (t / "base").mkdir()
        (t / "base" / "clean.h").write_text("#pragma once\n\nint clean_function(int value);\n")
        (t / "base" / "messy.h").write_text("#pragma once\nint   messy_function( int value ) ;\n")
        (t / "base" / "listed.h").write_text("#pragma once\n\nint listed_function(int value);\n")
        (t / "base" / "bad_names.cpp").write_text(
            "struct bad_struct {\n  int value;\n};\n\nint BadFunction(int value) { return value; }\n")
        exempt = t / "exempt.txt"
        exempt.write_text("base/listed.h\n")
        subprocess.run(["git", "add", "."], cwd=t, check=True)
        got = check_format(t, exempt)
        want = {"base/messy.h": "not clang-format clean", "base/listed.h": "clean but listed"}
        for rel, text in want.items():
            if not any(p.startswith(rel) and text in p for p in got):
                failures.append(f"format check missed {rel} ({text}); got {got}")
        if any(p.startswith("base/clean.h") for p in got):
            failures.append(f"format check flagged a clean file: {got}")
        build = t / "build"
        build.mkdir()
        (build / "compile_commands.json").write_text(json.dumps(
            [{"directory": str(t), "file": str(t / "base" / "bad_names.cpp"),
              "command": f"c++ -std=c++17 -c {t / 'base' / 'bad_names.cpp'}"}]))
        got = check_naming(t, build, [])
        for name in ("bad_struct", "BadFunction"):
            if not any(f"'{name}'" in p for p in got):
                failures.append(f"naming check missed {name}; got {got}")
    for f in failures:
        print(f"self-test: {f}")
    print("check_style.py self-test:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def main(argv: list) -> int:
    if argv[:1] == ["--self-test"]:
        return self_test()
    if argv[:1] == ["format"] and len(argv) == 1:
        problems = check_format(ROOT, EXEMPT)
    elif argv[:1] == ["naming"] and len(argv) >= 2:
        problems = check_naming(ROOT, pathlib.Path(argv[1]).resolve(), argv[2:])
    elif argv[:1] == ["fix"] and len(argv) >= 2:
        fix(ROOT, EXEMPT, argv[1:])
        return 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
