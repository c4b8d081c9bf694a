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
(:func:`save_failure`). :func:`verify` checks a folder against its ``metadata.json`` (every file
recorded with its size and SHA-256, no symbolic links, the step in its name the step it records:
``twell.hf.verify_checkpoint``) and :func:`latest_checkpoint` skips damaged ones. Lineage: every
checkpoint names the line of training it belongs to (``lineage.id``) and where that line branched
off (``lineage.parent``); rotation deletes only checkpoints of its own line whose names match
the steps they record. Source of the layout: OLMo-core's ``train/checkpoint.py`` habit.

Everything in a run dir is untrusted, names and links included: the files the trainer writes
there are opened without following a symbolic link (:func:`open_run_file`, :func:`write_atomic`),
the folders it writes into must be folders, not links (:func:`check_run_dir`), a ``step{N}``
entry no save made is refused rather than deleted (:func:`foreign_step_entry`), and YAML read
from it goes through :func:`load_yaml` (plain data only, a bad file named).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import stat
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from train.config import ConfigError
from twell import hf
from twell.hf import (
    checkpoint_root,
    folder_step,
    list_checkpoints,
    read_metadata,
    sha256_file,
    verify_checkpoint,
)

FORMAT_VERSION = 2
STATE_FORMAT = "twell-state"
# the state files of a checkpoint (besides the model): name -> what it holds, for messages
STATE_FILES = {"optimizer": "optimizer state", "scheduler": "lr schedule state",
               "trainer": "trainer state (step, tokens seen, sparsity tracker)"}


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


def _no_follow_error(path: Path, e: OSError | None = None, what: str = "") -> CheckpointError:
    what = what or ("a symbolic link" if path.is_symlink() else "not a regular file")
    return CheckpointError(
        f"{path} is {what}: twell writes only regular files in a run dir and never follows a link "
        f"there (it would write to wherever the link points); remove it (rm {shell_quote(path)}) "
        "or use a new hydra.run.dir")


def open_run_file(path: str | Path, mode: str = "a"):
    """Open a run-dir file for writing (``mode`` ``"a"`` append or ``"w"`` truncate, text)
    without following a symbolic link (``O_NOFOLLOW``) and only if it is a regular file (a FIFO
    or a device is refused without blocking), created if missing.

    Raises:
        CheckpointError: the path is a symbolic link, a hard link (another name shares its
            bytes) or not a regular file (one line: remove it or use a new run dir); a
            ConfigError, so ``twell-train`` exits 2.
        OSError: the write failed otherwise (a full disk, permissions).
    """
    path = Path(path)
    flags = {"a": os.O_APPEND, "w": os.O_TRUNC}[mode]
    flags |= os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags & ~os.O_TRUNC, 0o644)  # truncate only once it is known regular
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise _no_follow_error(path, e) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _no_follow_error(path)
        if st.st_nlink > 1:
            raise _no_follow_error(path, what=f"a hard link ({st.st_nlink} names share its bytes)")
        os.set_blocking(fd, True)
        if mode == "w":
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


# what is written (or deleted) in a run dir: the trainer's files, and the folders written into:
# checkpoints/ (entries renamed and deleted by rotation), .hydra/ (twell-train's record of the
# composed config) and wandb/ (wandb's run, logging.wandb_mode=online|offline)
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "train.log", "error.txt",
             "error.json", "wandb_id.txt", ".lock")
RUN_FOLDERS = ("checkpoints", ".hydra", "wandb")


def check_run_dir(run_dir: str | Path) -> None:
    """Refuse a run dir in which the trainer would write through a link or delete what is not
    its own: any of :data:`RUN_FILES` that is a symbolic link, a hard link or not a regular
    file (a FIFO, a device, a folder); any of :data:`RUN_FOLDERS` that is a link or not a
    folder; a link inside ``checkpoints/``; and a ``checkpoints/step{N}`` that no save made
    (:func:`foreign_step_entry`: a file, or a folder without ``metadata.json``; a save of that
    step would delete it). Called before anything is written (the lock included), so a refused
    run touches nothing.

    Raises:
        CheckpointError: one line naming the entry, where it points, and the way out.
    """
    run_dir = Path(run_dir)
    entries = [run_dir / n for n in RUN_FILES + RUN_FOLDERS]
    root = run_dir / "checkpoints"
    if root.is_dir() and not root.is_symlink():
        entries += sorted(root.iterdir())
    for p in entries:
        if p.is_symlink():
            raise _no_follow_error(p, what=f"a symbolic link (to {shell_quote(os.readlink(p))})")
        if p.name in RUN_FILES and p.exists() and not p.is_file():
            raise _no_follow_error(p)
        if p.name in RUN_FILES and p.is_file() and p.stat().st_nlink > 1:
            raise _no_follow_error(p, what=f"a hard link ({p.stat().st_nlink} names share its "
                                           "bytes, an append would change the others)")
        if p.parent == run_dir and p.name in RUN_FOLDERS and p.exists() and not p.is_dir():
            raise _no_follow_error(p, what="not a folder")
        if p.parent == root:
            foreign = foreign_step_entry(p)
            if foreign:
                raise CheckpointError(foreign)


def check_run_folder(path: str | Path) -> None:
    """Refuse a folder of a run dir (``.hydra/``, ``wandb/``) that is a symbolic link or not a
    folder, right before it is written into (:func:`check_run_dir` checks them at the start;
    this catches one made since).

    Raises:
        CheckpointError: one line naming it and the way out.
    """
    p = Path(path)
    if p.is_symlink():
        raise _no_follow_error(p, what=f"a symbolic link (to {shell_quote(os.readlink(p))})")
    if p.exists() and not p.is_dir():
        raise _no_follow_error(p, what="not a folder")


def foreign_step_entry(p: Path) -> str | None:
    """Why ``p``, an entry of ``checkpoints/`` named ``step{N}``, is not a checkpoint a save
    made (None: it is one, intact or damaged, or not such a name). A save writes
    ``.step{N}.tmp`` and renames it into place once its ``metadata.json`` is written, so a
    ``step{N}`` that is a file, or a folder without ``metadata.json``, was put there by someone
    else: saving that step would delete it, so it is refused instead (the user moves it)."""
    if folder_step(p) is None:
        return None
    if p.is_symlink() or not p.exists():
        return None  # a link is refused as one; a missing entry is nobody's
    if p.is_dir() and (p / hf.METADATA).exists():
        return None
    what = ("a folder without metadata.json" if p.is_dir()
            else "a file" if p.is_file() else "not a folder")
    return (f"{p} is {what}: not a checkpoint twell saved (a save renames a complete "
            f"folder with its metadata.json into place; this is someone's files or a copy cut "
            f"short), and saving step {folder_step(p)} would delete it; move it out of "
            f"{p.parent} (mv {shell_quote(p)} ...) or use a new hydra.run.dir")


def write_atomic(path: str | Path, text: str) -> None:
    """Replace a text file atomically: a temp file in the same folder, then ``os.replace``, so
    a reader (or a crash, or a full disk) never sees half a file. Neither file is followed if
    it is a symbolic link: the temp file is created anew (``O_EXCL | O_NOFOLLOW``) and the
    rename replaces a link at ``path`` itself, never its target.

    Raises:
        CheckpointError: ``path`` is a folder or another non-regular file (one line).
        OSError: the write failed (a full disk, permissions).
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise _no_follow_error(path, what="a folder")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a link or a stale temp file: removed, never written through
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def shell_quote(path) -> str:
    """``path`` as it can be pasted into a shell and shown on one line: unchanged when it holds
    only safe characters, else single-quoted (:func:`shlex.quote`), or as bash ``$'...'`` with
    escapes when it holds control characters (a newline in a folder name)."""
    import shlex

    text = str(path)
    if text.isprintable():
        return shlex.quote(text)
    out = "".join(c if c.isprintable() and c not in "\\'" else
                  {"\n": "\\n", "\t": "\\t", "\\": "\\\\", "'": "\\'"}.get(c, f"\\x{ord(c):02x}")
                  if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text)
    return f"$'{out}'"


def load_yaml(path: str | Path) -> dict:
    """A YAML file of a run dir or checkpoint (``config.yaml``, ``train_config.yaml``) as plain
    containers: OmegaConf's safe loader (no Python object is ever built from a tag), with every
    failure (a ``!!python/object`` tag, bad syntax, a link, not a mapping) one line naming it.

    Raises:
        CheckpointError: the file is missing, unreadable, not plain YAML or not a mapping.
    """
    from omegaconf import OmegaConf

    path = Path(path)
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symbolic link: a run dir's files are read only as "
                              "regular files; replace the link by the file or use another run")
    try:
        doc = OmegaConf.to_container(OmegaConf.load(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # noqa: BLE001  (yaml's and OmegaConf's errors: one line)
        first = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{path} is not plain YAML data ({type(e).__name__}: {first}); "
                              "it is damaged or was edited: restore it from the run's "
                              "config.yaml or use another checkpoint") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} holds no mapping of config groups (damaged)")
    return doc


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


def legacy_damage(path: Path, checksums: bool = False) -> str | None:
    """Why a previous-format ``.pt`` state file is damaged, or None when it looks whole: a
    ``torch.save`` zip archive must be complete (its central directory; ``checksums``: every
    member's CRC-32 too), any other file must start as a pickle does. Nothing is unpickled."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
        if head[:2] == b"PK":
            with zipfile.ZipFile(path) as z:
                bad = z.testzip() if checksums else None
            return f"{path.name}: member {bad} fails its CRC-32 check" if bad else None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"{path.name} is not a complete torch.save archive (truncated or damaged: {e})"
    if not head.startswith(b"\x80"):
        return f"{path.name} is not a torch.save file (it starts with {head!r})"
    return None


def _load_legacy(path: Path):
    import pickle

    ways = (f"Resume from a checkpoint this version wrote, or start from the weights alone: "
            f"model.init_from={shell_quote(path.parent)} in a new hydra.run.dir")
    damage = legacy_damage(path)
    if damage is not None:
        raise CheckpointError(f"{path}: refused to load: {damage}. {ways}")
    try:
        with torch.serialization.safe_globals(_legacy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        text = str(e)
        if isinstance(e, EOFError) or "Ran out of input" in text or "truncated" in text:
            raise CheckpointError(f"{path}: refused to load: the file is truncated or damaged "
                                  f"({type(e).__name__}). {ways}") from None
        named = re.search(r"GLOBAL ([\w.]+)", text)  # the function or class it would call
        other = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        why = (f"it names {named.group(1)}" if named else other.group(1)[:120] if other
               else (text.strip().splitlines() or [type(e).__name__])[0][:120])
        raise CheckpointError(
            f"{path}: refused to load: a previous-format state file that is not plain tensors and "
            f"data ({why}; loading it could run code). {ways}") from None


# ---------------------------------------------------------------- what a loaded state holds


def check_weights(state: dict, own: dict, where: str | Path, ways: str) -> None:
    """Refuse a checkpoint's weights (``state``: name -> tensor, from ``model.safetensors``) that
    do not fit the model (``own``: its state dict): a tensor that is not floating point (it
    would be cast silently), of another shape (``load_state_dict`` would raise a multi-line
    error), or holding NaN / inf (training and every score from it would be NaN).

    Raises:
        CheckpointError: one line naming the tensors, then ``ways`` (the ways out).
    """
    try:
        hf.check_weight_dtypes(where, {k: v.dtype for k, v in state.items()})
        shapes = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
                  if k in own and tuple(v.shape) != tuple(own[k].shape)]
        if shapes:
            hf.check_weight_names(where, [], [], tied=True, mismatched=shapes)
        hf.check_finite(state.items(), where)
    except hf.CheckpointError as e:
        raise CheckpointError(f"{str(e).rstrip('.')}; {ways}") from None


def check_optimizer_state(state: dict, params: list, where: str | Path, ways: str) -> None:
    """Refuse an optimizer state dict (torch's format: ``state`` by parameter index,
    ``param_groups``) that does not fit the optimizer's ``params`` (in param-group order): other
    parameter counts, a moment of another shape than its parameter, a non-float or non-finite
    tensor. torch's own ``load_state_dict`` checks only the counts (with a traceback) and would
    otherwise fail, or train on NaN, at the first step.

    Raises:
        CheckpointError: one line naming what does not fit, then ``ways``.
    """
    def refuse(why: str):
        raise CheckpointError(f"{where}: the optimizer state does not fit the model ({why}); "
                              f"{ways}")

    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) \
            or not isinstance(state.get("param_groups"), list):
        refuse("not a state dict with 'state' and 'param_groups'")
    counts = [len(g.get("params", ())) if isinstance(g, dict) else -1
              for g in state["param_groups"]]
    if sum(counts) != len(params):
        refuse(f"{sum(counts)} parameters in {len(counts)} groups, the model has {len(params)}")
    bad = []
    for i, moments in state["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(params) or not isinstance(moments, dict):
            refuse(f"an entry for parameter {i!r}")
        for name, t in moments.items():
            if not isinstance(t, torch.Tensor) or name == "step":
                continue
            if not t.is_floating_point():
                bad.append(f"parameter {i} {name}: stored as {str(t.dtype).replace('torch.', '')}")
            elif tuple(t.shape) != tuple(params[i].shape):
                bad.append(f"parameter {i} {name}: shape {tuple(t.shape)}, the parameter "
                           f"{tuple(params[i].shape)}")
            elif not bool(torch.isfinite(t).all()):
                bad.append(f"parameter {i} {name}: NaN or inf values")
    if bad:
        refuse("; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""))


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
    """Create an empty temp folder for ``step{step}`` (main process). Returns (tmp, final).

    Raises:
        CheckpointError: ``step{step}`` exists but is not a checkpoint a save made (a file, a
            folder without metadata.json: :func:`foreign_step_entry`) or is a symbolic link;
            nothing is written then (the finished steps stay in the previous checkpoint).
    """
    final = checkpoint_root(run_dir) / f"step{step}"
    if final.is_symlink():
        raise _no_follow_error(final, what=f"a symbolic link (to "
                                           f"{shell_quote(os.readlink(final))})")
    foreign = foreign_step_entry(final)
    if foreign:
        raise CheckpointError(foreign)
    tmp = tmp_path(final)
    _remove_own(tmp)
    tmp.mkdir(parents=True)
    return tmp, final


def _remove_own(p: Path) -> None:
    """Remove a leftover of an earlier save (``.step{N}.tmp`` / ``.old``: names only a save
    uses), whatever it is: a folder's tree, or a file or link itself (never its target)."""
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def file_records(folder: Path, checksums: bool = True) -> dict[str, dict]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` of every file under ``folder`` but
    ``metadata.json`` (files hashed in parallel threads; hashlib releases the GIL)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "metadata.json")
    with ThreadPoolExecutor(max_workers=min(4, len(files) or 1)) as pool:
        digests = list(pool.map(sha256_file, files)) if checksums else [None] * len(files)
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
        foreign = foreign_step_entry(final)  # made since begin(): not ours to delete
        if foreign:
            raise CheckpointError(foreign)
        old = final.parent / f".{final.name}.old"
        _remove_own(old)
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
    # a folder whose name is not the step it records (renamed or copied) is no checkpoint of
    # that step: it neither counts towards keep_last nor is deleted
    same = [c for c in list_checkpoints(final.parent.parent) if lineage_id(c) in (mine, None)
            and _recorded_step(c) == folder_step(c)]
    for stale in same[:-keep_last]:
        if stale != final:
            shutil.rmtree(stale)
    return final


def _recorded_step(ckpt: Path) -> int | None:
    try:
        return read_metadata(ckpt).get("step")
    except (OSError, ValueError):
        return None


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

# the files a checkpoint of the previous format (no file records) must hold, besides its state
LEGACY_FILES = ("config.json", "model.safetensors", "train_config.yaml")


def _state_present(ckpt: Path, name: str) -> bool:
    return (ckpt / f"{name}.json").is_file() or (ckpt / f"{name}.pt").is_file()


def verify(ckpt: str | Path, checksums: bool = True) -> list[str]:
    """What is wrong with a complete checkpoint folder (empty: intact).

    :func:`twell.hf.verify_checkpoint`: every file recorded in metadata.json, with its size and
    (``checksums``) SHA-256, no unrecorded file, no symbolic link, and the step in the folder's
    name the step metadata.json and the trainer state record. A previous-format checkpoint (no
    records) is checked for the model, config and each state file, each ``.pt`` state file for
    being a whole ``torch.save`` archive (``checksums``: its members' CRC-32 too; nothing is
    unpickled). Each problem is a short phrase naming the file, e.g. ``"model.safetensors has
    1024 bytes, metadata.json records 2048"``.
    """
    ckpt = Path(ckpt)
    problems = [_described(q) for q in
                verify_checkpoint(ckpt, checksums=checksums, legacy_files=LEGACY_FILES)]
    try:
        legacy = read_metadata(ckpt).get("files") is None
    except (OSError, ValueError):
        return problems
    if not legacy or any("metadata.json" in p for p in problems):
        return problems
    if any((ckpt / f"{n}.json").is_file() for n in STATE_FILES):  # this format, records gone
        why = ("metadata.json records no files, but its state files are of the current format, "
               "which records them (damaged)")
        return [*problems, why]
    for name, what in {**STATE_FILES, "rank0": "RNG state and data position"}.items():
        if not _state_present(ckpt, name):
            problems.append(f"{name}.pt ({what}) is missing")
        elif not (ckpt / f"{name}.json").is_file():
            damage = legacy_damage(ckpt / f"{name}.pt", checksums)
            if damage:
                problems.append(damage)
    return problems


# the tensor files a resume loads and checks (check_weights, check_optimizer_state)
RESUMED_TENSORS = ("model.safetensors", "optimizer.safetensors")


def tensor_problems(ckpt: str | Path, like: str | Path) -> list[str]:
    """What a resume would refuse in the tensors of ``ckpt`` (one that passes :func:`verify`),
    judged against ``like``, a checkpoint of the same run: its model and optimizer tensors
    (:data:`RESUMED_TENSORS`) with other names, shapes or dtypes than ``like``'s, or holding NaN
    / inf (as :meth:`train.trainer.Trainer.resume` refuses them while loading:
    :func:`check_weights`, :func:`check_optimizer_state`). Reads one tensor at a time. A file
    missing from either folder (a previous-format ``optimizer.pt``) is not compared.

    Returns:
        Short phrases naming the file and tensor (empty: the tensors would load).
    """
    from safetensors import SafetensorError, safe_open

    def header(f: Path) -> dict:
        with safe_open(str(f), "pt") as st:
            keys = list(st.keys())
            return {k: (str(st.get_slice(k).get_dtype()), tuple(st.get_slice(k).get_shape()))
                    for k in keys}

    ckpt, like = Path(ckpt), Path(like)
    problems = []
    for name in RESUMED_TENSORS:
        f, ref = ckpt / name, like / name
        if not (f.is_file() and ref.is_file()):
            continue
        try:
            have, want = header(f), header(ref)
            if have != want:
                diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
                problems.append(f"{name}: tensor {', '.join(diff[:3])} differs from "
                                f"{like.name}'s (name, shape or dtype)")
                continue
            with safe_open(str(f), "pt") as st:
                for k in list(st.keys()):
                    t = st.get_tensor(k)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        problems.append(f"{name}: tensor {k} holds NaN or inf values")
                        break
        except (SafetensorError, OSError) as e:
            problems.append(f"{name} is not a complete safetensors file ({e})")
    return problems


def _described(problem: str) -> str:
    """``"optimizer.json is missing"`` -> ``"optimizer.json (optimizer state) is missing"``."""
    name, sep, rest = problem.partition(" is missing")
    what = STATE_FILES.get(name.split(".")[0])
    return f"{name} ({what}){sep}{rest}" if sep and what and " " not in name else problem


def latest_checkpoint(run_dir: str | Path, *, checksums: bool = True, warn=None) -> Path:
    """The newest intact ``step{N}`` folder of ``run_dir`` (:func:`twell.hf.latest_checkpoint`
    with :func:`verify`: complete, every recorded file's size and, with ``checksums``, SHA-256,
    the step in its name the step it records). A damaged newer one is skipped with
    ``warn(line)`` naming it and its problem (default: no warning).

    Raises:
        FileNotFoundError: there is no complete checkpoint, or none is intact (says where it
            looked and what is wrong with each).
    """
    return hf.latest_checkpoint(run_dir, warn=warn, verify=lambda c: verify(c, checksums))
