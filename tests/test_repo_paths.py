"""No tracked text file holds an absolute path of the machine it was written on (a home or work
folder): commands and comments use repository-relative paths or placeholders (``$WORK``,
``$OUT``, ``<run dir>``), so they work on a fresh clone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
