"""``fineweb_edu`` source: the paper's corpus streamed from the HF hub with ``datasets`` (needs internet).

Dataset: ``skymizer/fineweb-edu-dedup-45B`` (FineWeb-Edu, deduplicated; ``text`` column) or any
dataset name/local folder ``datasets.load_dataset(..., streaming=True)`` accepts (tests use a
local jsonl folder as a stand-in; the hub is never contacted in tests).

Per rank: ``split_dataset_by_node`` -> ``shuffle(seed, buffer_size)`` with ``set_epoch(epoch)`` ->
documents whose hash puts them in validation (same rule as the corpus builder:
:func:`train.data.build.is_val`) are skipped -> each document is tokenized (special-token text
stays text) and followed by EOS -> the token stream is cut into ``seq_len`` blocks, ``micro_batch``
blocks per batch. No block shuffle beyond the document shuffle buffer (the data is far larger
than any run). Endless: at the end of the stream the next epoch starts; tokens left over carry on.

Exact resume: the state holds the epoch, the number of documents of this epoch's stream already
read and the tokens read but not yet served; loading it re-opens the stream and skips that many
documents (cost: reading them again, no tokenization).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from train.data.build import is_val, norm_hash

STATE_VERSION = 1
DEFAULT_VAL_BATCHES = 100


class StreamingDataModule:
    """Same interface as :class:`train.data.packing.DataModule`, over a streamed text dataset.

    Args:
        cfg: DataConfig with ``source="fineweb_edu"`` (``hub_dataset``, ``hub_config``, ``hub_split``,
            ``text_field``, ``shuffle_buffer``, ``val_fraction``, ``tokenizer``).
        seq_len, micro_batch, seed, rank, world_size: as for ``build_datamodule``.
    """

    def __init__(self, cfg, *, seq_len: int, micro_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        from train.data.tokenizer import load_tokenizer

        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len and micro_batch must be >= 1; got {seq_len}, {micro_batch}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
        self.cfg = cfg
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        self.tokenizer = load_tokenizer(cfg.tokenizer, cache=None, max_vocab=65536)
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self.info = {"source": "fineweb_edu", "hub_dataset": cfg.hub_dataset, "hub_split": cfg.hub_split}
        self.epoch, self.docs_read, self.pending = 0, 0, np.zeros(0, np.int64)

    def _stream(self, epoch: int | None):
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        ds = load_dataset(self.cfg.hub_dataset, self.cfg.hub_config, split=self.cfg.hub_split, streaming=True)
        if self.cfg.text_field not in (ds.column_names or [self.cfg.text_field]):
            raise ValueError(f"{self.cfg.hub_dataset} has no column {self.cfg.text_field!r} "
                             f"(columns: {ds.column_names}); set data.text_field")
        ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
        if epoch is not None:
            ds = ds.shuffle(seed=self.seed, buffer_size=self.cfg.shuffle_buffer)
            ds.set_epoch(epoch)
        return ds

    def _encode(self, text: str) -> np.ndarray:
        backend = self.tokenizer.backend_tokenizer
        backend.encode_special_tokens = True
        try:
            ids = backend.encode(text, add_special_tokens=False).ids
        finally:
            backend.encode_special_tokens = False
        return np.asarray(ids + [self.eos_id], dtype=np.int64)

    def _docs(self, want_val: bool, epoch: int | None, skip: int = 0) -> Iterator[str]:
        field, vf = self.cfg.text_field, self.cfg.val_fraction
        for i, row in enumerate(self._stream(epoch)):
            if i < skip:
                continue
            text = row[field] or ""
            yield text if is_val(norm_hash(text), vf) == want_val else None

    def train_batches(self) -> Iterator[torch.Tensor]:
        """Endless training batches, int64 ``(micro_batch, seq_len)``, from the saved position;
        ``micro_batch`` is read at every batch (the trainer's uneven micro-batches set it)."""
        while True:
            empty_epoch = True
            for text in self._docs(False, self.epoch, skip=self.docs_read):
                self.docs_read += 1
                if text is None:
                    continue
                empty_epoch = False
                self.pending = np.concatenate([self.pending, self._encode(text)])
                while self.pending.size >= self.seq_len * self.micro_batch:
                    B = self.micro_batch
                    batch, self.pending = self.pending[:B * self.seq_len], self.pending[B * self.seq_len:]
                    yield torch.from_numpy(batch.reshape(B, self.seq_len).copy())
            if empty_epoch and self.docs_read == 0:
                raise ValueError(f"{self.cfg.hub_dataset} yielded no training documents for rank {self.rank}")
            self.epoch, self.docs_read = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """Position: epoch, documents read in this epoch's stream, tokens read but not served."""
        return {"version": STATE_VERSION, "source": "fineweb_edu", "epoch": self.epoch,
                "docs_read": self.docs_read, "pending": self.pending.tolist(), "seed": self.seed,
                "seq_len": self.seq_len, "world_size": self.world_size, "rank": self.rank,
                "hub_dataset": self.cfg.hub_dataset}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (per rank: the pending tokens differ between ranks).

        Raises:
            ValueError: saved with another dataset, seed, seq_len, world_size or rank.
        """
        if d.get("version") != STATE_VERSION or d.get("source") != "fineweb_edu":
            raise ValueError(f"not a fineweb_edu data state (version {d.get('version')!r}, source {d.get('source')!r})")
        for key in ("seed", "seq_len", "world_size", "rank"):
            if d[key] != getattr(self, key):
                raise ValueError(f"data state was saved with {key}={d[key]!r} but this run has "
                                 f"{getattr(self, key)!r}: resume with the same setup")
        if d["hub_dataset"] != self.cfg.hub_dataset:
            raise ValueError(f"data state is for {d['hub_dataset']!r}, this run streams {self.cfg.hub_dataset!r}")
        self.epoch, self.docs_read = int(d["epoch"]), int(d["docs_read"])
        self.pending = np.asarray(d["pending"], dtype=np.int64)

    def val_batches(self, max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """Held-out documents (by hash) of the unshuffled stream, packed in order; the same every call.

        ``max_batches`` defaults to 100 (the held-out part of a 45B-token set is large); the last,
        partial block is dropped.
        """
        limit = DEFAULT_VAL_BATCHES if max_batches is None else max_batches
        need = self.seq_len * self.micro_batch
        buf, n = np.zeros(0, np.int64), 0
        if limit <= 0:
            return
        for text in self._docs(True, None):
            if text is None:
                continue
            buf = np.concatenate([buf, self._encode(text)])
            while buf.size >= need:
                batch, buf = buf[:need], buf[need:]
                yield torch.from_numpy(batch.reshape(self.micro_batch, self.seq_len).copy())
                n += 1
                if n >= limit:
                    return
        if buf.size >= self.seq_len:  # one last, smaller batch of whole blocks
            k = buf.size // self.seq_len
            yield torch.from_numpy(buf[: k * self.seq_len].reshape(k, self.seq_len).copy())
