"""No tracked text file holds an absolute path of the machine it was written on (a home or work
folder): commands and comments use repository-relative paths or placeholders (``$WORK``,
``$OUT``, ``<run dir>``), so they work on a fresh clone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(work|root|home)/")  # not ~/... or $X/...


def _tracked_text_files() -> list[Path]:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if r.returncode:
        pytest.skip("not a git checkout")
    out = []
    for name in r.stdout.decode().split("\0"):
        p = ROOT / name
        if not name or not p.is_file() or p.stat().st_size > 20_000_000:
            continue
        head = p.read_bytes()[:8192]
        if b"\0" in head:  # binary (PNG, gzip, ...)
            continue
        out.append(p)
    return out


def test_pattern_finds_machine_paths_and_only_them():
    w, r, h = "/work", "/root", "/home"  # split: this file is tracked too
    hits = [f"cd {w}/main && x", f"--out {r}/out", f"'{h}/u/.cache'", f"PY={w}/venv/bin/py"]
    misses = ["runs/x/checkpoints", "$WORK/evals", "~/.cache/twell", "https://x.org/home/a",
              "the work/ folder", "a/root/b"]
    assert all(MACHINE_PATH.search(s) for s in hits)
    assert not any(MACHINE_PATH.search(s) for s in misses)


def test_no_tracked_file_holds_a_machine_path():
    found = []
    for p in _tracked_text_files():
        text = p.read_text(errors="replace")
        for i, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not found, "absolute machine paths (use a relative path or $WORK/$OUT):\n" + \
        "\n".join(found[:30])


# Prose for the next reader: run letters (the letter naming a benchmark run), issue numbers of a
# tracker that is not in the repository, and the session notes file (cite the paper by section
# instead) stay out of code, configs and the README's first screen; BENCHMARKS.md, docs/ and test
# data keep the run history. The patterns are built from pieces: this file is tracked too.
HISTORY = re.compile(r"\b[Rr]uns? [A-Z][0-9]?\b|\b[Ii]ssue #?\d+|shared/" + "PAPER" + r"\.md")
CODE_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".ini"}
README_SCREEN = 40  # lines of README.md a reader sees first


def test_history_pattern_finds_run_letters_and_issue_numbers_only():
    r, i = "run", "issue"
    hits = [f"(BENCHMARKS.md, {r} K)", f"{r}s T, T2", f"{r.title()} R", f"({i} 16)",
            f"{i} #17", "see shared/" + "PAPER.md"]
    misses = ["the run directory", "runs A_torch and C_twell", f"{r} (B)", "a run of 300 steps",
              "tissue 3", f"{i}s to solve", "Run the tests"]
    assert all(HISTORY.search(s) for s in hits)
    assert not any(HISTORY.search(s) for s in misses)


def test_no_run_letters_or_issue_numbers_in_code_or_the_readme_screen():
    found = []
    for p in _tracked_text_files():
        rel = p.relative_to(ROOT)
        if rel.parts[0] == "docs" or "data" in rel.parts[:-1]:
            continue
        if rel.name == "README.md" and len(rel.parts) == 1:
            lines = p.read_text(errors="replace").splitlines()[:README_SCREEN]
        elif p.suffix in CODE_SUFFIXES:
            lines = p.read_text(errors="replace").splitlines()
        else:
            continue
        found += [f"{rel}:{n}: {line.strip()[:100]}" for n, line in enumerate(lines, 1)
                  if HISTORY.search(line)]
    assert not found, ("run letters / issue numbers / the notes file in code (history goes to "
                       "BENCHMARKS.md and commit messages; cite the paper by section):\n"
                       + "\n".join(found[:30]))


def test_layout_doc_names_every_script_and_study_module():
    # README.md: "every script is listed in docs/layout.md"; the studies' top-level modules too
    # (the modules of studies/bench/ and studies/kernel_bench/ are named by their folder)
    r = subprocess.run(["git", "ls-files", "scripts", "studies"], cwd=ROOT, capture_output=True,
                       text=True, check=False)
    if r.returncode:
        pytest.skip("not a git checkout")
    layout = (ROOT / "docs" / "layout.md").read_text()
    names = set()
    for name in r.stdout.split():
        parts = Path(name).parts
        if len(parts) > 2:  # a module of studies/<folder>/
            names.add(parts[1] + "/")
        elif parts[1] != "__init__.py":  # scripts/<file> or studies/<module>.py
            names.add(parts[1])
    assert "bench_model.py" in names and "bench/" in names
    missing = sorted(n for n in names if f"`{n}" not in layout and f"{n}`" not in layout)
    assert not missing, f"not named in docs/layout.md: {missing}"
