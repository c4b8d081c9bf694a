"""twell models in the Hugging Face format: loading a checkpoint folder with SparseGatedMLP FFNs
and finding a run's checkpoint folders. Used by ``train`` (which writes the folders) and
``evals`` (which scores them), so neither imports the other for it.

A checkpoint is a ``save_pretrained`` folder (``config.json`` + safetensors) of transformers'
``LlamaForCausalLM`` with ``hidden_act="relu"``. A gated model loads into stock
``LlamaForCausalLM`` with identical logits; the non-gated variant (``relu(x Wu^T)``, no
``gate_proj``; ``config.json`` has ``twell_gated: false``) has no stock form and needs
:func:`load_model`. A training run keeps them as ``<run_dir>/checkpoints/step{N}/``, complete
once ``metadata.json`` is written (``train.checkpoint`` writes them atomically).

Loading is strict (:func:`from_pretrained_strict`, used by every loader of the project): a
truncated ``config.json``, safetensors or GGUF file is named, a missing or unexpected tensor is
an error naming it, never a randomly initialised weight, a weight stored as an integer tensor
or holding NaN / inf is refused naming it (:func:`check_weight_dtypes`, :func:`check_finite`),
and no code from a checkpoint runs: every transformers load passes ``trust_remote_code=False``
and a folder whose ``config.json`` or ``tokenizer_config.json`` asks for custom code
(``auto_map``) is refused in one line (:func:`refuse_remote_code`).

Everything a run folder holds is untrusted, its names included: :func:`verify_checkpoint` checks
a ``step{N}`` folder against its ``metadata.json`` (every file recorded, sizes and SHA-256, no
symbolic links, the step in the folder's name the step it records), and
:func:`latest_checkpoint`, the one picker of "the newest checkpoint" (resume, ``twell-eval
checkpoint=<run dir>``, reports), returns the newest folder that passes it.

transformers is imported inside the functions: ``import twell`` stays light.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch import nn

from twell.nn import SparseGatedMLP, convert_mlps
from twell.nn.plan import FFN_IMPLS

GATED_KEY = "twell_gated"  # extra LlamaConfig attribute saved in config.json
_STEP_RE = re.compile(r"^step(\d+)$")
_HASH_CHUNK = 1 << 24  # 16 MiB reads for SHA-256
METADATA = "metadata.json"
# the files a checkpoint of the previous format (no file records in metadata.json) must hold to
# be loaded as a model (the trainer asks for its state files too)
MODEL_FILES = ("config.json", "model.safetensors")
# files transformers reads whose "auto_map" names Python code to import from the folder
CODE_CONFIGS = ("config.json", "tokenizer_config.json")


def ffn_modules(model: nn.Module) -> list[SparseGatedMLP]:
    """The model's SparseGatedMLP modules in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseGatedMLP)]


def install_ffns(model: nn.Module, gated: bool, impl: str, policy=None) -> list[SparseGatedMLP]:
    """Swap every decoder layer's LlamaMLP of ``model`` (a ``LlamaForCausalLM``) for a
    :class:`twell.nn.SparseGatedMLP` that shares its weights (gated), or, non-gated, one built
    from its ``up_proj`` / ``down_proj`` (no ``gate_proj``). Returns the new FFN modules."""
    if gated:
        convert_mlps(model, impl, policy=policy)
    else:
        for layer in model.model.layers:
            old = layer.mlp
            new = SparseGatedMLP(old.up_proj.in_features, old.up_proj.out_features,
                                 gated=False, impl=impl, policy=policy)
            new.to(device=old.up_proj.weight.device, dtype=old.up_proj.weight.dtype)
            new.up_proj.weight = old.up_proj.weight
            new.down_proj.weight = old.down_proj.weight
            layer.mlp = new
    return ffn_modules(model)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: a truncated or unreadable ``config.json``,
    safetensors or GGUF file, or weights that do not match the model (missing or unexpected
    tensors). The message is one line naming the file or the tensors and the fix."""


def read_config_json(d: str | Path) -> dict:
    """The parsed ``config.json`` of a checkpoint folder.

    Raises:
        FileNotFoundError: no ``config.json`` in ``d``.
        CheckpointError: it is not valid JSON (truncated or damaged; names the file).
    """
    f = Path(d) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{d}: no config.json; pass a step{{N}} checkpoint folder")
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}): the file is truncated or damaged; "
                              "copy the checkpoint folder again.") from None


def refuse_remote_code(d: str | Path) -> None:
    """Refuse a folder whose ``config.json`` or ``tokenizer_config.json`` asks transformers for
    custom code (an ``auto_map`` entry naming Python classes in the folder): twell never runs code
    from a checkpoint, and transformers would otherwise prompt (or, told yes, import the file).

    Raises:
        CheckpointError: one line naming the file, what it asks for and the way out.
    """
    d = Path(d)
    if not d.is_dir():
        return
    for name in CODE_CONFIGS:
        f = d / name
        if not f.is_file():
            continue
        try:
            doc = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{f} is not valid JSON ({e}): the file is truncated or "
                                  "damaged; copy the checkpoint folder again.") from None
        auto = doc.get("auto_map") if isinstance(doc, dict) else None
        if auto:
            names = sorted(auto) if isinstance(auto, dict) else [str(auto)]
            raise CheckpointError(
                f"{f} asks for custom code (auto_map: {', '.join(map(str, names))[:120]}): twell "
                "runs no code from a checkpoint (trust_remote_code=False); use a checkpoint of a "
                "stock Llama model, or delete the auto_map entry if the stock classes fit it.")


def auto_config(path: str | Path, **kw):
    """``transformers.AutoConfig.from_pretrained`` with ``trust_remote_code=False``, after
    :func:`refuse_remote_code` (``kw``, e.g. ``gguf_file``, are passed on).

    Raises:
        CheckpointError: the folder asks for custom code.
    """
    from transformers import AutoConfig

    refuse_remote_code(path)
    return AutoConfig.from_pretrained(str(path), **kw, trust_remote_code=False)


def auto_tokenizer(path: str | Path, **kw):
    """``transformers.AutoTokenizer.from_pretrained`` with ``trust_remote_code=False``, after
    :func:`refuse_remote_code` for a local folder (``kw``, e.g. ``gguf_file``, are passed on).

    Raises:
        CheckpointError: the folder asks for custom code.
    """
    from transformers import AutoTokenizer

    refuse_remote_code(path)
    return AutoTokenizer.from_pretrained(str(path), **kw, trust_remote_code=False)


# files of a saved transformers tokenizer (save_pretrained), any one of which AutoTokenizer reads
# the files that hold a vocabulary: a folder with only tokenizer_config.json passed an earlier
# form of this test and failed later ("Couldn't instantiate the backend tokenizer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

def has_tokenizer(d: str | Path) -> bool:
    """Whether folder ``d`` holds a saved tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any((Path(d) / n).is_file() for n in TOKENIZER_FILES)


def check_tokenizer_source(value: str | Path, key: str) -> str:
    """The tokenizer a config field ``key`` names (``tokenizer=`` of twell-eval,
    ``data.tokenizer`` of twell-train), checked before any model or data loads: a local folder
    must exist and hold a saved tokenizer (:data:`TOKENIZER_FILES`); ``~`` is expanded. A value
    that is no folder here is refused, a hub id's form (``name``, ``namespace/name``) too:
    nothing is fetched from a hub at run time, and transformers read a missing folder as a
    hub id, failing after the model had loaded ("Repo id must be in the form ...") or, for a
    relative name like ``tok``, after ~50 s of retries without a network.

    Returns:
        The folder, ``~`` expanded.

    Raises:
        ValueError: one line naming ``key=value``, what is wrong and the fix.
    """
    value = str(value)
    p = Path(value).expanduser()
    fix = "give the folder a tokenizer was saved to (save_pretrained: tokenizer.json, ...)"
    if p.is_dir():
        if not has_tokenizer(p):
            raise ValueError(f"{key}={value}: {p} holds no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}); {fix}")
        return str(p)
    if p.exists():
        where = f"the folder that holds it ({key}={p.parent})" if has_tokenizer(p.parent) else (
            "the folder a tokenizer was saved to")
        raise ValueError(f"{key}={value}: is a file, not a folder; give {where}")
    raise ValueError(f"{key}={value}: no such folder (nothing is read from a hub); {fix}")


def safetensors_files(d: str | Path) -> list[Path]:
    """The weight files of a checkpoint folder: those ``model.safetensors.index.json`` maps, or
    ``model.safetensors``; every one a plain file name inside ``d``.

    The index is untrusted like the rest of a run folder: a name in its ``weight_map`` with a
    path separator, ``..`` or an absolute path would make every loader (transformers joins the
    names to the folder) read weights from elsewhere, covered by no hash in ``metadata.json``;
    a weight file (or the index) that is a symbolic link would do the same. Each is refused
    (:func:`confined_name`), before any weight is read.

    Raises:
        CheckpointError: the index is not valid JSON, names a file outside the folder, or the
            index or a weight file is a symbolic link (one line naming it and the way out).
    """
    d = Path(d)
    index = d / "model.safetensors.index.json"
    if index.is_symlink():
        raise CheckpointError(f"{index} is a symbolic link: a checkpoint's files are read only "
                              "as regular files of its folder; copy the file in place of the link "
                              "or use an intact checkpoint.")
    if not index.is_file():
        return [confined_name(d, "model.safetensors", index)]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index ({e}): the file is "
                              "truncated or damaged; copy the checkpoint folder again.") from None
    return [confined_name(d, n, index) for n in names]


def confined_name(d: Path, name, index: Path) -> Path:
    """``d / name`` for a weight file ``name`` that ``index`` names: a plain file name (no path
    separator, not ``.`` / ``..``, not absolute) whose entry in ``d`` is no symbolic link.

    Raises:
        CheckpointError: one line naming the index, the name and the way out.
    """
    shown = repr(name) if isinstance(name, str) else f"a {type(name).__name__}"
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name \
            or "\\" in name or "\0" in name or Path(name).is_absolute():
        raise CheckpointError(
            f"{index} names the weight file {shown}, which is not a plain file name inside "
            f"{d}: a checkpoint's weights are read only from its own folder; the index is "
            "damaged or was edited: use an intact checkpoint.")
    f = d / name
    if f.is_symlink():
        raise CheckpointError(
            f"{f} is a symbolic link (to {os.readlink(f)!r}): a checkpoint's weights are read only "
            "from regular files of its own folder; copy the file in place of the link (cp -L) "
            "or use an intact checkpoint.")
    return f


def tensor_names(d: str | Path) -> set[str]:
    """Names of the tensors stored in a checkpoint folder's safetensors files (headers only).

    safetensors checks that each header is complete and that the file covers every tensor it
    lists, so a truncated file is found here, before any weight is read. Every tensor must be
    stored as a floating-point dtype (:func:`check_weight_dtypes`): an integer weight would be
    cast to float silently by transformers.

    Raises:
        CheckpointError: a weight file is missing, truncated or not safetensors, or a tensor is
            not floating point (names it).
    """
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for f in safetensors_files(d):
        if not f.is_file():
            raise CheckpointError(f"{f}: no such weight file; a checkpoint folder holds "
                                  "config.json and model.safetensors (save_pretrained).")
        try:
            with safe_open(str(f), "pt") as st:
                keys = list(st.keys())
                dtypes = {k: st.get_slice(k).get_dtype() for k in keys}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f} is not a complete safetensors file ({e}): the file is "
                                  "truncated or damaged; copy the checkpoint again.") from None
        check_weight_dtypes(f, dtypes)
        names.update(keys)
    return names


# safetensors' dtype names of floating-point tensors (header strings)
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}
_ST_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
             "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64"}  # as torch names


def check_weight_dtypes(where: str | Path, dtypes: dict) -> None:
    """Refuse weights that are not floating point: ``dtypes`` maps a tensor name to its
    safetensors header dtype (``"F32"``, ``"I32"``, ...) or a ``torch.dtype``. Loaders cast a
    checkpoint's tensors to the model's dtype without a word, so an ``int32`` weight (a damaged
    or foreign file) would become a float weight of other values.

    Raises:
        CheckpointError: one line naming the first such tensors and their dtype.
    """
    import torch

    bad = sorted(f"{k} ({_ST_NAMES.get(str(v), str(v).replace('torch.', ''))})"
                 for k, v in dtypes.items() if not (v.is_floating_point if isinstance(v, torch.dtype)
                                                    else str(v) in _FLOAT_DTYPES))
    if bad:
        raise CheckpointError(f"{where}: tensor {_names(bad, 3)} is not stored as a floating-point "
                              "number; a weight must be float32 / bfloat16 / float16: the file is "
                              "damaged or not a model checkpoint; use an intact checkpoint.")


def check_finite(named_tensors, where: str | Path) -> None:
    """Refuse weights holding NaN or inf: ``named_tensors`` yields ``(name, tensor)`` (e.g.
    ``model.named_parameters()`` or a state dict's ``items()``). One NaN weight makes every logit
    NaN, and a NaN scores as nothing at all, so such a checkpoint is named, never trained on or
    scored.

    Raises:
        CheckpointError: one line naming the first tensors with NaN / inf and how many values.
    """
    import torch

    bad = []
    for name, t in named_tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            finite = torch.isfinite(t.detach())
            if not bool(finite.all()):
                bad.append(f"{name} ({int((~finite).sum())} of {t.numel()})")
    if bad:
        raise CheckpointError(
            f"{where}: tensor {_names(bad, 3)} holds NaN or inf values: the checkpoint diverged "
            "or is damaged, and every result from it would be NaN; use an earlier intact "
            "checkpoint.")


def check_gguf(path: str | Path) -> None:
    """Read a GGUF file's header and tensor table (no weights), so that a truncated file is named
    before transformers' loader fails inside numpy.

    Raises:
        CheckpointError: not a GGUF file, or one that ends before its tensors do.
    """
    p = Path(path)
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{p} is not a GGUF file (it starts with {magic!r}, not b'GGUF').")
    from gguf import GGUFReader

    size = p.stat().st_size
    try:
        reader = GGUFReader(str(p))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # noqa: BLE001  (numpy reshape / struct / index errors: a short file)
        raise CheckpointError(f"{p} is truncated or damaged ({size} bytes; the GGUF reader "
                              f"stopped: {type(e).__name__}: {e}); copy the file again.") from None
    if end > size:
        raise CheckpointError(f"{p} is truncated: its tensors end at byte {end}, the file has "
                              f"{size}; copy the file again.")


def _names(keys, most: int = 6) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - most} more)" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


def check_weight_names(where: str | Path, missing, unexpected, *, tied: bool,
                       mismatched=()) -> None:
    """Refuse weights that do not match the model: ``missing`` (would be randomly initialised)
    or ``unexpected`` (would be dropped) parameter names, and ``mismatched`` ``(name, shape in
    the checkpoint, shape in the model)``. ``lm_head.weight`` absent under tied embeddings is
    not missing (it is the embedding).

    Raises:
        CheckpointError: one line naming the missing, unexpected and mismatched tensors.
    """
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    unexpected = list(unexpected)
    shapes = [f"{k} {tuple(a)} (model: {tuple(b)})" for k, a, b in sorted(mismatched)]
    if not missing and not unexpected and not shapes:
        return
    parts = ([f"missing {_names(missing)} (would be randomly initialised)"] if missing else []) \
        + ([f"unexpected {_names(unexpected)} (would be dropped)"] if unexpected else []) \
        + ([f"other shape {_names(shapes, 3)}"] if shapes else [])
    raise CheckpointError(f"{where}: the weights do not match the model's config: "
                          f"{'; '.join(parts)}; use a complete checkpoint of this model.")


class _NoLoadReport:
    """A logging filter dropping transformers' load report (a table of missing / unexpected /
    mismatched keys): :func:`from_pretrained_strict` refuses each of them in one line instead."""

    @staticmethod
    def filter(record) -> bool:
        return "LOAD REPORT" not in str(record.msg)


def from_pretrained_strict(model_class, path: str | Path, **kw):
    """``model_class.from_pretrained`` that refuses what transformers only warns about.

    ``path`` is a save_pretrained folder or a ``.gguf`` file (transformers' GGUF loader, which
    needs the ``gguf`` package). The files are checked first (:func:`read_config_json`,
    :func:`tensor_names`, :func:`check_gguf`), then every missing, unexpected or shape-mismatched
    weight is an error (:func:`check_weight_names`).

    Raises:
        FileNotFoundError: no config.json in the folder, or no such GGUF file.
        CheckpointError: a truncated or damaged file, weights that do not match, a weight that
            is not floating point or holds NaN / inf, or a folder asking for custom code.
    """
    import logging

    p = Path(path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such GGUF file")
        check_gguf(p)
        args, kw = (str(p.parent),), {"gguf_file": p.name, **kw}
    else:
        read_config_json(p)
        refuse_remote_code(p)
        tensor_names(p)
        args = (str(p),)
        kw = {**kw, "use_safetensors": True}  # never a pickled pytorch_model.bin beside it
    # mismatched shapes are reported below like missing keys, not as transformers' RuntimeError
    kw = {"ignore_mismatched_sizes": True, **kw, "output_loading_info": True,
          "trust_remote_code": False}
    log = logging.getLogger("transformers.modeling_utils")
    log.addFilter(_NoLoadReport)
    try:
        model, info = model_class.from_pretrained(*args, **kw)
    finally:
        log.removeFilter(_NoLoadReport)
    mismatched = [(k, (), ()) if isinstance(k, str) else k
                  for k in info.get("mismatched_keys", ())]
    check_weight_names(p, info.get("missing_keys", ()), info.get("unexpected_keys", ()),
                       tied=bool(getattr(model.config, "tie_word_embeddings", False)),
                       mismatched=mismatched)
    check_finite(model.named_parameters(), p)
    return model


def load_model(checkpoint_dir: str | Path, ffn_impl: str = "torch", **from_pretrained_kw):
    """Load a checkpoint folder (HF layout: config.json + safetensors) with SparseGatedMLP FFNs.

    Args:
        checkpoint_dir: a ``step{N}`` folder written by the trainer (or any ReLU Llama folder).
        ffn_impl: ``torch`` | ``twell`` | ``auto`` (see :class:`twell.nn.SparseGatedMLP`).
        **from_pretrained_kw: passed to ``LlamaForCausalLM.from_pretrained`` (e.g. ``dtype``,
            ``device_map``) for gated models.

    Returns:
        ``LlamaForCausalLM`` in eval mode.

    Raises:
        FileNotFoundError: no config.json in ``checkpoint_dir``.
        CheckpointError: a truncated or damaged config.json or weight file, a twell checkpoint
            failing its ``metadata.json`` (:func:`check_recorded`), weights that do not match
            the config (missing, unexpected, other shapes, not floating point, NaN / inf:
            named; nothing is invented), or a folder asking for custom code.
        ValueError: unknown ``ffn_impl`` (checked before anything is read).
    """
    if ffn_impl not in FFN_IMPLS:
        raise ValueError(f"load_model: ffn impl must be one of {FFN_IMPLS}; got {ffn_impl!r}")
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(checkpoint_dir)
    saved = read_config_json(d)
    check_recorded(d)
    if saved.get(GATED_KEY, True):
        model = from_pretrained_strict(LlamaForCausalLM, d, **from_pretrained_kw)
        install_ffns(model, True, ffn_impl)
    else:  # no gate_proj: stock from_pretrained would invent one; load the tensors ourselves
        refuse_remote_code(d)
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(d, trust_remote_code=False))
        install_ffns(model, False, ffn_impl)
        _load_safetensors(model, d)
    return model.eval()


def _load_safetensors(model: nn.Module, d: Path) -> None:
    from safetensors.torch import load_file

    tensor_names(d)  # a truncated file is named before load_file reads it
    state = {}
    for f in safetensors_files(d):
        state.update(load_file(str(f)))
    own = model.state_dict()
    mismatched = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items()
                  if k in own and v.shape != own[k].shape]
    if mismatched:  # load_state_dict would raise a multi-line RuntimeError
        check_weight_names(d, [], [], tied=True, mismatched=mismatched)
    missing, unexpected = model.load_state_dict(state, strict=False)
    check_weight_names(d, missing, unexpected,
                       tied=bool(getattr(model.config, "tie_word_embeddings", False)))
    check_finite(state.items(), d)


def checkpoint_root(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``, the folder holding the ``step{N}/`` checkpoints."""
    return Path(run_dir) / "checkpoints"


def folder_step(ckpt: str | Path) -> int | None:
    """The step in a checkpoint folder's name (``step40`` -> 40; None for another name). A name
    is only a claim: :func:`verify_checkpoint` checks it against the step the folder records."""
    m = _STEP_RE.match(Path(ckpt).name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint folders (``step{N}/`` with metadata.json; not symbolic links)
    of a run, in the order of the steps their names claim, oldest first. Unverified: pick one
    with :func:`latest_checkpoint`, which checks each against what it records."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        n = folder_step(p)
        if n is not None and not p.is_symlink() and p.is_dir() and (p / METADATA).is_file():
            found.append((n, p))
    return [p for _, p in sorted(found)]


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 16 MiB chunks)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_metadata(ckpt: str | Path) -> dict:
    """The ``metadata.json`` of a checkpoint folder (format version, step, tokens seen, lineage,
    files).

    Raises:
        FileNotFoundError: no metadata.json (an incomplete checkpoint).
        ValueError: it is damaged: not JSON, not a JSON object, or a symbolic link.
    """
    f = Path(ckpt) / METADATA
    if f.is_symlink():
        raise ValueError(f"{f} is a symbolic link")
    try:
        doc = json.loads(f.read_text())
    except UnicodeDecodeError as e:
        raise ValueError(str(e)) from None
    if not isinstance(doc, dict):  # a damaged file, reported like invalid JSON
        raise ValueError(f"{f} holds a JSON {type(doc).__name__}, not an object")  # noqa: TRY004
    return doc


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _state_step(ckpt: Path) -> int | None:
    """The step in a checkpoint's ``trainer.json`` (the trainer's state, twell-state format);
    None when it has none or it is unreadable (its record's checks report that)."""
    f = ckpt / "trainer.json"
    try:
        doc = json.loads(f.read_text())
        return _int(doc["value"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _walk(ckpt: Path):
    """(relative posix name, path) of everything under ``ckpt`` (links not followed)."""
    for top, dirs, files in os.walk(ckpt):
        for name in sorted(dirs + files):
            p = Path(top) / name
            yield p.relative_to(ckpt).as_posix(), p


def verify_checkpoint(ckpt: str | Path, *, checksums: bool = True, no_hash: tuple[str, ...] = (),
                      legacy_files: tuple[str, ...] = MODEL_FILES) -> list[str]:
    """What is wrong with a checkpoint folder (empty: intact), judged by what it records, never
    by its name.

    - ``metadata.json`` must be there and readable, and record the step: a folder named
      ``step{N}`` must record step N (in metadata.json and in ``trainer.json``'s state), so a
      folder renamed or copied to another step is not taken for that step.
    - Every file under the folder must be recorded in metadata.json with its size and (if
      ``checksums``) SHA-256, and every recorded file must be there, a regular file of that size
      and hash; nothing may be a symbolic link. Files whose names start with one of ``no_hash``
      are checked for their size only (e.g. a loader of the model alone skips hashing the
      optimizer state).
    - A checkpoint of the previous format (``format_version`` < 2: no file records) is only
      checked for the presence of ``legacy_files`` (regular files).

    Returns:
        Short phrases naming the file, e.g. ``"model.safetensors fails its SHA-256 check"``.
    """
    ckpt = Path(ckpt)
    if ckpt.is_symlink():
        return [f"{ckpt.name} is a symbolic link (a run's checkpoints are folders of their own)"]
    try:
        meta = read_metadata(ckpt)
    except FileNotFoundError:
        return ["metadata.json is missing (an incomplete save)"]
    except (OSError, ValueError) as e:
        return [f"metadata.json is damaged ({e})"]
    problems = []
    step, named = _int(meta.get("step")), folder_step(ckpt)
    if step is None:
        problems.append("metadata.json records no step")
    elif named is not None and named != step:
        problems.append(f"its name says step {named} but metadata.json records step {step} "
                        f"(renamed or copied: rename it back to step{step} or delete it)")
    files = meta.get("files")
    if files is None:
        if (_int(meta.get("format_version")) or 0) >= 2:
            return problems + ["metadata.json records no files (damaged)"]
        return problems + _legacy_problems(ckpt, legacy_files)
    if not isinstance(files, dict) or not all(isinstance(r, dict) for r in files.values()):
        return problems + ["metadata.json's file records are damaged"]
    problems += _unrecorded_problems(ckpt, files)
    problems += _recorded_problems(ckpt, files, checksums, no_hash)
    if "trainer.json" in files and step is not None and not any(
            q.startswith("trainer.json") for q in problems):
        state = _state_step(ckpt)
        if state != step:
            problems.append(f"trainer.json records step {state}, metadata.json step {step}")
    return problems


def _legacy_problems(ckpt: Path, legacy_files: tuple[str, ...]) -> list[str]:
    """A previous-format checkpoint (no sizes recorded): each of ``legacy_files`` missing or a
    symbolic link."""
    problems = []
    for name in legacy_files:
        f = ckpt / name
        if f.is_symlink():
            problems.append(f"{name} is a symbolic link")
        elif not f.is_file():
            problems.append(f"{name} is missing")
    return problems


def _unrecorded_problems(ckpt: Path, files: dict) -> list[str]:
    """What is under the folder but should not be: links, special files, files ``files``
    (metadata.json's records) does not name."""
    problems = []
    for name, p in _walk(ckpt):
        if p.is_symlink():
            problems.append(f"{name} is a symbolic link")
        elif not p.is_dir() and not p.is_file():
            problems.append(f"{name} is not a regular file")
        elif p.is_file() and name != METADATA and name not in files:
            problems.append(f"{name} is not recorded in metadata.json (added after the save)")
    return problems


def _recorded_problems(ckpt: Path, files: dict, checksums: bool,
                       no_hash: tuple[str, ...]) -> list[str]:
    """Each recorded file outside the folder, missing, of another size, or (``checksums``, unless
    its name starts with one of ``no_hash``) without or failing its SHA-256 (hashed 4 at a time)."""
    problems, todo = [], []
    for name, rec in files.items():
        p = ckpt / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"metadata.json records {name!r}, outside the folder")
        elif p.is_symlink() or (p.exists() and not p.is_file()):
            continue  # named by _unrecorded_problems
        elif not p.is_file():
            problems.append(f"{name} is missing")
        elif p.stat().st_size != rec.get("bytes"):
            problems.append(f"{name} has {p.stat().st_size} bytes, metadata.json records "
                            f"{rec.get('bytes')}")
        elif checksums and not (no_hash and name.startswith(no_hash)):
            if not rec.get("sha256"):
                problems.append(f"{name} has no SHA-256 in metadata.json")
            else:
                todo.append((name, p, rec["sha256"]))
    if todo:
        with ThreadPoolExecutor(max_workers=min(4, len(todo))) as pool:
            for (name, _, want), got in zip(todo, pool.map(sha256_file, [p for _, p, _ in todo])):
                if got != want:
                    problems.append(f"{name} fails its SHA-256 check")
    return problems


def check_recorded(d: str | Path) -> None:
    """Refuse a folder that carries a ``metadata.json`` (a twell checkpoint) but fails
    :func:`verify_checkpoint` (the optimizer state checked for its size only: a loader of the
    model does not read it); a folder without one (any save_pretrained folder) passes.

    Raises:
        CheckpointError: one line naming the folder and its first problems.
    """
    d = Path(d)
    if d.is_dir() and ((d / METADATA).exists() or (d / METADATA).is_symlink()):
        problems = verify_checkpoint(d, no_hash=("optimizer.",))
        if problems:
            raise CheckpointError(f"{d} is damaged or incomplete ({'; '.join(problems[:3])}); "
                                  "use an intact checkpoint (a run dir's newest intact one: "
                                  "twell.hf.latest_checkpoint)")


def latest_checkpoint(run_dir: str | Path, *, checksums: bool = True, warn=None,
                      verify=None) -> Path:
    """The newest intact ``step{N}`` folder of ``run_dir``: the one picker of "the newest
    checkpoint" (resume, ``twell-eval checkpoint=<run dir>``, reports). Candidates are taken
    newest first and each must pass ``verify(folder)`` (default :func:`verify_checkpoint` with
    ``checksums``: every recorded file's size and SHA-256, and the step in its name the step it
    records); a failing one is skipped with ``warn(line)`` naming it and its problem.

    Raises:
        FileNotFoundError: there is no complete checkpoint, or none is intact (says where it
            looked and what is wrong with each).
    """
    if verify is None:
        def verify(c):
            return verify_checkpoint(c, checksums=checksums)
    found = list_checkpoints(run_dir)
    damaged = []
    for ckpt in reversed(found):
        problems = verify(ckpt)
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
