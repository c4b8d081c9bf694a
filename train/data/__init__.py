"""twell's pretraining data: configs, corpus building, packing into blocks, batches per rank.

    from train.data import DataConfig, build_datamodule
    dm = build_datamodule(DataConfig(), seq_len=2048, micro_batch=8, seed=0, rank=0, world_size=1)
    x_BT = next(dm.train_batches())          # int64 (micro_batch, seq_len); labels = inputs

Sources (``DataConfig.source``):
- ``offline_mix`` (default): the registry-fetched corpus of train/data/README.md, built once by
  ``twell-data build`` (or on first use when ``build_if_missing``) into ``<cache>/corpus``.
- ``files``: local jsonl/json/parquet/txt, tokenized and cached like the corpus.
- ``fineweb_edu``: the paper's corpus, FineWeb-Edu dedup (``skymizer/fineweb-edu-dedup-45B``),
  streamed with ``datasets`` (needs internet).
- ``tokens``: pre-tokenized uint16 ``.bin``/``.npy`` streams.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from train.data.config import SOURCES, DataConfig, register_configs
from train.data.packing import DataError, DataModule, TokenStream

__all__ = ["SOURCES", "DataConfig", "DataError", "DataModule", "build_datamodule", "register_configs"]


def build_datamodule(cfg: DataConfig, *, seq_len: int, micro_batch: int, seed: int, rank: int = 0,
                     world_size: int = 1):
    """Build the :class:`DataModule` for one data-parallel rank.

    Args:
        cfg: data config (a ``DataConfig`` or an OmegaConf node with its fields).
        seq_len: tokens per block ``T``.
        micro_batch: blocks per batch ``B``.
        seed: shuffle seed (same on every rank).
        rank, world_size: data-parallel rank and number of ranks.

    Returns:
        DataModule (``fineweb_edu``: a streaming module with the same interface).

    Raises:
        DataError: corpus/token files missing, empty, truncated, corrupted, not matching the
            manifest, or too short for one block (of ``seq_len``) per rank.
        ValueError: bad config values (named in the message).
    """
    if not isinstance(cfg, DataConfig):  # OmegaConf DictConfig / dict -> validated dataclass
        try:
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_object(cfg) if OmegaConf.is_config(cfg) else cfg
        except ImportError:
            pass
        if not isinstance(cfg, DataConfig):
            cfg = DataConfig(**dict(cfg))
    kw = {"seq_len": seq_len, "micro_batch": micro_batch, "seed": seed, "rank": rank, "world_size": world_size}
    if cfg.source == "tokens":
        return _tokens_module(cfg, **kw)
    if cfg.source in ("offline_mix", "files"):
        from train.data.corpus import corpus_module

        return corpus_module(cfg, **kw)
    if cfg.source == "fineweb_edu":
        from train.data.streaming import StreamingDataModule

        return StreamingDataModule(cfg, **kw)
    raise ValueError(f"data.source must be one of {SOURCES}; got {cfg.source!r}")


def _tokens_module(cfg: DataConfig, **kw) -> DataModule:
    """``tokens`` source: concatenate ``cfg.paths``; validation from ``val_paths`` or the last blocks."""
    train = TokenStream.from_files(cfg.paths)
    desc = [(Path(p).name, a.shape[0]) for p, a in zip(cfg.paths, train.arrays)]
    seq_len = kw["seq_len"]
    if len(train) == 0:
        raise DataError(f"token files data.paths={list(cfg.paths)} are empty (0 tokens); give "
                        "files holding uint16 token ids")
    if cfg.val_paths:
        val = TokenStream.from_files(cfg.val_paths)
    elif cfg.val_fraction > 0:
        n_blocks = len(train) // seq_len
        n_val = max(1, round(cfg.val_fraction * n_blocks))
        if n_val >= n_blocks:
            raise DataError(
                f"token files data.paths={list(cfg.paths)} hold {len(train)} tokens = {n_blocks} "
                f"blocks of model.seq_len={seq_len}: too few to hold out data.val_fraction="
                f"{cfg.val_fraction}; add data, lower model.seq_len, or set data.val_paths or "
                "data.val_fraction=0"
            )
        train, val = train.split((n_blocks - n_val) * seq_len)
    else:
        val = None
    vocab_size = cfg.vocab_size
    max_id = max(train.max_id(), val.max_id() if val is not None else -1)
    if vocab_size is None:
        vocab_size = max(max_id, cfg.eos_id) + 1
    elif max_id >= vocab_size:
        raise DataError(
            f"token files {cfg.paths} hold id {max_id} >= data.vocab_size={vocab_size}: wrong files or vocab_size"
        )
    fp = hashlib.sha256(json.dumps([desc, len(train), len(val) if val is not None else 0]).encode())
    info = {"source": "tokens", "paths": list(cfg.paths), "train_tokens": len(train),
            "val_tokens": len(val) if val is not None else 0}
    return DataModule(train, val, tokenizer=None, vocab_size=vocab_size, eos_id=cfg.eos_id,
                      fingerprint=fp.hexdigest()[:16], info=info, **kw)
