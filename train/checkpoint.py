"""Checkpoint folders: ``run_dir/checkpoints/step{N}/``, written atomically, newest found by name.

Layout of ``step{N}/``::

    config.json, model.safetensors      model weights (``save_pretrained``; loads into
                                        LlamaForCausalLM / ``twell.hf.load_model``)
    tokenizer files                     if the data module has a tokenizer
    optimizer.pt, scheduler.pt          torch state dicts (the optimizer's in the unsharded
                                        format with full tensors; FSDP gathers them on rank 0)
    trainer.pt                          trainer state (step, tokens seen, ...) and sparsity tracker
    rank{r}.pt                          per rank: RNG states (python, numpy, torch, cuda) and the
                                        data position (datamodule.state_dict(): global, the same
                                        in every file; a streamed source's is per rank)
    train_config.yaml                   resolved run config
    metadata.json                       format version, step, world size (it may differ on
                                        resume), library versions; written last: a folder
                                        without it is incomplete

The folder is written as ``.step{N}.tmp`` and renamed into place, so a crash never leaves a
half-written ``step{N}``. Source of the layout: OLMo-core's ``train/checkpoint.py`` habit.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from twell.hf import checkpoint_root, latest_checkpoint, list_checkpoints  # noqa: F401

FORMAT_VERSION = 1


def rng_state() -> dict:
    """Python, numpy, torch CPU and (if present) all CUDA RNG states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the python, numpy, torch (and CUDA, if saved and present) RNG states saved in a
    checkpoint's ``rank{r}.pt``; raises KeyError if a CPU state is missing."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


def finish(tmp: Path, final: Path, *, step: int, world_size: int, keep_last: int,
           extra: dict | None = None) -> Path:
    """Write metadata.json, rename ``tmp`` to ``final`` and keep only the ``keep_last`` newest.

    A previous ``final`` of the same step (e.g. rewritten after resume) is replaced.
    """
    import transformers

    import twell

    meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "twell": twell.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__, **(extra or {})}
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2))
    if final.exists():
        old = final.parent / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    for stale in list_checkpoints(final.parent.parent)[:-keep_last]:
        shutil.rmtree(stale)
    return final


def read_metadata(ckpt: str | Path) -> dict:
    """The ``metadata.json`` of a checkpoint folder (format version, step, tokens seen, ...);
    raises FileNotFoundError for an incomplete checkpoint."""
    return json.loads((Path(ckpt) / "metadata.json").read_text())
