"""Checkpoint folders: ``run_dir/checkpoints/step{N}/``, written atomically, verified on resume.

Layout of ``step{N}/``::

    config.json, model.safetensors      model weights (``save_pretrained``; loads into
                                        LlamaForCausalLM / ``twell.hf.load_model``)
    tokenizer files                     if the data module has a tokenizer
    optimizer.json + .safetensors       the optimizer's state dict (unsharded format, full
                                        tensors; FSDP gathers them on rank 0)
    scheduler.json                      the lr scheduler's state dict
    trainer.json + .safetensors         trainer state (step, tokens seen, sparsity tracker, ...)
    rank{r}.json + .safetensors         per rank: RNG states (python, numpy, torch, cuda) and the
                                        data position (datamodule.state_dict(): global, the same
                                        in every file; a streamed source's is per rank)
    train_config.yaml                   resolved run config
    metadata.json                       format version, step, world size (it may differ on
                                        resume), library versions, lineage, and the size and
                                        SHA-256 of every other file; written last: a folder
                                        without it is incomplete

State files hold no pickle: tensors go to safetensors, everything else to JSON (:func:`save_state`),
so loading a checkpoint never runs code from it. Checkpoints of the previous format
(``optimizer.pt``, ``scheduler.pt``, ``trainer.pt``, ``rank{r}.pt``) are read only through
``torch.load(weights_only=True)``, which refuses any pickle that names a function or class outside
tensors and plain containers (:func:`load_state`).

The folder is written as ``.step{N}.tmp`` and renamed into place, so a crash never leaves a
half-written ``step{N}``; a save that fails (a full disk) removes the temp folder
(:func:`save_failure`). :func:`verify` checks a folder against its ``metadata.json`` and
:func:`latest_checkpoint` skips damaged ones. Lineage: every checkpoint names the line of
training it belongs to (``lineage.id``) and where that line branched off (``lineage.parent``);
rotation deletes only checkpoints of its own line. Source of the layout: OLMo-core's
``train/checkpoint.py`` habit.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from train.config import ConfigError
from twell import hf
from twell.hf import checkpoint_root, list_checkpoints

FORMAT_VERSION = 2
STATE_FORMAT = "twell-state"
# the state files of a checkpoint (besides the model): name -> what it holds, for messages
STATE_FILES = {"optimizer": "optimizer state", "scheduler": "lr schedule state",
               "trainer": "trainer state (step, tokens seen, sparsity tracker)"}
_HASH_CHUNK = 1 << 24  # 16 MiB reads for SHA-256


class CheckpointError(hf.CheckpointError, ConfigError):
    """A training checkpoint cannot be written or read: the disk is full, a file is damaged or
    missing, or a state file holds something other than tensors and plain data. One line naming
    the file and the way out. A :class:`twell.hf.CheckpointError` (``except CheckpointError``
    catches a damaged model file and a damaged training state alike) and a
    :class:`train.config.ConfigError`, so ``twell-train`` reports it without a traceback and
    exits with code 2."""


# ---------------------------------------------------------------- state files (no pickle)

# tagged JSON values: a dict whose keys are exactly one of these sets
_TENSOR, _TUPLE, _ITEMS, _NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
_TAGS = ({_TENSOR}, {_TUPLE}, {_ITEMS}, {_NDARRAY, "dtype"})


def _encode(obj, tensors: dict, where: str):
    """``obj`` as JSON-able data; tensors go to ``tensors`` under their path (``where``)."""
    if isinstance(obj, torch.Tensor):
        name = where or "value"
        while name in tensors:
            name += "'"
        t = obj.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and any(u.numel() and ptr == u.untyped_storage().data_ptr()
                             for u in tensors.values()):
            t = t.clone()  # safetensors refuses tensors that share a storage
        tensors[name] = t
        return {_TENSOR: name}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"{where}: a numpy array of dtype {obj.dtype} cannot be stored")
        return {_NDARRAY: obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{where}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and set(obj) not in _TAGS:
            return {k: _encode(v, tensors, f"{where}.{k}" if where else k) for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, tensors, f"{where}.key"),
                          _encode(v, tensors, f"{where}.{k}" if where else str(k))]
                         for k, v in obj.items()]}
    raise TypeError(f"{where or 'value'}: a {type(obj).__name__} cannot be stored in a checkpoint "
                    "(tensors, numbers, strings, None, lists, tuples, dicts and numpy arrays can)")


def _decode(obj, tensors: dict, used: set):
    if isinstance(obj, list):
        return [_decode(v, tensors, used) for v in obj]
    if not isinstance(obj, dict):
        return obj
    keys = set(obj)
    if keys == {_TENSOR}:
        used.add(obj[_TENSOR])
        return tensors[obj[_TENSOR]]
    if keys == {_TUPLE}:
        return tuple(_decode(v, tensors, used) for v in obj[_TUPLE])
    if keys == {_ITEMS}:
        return {_decode(k, tensors, used): _decode(v, tensors, used) for k, v in obj[_ITEMS]}
    if keys == {_NDARRAY, "dtype"}:
        return np.asarray(obj[_NDARRAY], dtype=np.dtype(obj["dtype"]))
    return {k: _decode(v, tensors, used) for k, v in obj.items()}


def write_atomic(path: str | Path, text: str) -> None:
    """Replace a text file atomically: a temp file in the same folder, then ``os.replace``, so
    a reader (or a crash, or a full disk) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | Path, obj, **kw) -> None:
    """Write ``obj`` as JSON atomically (:func:`write_atomic`); ``kw`` go to ``json.dumps``."""
    write_atomic(path, json.dumps(obj, **kw))


def save_state(folder: str | Path, name: str, obj) -> None:
    """Write ``obj`` (a state dict: tensors, numbers, strings, None, lists, tuples, dicts with any
    keys, numpy arrays) as ``name.json`` plus, if it holds tensors, ``name.safetensors``. Tuples,
    non-string keys and numpy arrays are tagged in the JSON, so :func:`load_state` gives back
    equal containers of the same types (tensors on the CPU).

    Raises:
        TypeError: ``obj`` holds anything else (names where).
        OSError: the write failed (e.g. ``errno.ENOSPC``).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    value = _encode(obj, tensors, "")
    if tensors:
        save_file(tensors, str(folder / f"{name}.safetensors"))
    doc = {"format": STATE_FORMAT, "version": 1,
           "tensors": f"{name}.safetensors" if tensors else None, "value": value}
    (folder / f"{name}.json").write_text(json.dumps(doc))


def _legacy_globals() -> list:
    """What a previous-format ``rank{r}.pt`` needs beyond weights_only's defaults: numpy's RNG
    state (an uint32 array), i.e. the array rebuild function, ndarray and the dtype classes."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_state(folder: str | Path, name: str):
    """Read what :func:`save_state` wrote as ``name``; without code execution.

    A checkpoint of the previous format holds ``name.pt`` instead: it is read with
    ``torch.load(weights_only=True)`` (tensors, plain containers and numpy's RNG arrays only).

    Raises:
        CheckpointError: the file is missing, damaged, not a state file, or (``.pt``) holds a
            pickle that names anything else; one line naming the file.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    path = folder / f"{name}.json"
    if not path.is_file() and (folder / f"{name}.pt").is_file():
        return _load_legacy(folder / f"{name}.pt")
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is damaged ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or "value" not in doc:
        raise CheckpointError(f"{path} is not a twell state file (no \"format\": "
                              f"\"{STATE_FORMAT}\")")
    tensors = {}
    if doc.get("tensors"):
        tpath = folder / Path(doc["tensors"]).name
        try:
            tensors = load_file(str(tpath))
        except FileNotFoundError:
            raise CheckpointError(f"{tpath} is missing (named by {path})") from None
        except Exception as e:  # noqa: BLE001  (SafetensorError and OSError: one line)
            raise CheckpointError(f"{tpath} is damaged ({e})") from None
    used: set[str] = set()
    try:
        value = _decode(doc["value"], tensors, used)
    except KeyError as e:
        raise CheckpointError(f"{path} names tensor {e} that {doc.get('tensors')} lacks") from None
    if set(tensors) - used:
        raise CheckpointError(f"{doc['tensors']} holds tensors {sorted(set(tensors) - used)[:3]} "
                              f"that {path} does not name")
    return value


def _load_legacy(path: Path):
    import pickle

    try:
        with torch.serialization.safe_globals(_legacy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        text = str(e)
        named = re.search(r"GLOBAL ([\w.]+)", text)  # the function or class it would call
        other = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        why = (f"it names {named.group(1)}" if named else other.group(1)[:120] if other
               else (text.strip().splitlines() or [type(e).__name__])[0][:120])
        raise CheckpointError(
            f"{path}: refused to load: a previous-format state file that is not plain tensors and "
            f"data ({why}; loading it could run code). Resume from a checkpoint this version "
            f"wrote, or start from the weights alone: model.init_from={path.parent} in a new "
            "hydra.run.dir") from None


# ---------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Python, numpy, torch CPU and (if present) all CUDA RNG states of this process (tuples,
    a numpy array and byte tensors: what :func:`save_state` stores)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the python, numpy, torch (and CUDA, if saved and present) RNG states saved in a
    checkpoint's ``rank{r}`` state; raises KeyError if a CPU state is missing."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- writing


def tmp_path(final: Path) -> Path:
    """The temporary sibling (``.stepN.tmp``) a checkpoint is written to before the rename."""
    return final.parent / f".{final.name}.tmp"


def begin(run_dir: str | Path, step: int) -> tuple[Path, Path]:
    """Create an empty temp folder for ``step{step}`` (main process). Returns (tmp, final)."""
    final = checkpoint_root(run_dir) / f"step{step}"
    tmp = tmp_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp, final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_records(folder: Path, checksums: bool = True) -> dict[str, dict]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` of every file under ``folder`` but
    ``metadata.json`` (files hashed in parallel threads; hashlib releases the GIL)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "metadata.json")
    with ThreadPoolExecutor(max_workers=min(4, len(files) or 1)) as pool:
        digests = list(pool.map(_sha256, files)) if checksums else [None] * len(files)
    out = {}
    for p, d in zip(files, digests):
        out[p.relative_to(folder).as_posix()] = {"bytes": p.stat().st_size,
                                                 **({"sha256": d} if d else {})}
    return out


def new_lineage(parent: Path | None = None) -> dict:
    """A new line of training: a random id and the checkpoint it branched from (None for a run
    from scratch or ``model.init_from``)."""
    lin = {"id": os.urandom(6).hex(), "parent": None}
    if parent is not None:
        meta = read_metadata(parent)
        lin["parent"] = {"checkpoint": str(Path(parent).resolve()), "step": meta.get("step"),
                         "lineage": (meta.get("lineage") or {}).get("id")}
    return lin


def lineage_id(ckpt: Path) -> str | None:
    """The lineage id in a checkpoint's metadata.json (None: written before lineage existed or
    unreadable)."""
    try:
        return (read_metadata(ckpt).get("lineage") or {}).get("id")
    except (OSError, ValueError):
        return None


def finish(tmp: Path, final: Path, *, step: int, world_size: int, keep_last: int,
           lineage: dict | None = None, extra: dict | None = None) -> Path:
    """Record the files' sizes and SHA-256, write metadata.json, rename ``tmp`` to ``final`` and
    keep only the ``keep_last`` newest checkpoints of this lineage (and of none: checkpoints
    from before lineage existed); other lineages' checkpoints are never deleted.

    A previous ``final`` of the same step (e.g. rewritten after resume) is replaced: it is
    renamed aside, the new folder renamed in, then the old one removed; if the second rename
    fails the old folder is renamed back, so ``final`` is the old or the new checkpoint, whole.
    """
    import transformers

    import twell

    meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "twell": twell.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "lineage": lineage, **(extra or {}), "files": file_records(tmp)}
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
    if final.exists():
        old = final.parent / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        try:
            tmp.rename(final)
        except BaseException:
            old.rename(final)
            raise
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    mine = (lineage or {}).get("id")
    same = [c for c in list_checkpoints(final.parent.parent) if lineage_id(c) in (mine, None)]
    for stale in same[:-keep_last]:
        shutil.rmtree(stale)
    return final


def is_disk_full(e: BaseException) -> bool:
    """Whether an error of a write means the device (or the quota) is full: an OSError with
    ENOSPC / EDQUOT, or the same reported in the text of a library's error (safetensors)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return any(s in text for s in ("No space left on device", "os error 28", "StorageFull",
                                   "Disk quota exceeded", "os error 122"))


def save_failure(e: BaseException, tmp: Path, final: Path, *, previous: Path | None,
                 advice: str) -> BaseException:
    """Remove the partial temp folder of a failed save and return the error to raise: a
    one-line :class:`CheckpointError` for a full disk, else ``e`` itself."""
    shutil.rmtree(tmp, ignore_errors=True)
    if not is_disk_full(e):
        return e
    where = getattr(e, "filename", None) or tmp
    return CheckpointError(
        f"no space left on the device of {where} while writing checkpoint {final}: removed the "
        f"partial {tmp}; the previous checkpoint {previous or '(none)'} is intact. Free space "
        f"there, then {advice}")


# ---------------------------------------------------------------- reading and verifying


def read_metadata(ckpt: str | Path) -> dict:
    """The ``metadata.json`` of a checkpoint folder (format version, step, tokens seen, lineage,
    files); raises FileNotFoundError for an incomplete checkpoint, ValueError for a damaged one."""
    return json.loads((Path(ckpt) / "metadata.json").read_text())


def _state_present(ckpt: Path, name: str) -> bool:
    return (ckpt / f"{name}.json").is_file() or (ckpt / f"{name}.pt").is_file()


def verify(ckpt: str | Path, checksums: bool = True) -> list[str]:
    """What is wrong with a complete checkpoint folder (empty: intact).

    Checks every file recorded in metadata.json for its size and (``checksums``) SHA-256; a
    previous-format checkpoint (no record) only for the presence of the model and each state
    file. Each problem is a short phrase naming the file, e.g. ``"model.safetensors has 1024
    bytes, metadata.json records 2048"``.
    """
    ckpt = Path(ckpt)
    try:
        meta = read_metadata(ckpt)
    except FileNotFoundError:
        return ["metadata.json is missing (an incomplete save)"]
    except (OSError, ValueError) as e:
        return [f"metadata.json is damaged ({e})"]
    files = meta.get("files")
    if files is None:  # previous format: no sizes recorded
        need = ["config.json", "model.safetensors", "train_config.yaml"]
        problems = [f"{n} is missing" for n in need if not (ckpt / n).is_file()]
        problems += [f"{n}.pt ({what}) is missing" for n, what in STATE_FILES.items()
                     if not _state_present(ckpt, n)]
        if not _state_present(ckpt, "rank0"):
            problems.append("rank0.pt (RNG state and data position) is missing")
        return problems
    problems, todo = [], []
    for name, rec in files.items():
        p = ckpt / name
        if not p.is_file():
            what = STATE_FILES.get(name.split(".")[0])
            problems.append(f"{name}{f' ({what})' if what else ''} is missing")
        elif p.stat().st_size != rec.get("bytes"):
            problems.append(f"{name} has {p.stat().st_size} bytes, metadata.json records "
                            f"{rec.get('bytes')}")
        elif checksums and rec.get("sha256"):
            todo.append((name, p, rec["sha256"]))
    if todo:
        with ThreadPoolExecutor(max_workers=min(4, len(todo))) as pool:
            for (name, _, want), got in zip(todo, pool.map(_sha256, [p for _, p, _ in todo])):
                if got != want:
                    problems.append(f"{name} fails its SHA-256 check")
    return problems


def latest_checkpoint(run_dir: str | Path, *, checksums: bool = False, warn=None) -> Path:
    """The newest intact ``step{N}`` folder of ``run_dir``: complete (metadata.json) and passing
    :func:`verify` (sizes; ``checksums``: also SHA-256). A damaged newer one is skipped with
    ``warn(line)`` naming it and its problem (default: no warning).

    Raises:
        FileNotFoundError: there is no complete checkpoint, or none is intact (says where it
            looked and what is wrong with each).
    """
    found = list_checkpoints(run_dir)
    damaged = []
    for ckpt in reversed(found):
        problems = verify(ckpt, checksums=checksums)
        if not problems:
            return ckpt
        damaged.append(f"{ckpt.name}: {'; '.join(problems[:2])}")
        if warn is not None:
            warn(f"warning: skipping damaged checkpoint {ckpt} ({'; '.join(problems[:2])})")
    if damaged:
        raise FileNotFoundError(f"no intact checkpoint under {checkpoint_root(run_dir)} "
                                f"({', '.join(damaged[:3])})")
    raise FileNotFoundError(
        f"no complete checkpoint (step{{N}}/metadata.json) under {checkpoint_root(run_dir)}")
