"""Packed, shuffled, rank-sharded, resumable blocks over a uint16 token stream.

Legend: B = micro-batch size (blocks per batch), T = seq_len (tokens per block).

Packing (the usual GPT pretraining recipe, e.g. nanoGPT/OLMo): documents are joined into one
uint16 stream with ``eos_id`` between them (the corpus builder writes ``doc EOS doc EOS ...``);
the stream is cut into ``n_blocks = n_tokens // T`` consecutive, non-overlapping blocks. The
``n_tokens % T`` tokens after the last whole block (the *tail*, fewer than T tokens) are never
served. Blocks may start or end inside a document; there is no padding and no attention mask.

Order: one global stream of blocks, the same for every number of ranks: epoch ``e`` visits all
``n_blocks`` blocks in the permutation drawn from ``SeedSequence([seed, e])``, and the epochs
follow each other (``S = perm_0 ++ perm_1 ++ ...``). The data position is global: ``position``
= blocks of ``S`` consumed by all ranks together (``step * global_batch`` between optimizer
steps). A micro-batch of ``B`` blocks on rank ``r`` of ``W`` takes ``S[position + r + W*j]``,
``j < B``, and every rank then advances ``position`` by ``W * B``: the ``W`` ranks together
read ``S[position : position + W*B]``, disjoint, and an optimizer step of ``global_batch``
blocks reads the same blocks for any ``W`` and micro-batch split (only which rank and
micro-batch holds a block changes). A micro-batch may straddle an epoch boundary. The state
is that one counter, rank-independent, so a checkpoint resumes exactly on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

STATE_VERSION = 2  # 1: per-rank counter of the rank's stream perm[r::W][:n_blocks // W]


class DataError(RuntimeError):
    """Corpus/token files are missing, truncated, corrupted or inconsistent; names the file."""


def file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a data file (None: it is a regular file, or a link to one):
    ``"does not exist"``, ``"is a folder"``, or the kind of special file it is (a FIFO or a
    device such as /dev/zero reads without end or blocks, so it is never opened). For the
    messages of :class:`DataError`: ``f"token file {p} {problem}"``."""
    import stat

    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "does not exist" + (" (a broken symbolic link)" if p.is_symlink() else "")
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISREG(mode):
        return None
    kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device"
            if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
    return f"is {kind}, not a regular file; give a file of tokens or text on disk"



def open_token_file(path: str | Path, expected_tokens: int | None = None, *,
                    rebuild: str = "rebuild the corpus (twell-data build --force)") -> np.ndarray:
    """Memory-map a uint16 token file read-only.

    Args:
        path: ``.npy`` (must hold a 1-D uint16 array) or raw little-endian uint16 (any other suffix).
        expected_tokens: if given, the file must hold exactly this many tokens.
        rebuild: what the error of a wrong token count tells to do (a corpus shard: its
            ``twell-data build --force`` command).

    Returns:
        1-D ``np.uint16`` memmap, shape ``(n_tokens,)``.

    Raises:
        DataError: missing file, odd byte size, wrong dtype/rank, or wrong token count.
    """
    p = Path(path)
    if (problem := file_problem(p)) is not None:
        raise DataError(f"token file {p} {problem}")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, mmap_mode="r")
        except ValueError as e:  # truncated .npy: header promises more bytes than present
            raise DataError(f"token file {p} is truncated or corrupted: {e}") from e
        if arr.dtype != np.uint16 or arr.ndim != 1:
            raise DataError(f"token file {p} holds {arr.dtype} of shape {arr.shape}; need 1-D uint16")
    else:
        size = p.stat().st_size
        if size % 2:
            raise DataError(f"token file {p} has {size} bytes, not a multiple of 2: truncated uint16 stream")
        arr = np.memmap(p, dtype="<u2", mode="r") if size else np.zeros(0, np.uint16)
    if expected_tokens is not None and arr.shape[0] != expected_tokens:
        raise DataError(
            f"token file {p} holds {arr.shape[0]} tokens but the manifest says {expected_tokens}: "
            f"truncated or replaced; {rebuild}"
        )
    return arr


class TokenStream:
    """Read-only concatenation of 1-D uint16 token arrays, addressed as one stream.

    Args:
        arrays: the pieces, in order (e.g. memmaps from :func:`open_token_file`).
        names: a name per piece, for messages.
    """

    def __init__(self, arrays: Sequence[np.ndarray], names: Sequence[str] | None = None):
        self.arrays = list(arrays)
        self.names = list(names) if names is not None else [f"array{i}" for i in range(len(arrays))]
        lens = np.array([a.shape[0] for a in self.arrays], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lens)])  # (n_pieces + 1,)

    @classmethod
    def from_files(cls, paths: Sequence[str | Path]) -> TokenStream:
        """Open every file with :func:`open_token_file` and concatenate them in the given order."""
        return cls([open_token_file(p) for p in paths], [str(p) for p in paths])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream as a new uint16 array, shape ``(length,)``."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"read [{start}, {start + length}) outside stream of {len(self)} tokens")
        out = np.empty(length, dtype=np.uint16)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            off = start + done - int(self.starts[i])
            n = min(length - done, self.arrays[i].shape[0] - off)
            out[done:done + n] = self.arrays[i][off:off + n]
            done += n
            i += 1
        return out

    def split(self, at: int) -> tuple[TokenStream, TokenStream]:
        """Two streams: tokens ``[0, at)`` and ``[at, len)`` (views, no copy)."""
        if not 0 <= at <= len(self):
            raise IndexError(f"split point {at} outside stream of {len(self)} tokens")
        head, tail, hn, tn = [], [], [], []
        for a, name, s in zip(self.arrays, self.names, self.starts[:-1]):
            cut = min(max(at - int(s), 0), a.shape[0])
            if cut:
                head.append(a[:cut]), hn.append(name)
            if cut < a.shape[0]:
                tail.append(a[cut:]), tn.append(name)
        return TokenStream(head, hn), TokenStream(tail, tn)

    def max_id(self, chunk: int = 1 << 24) -> int:
        """Largest token id in the stream (one pass; -1 if empty)."""
        m = -1
        for a in self.arrays:
            for s in range(0, a.shape[0], chunk):
                m = max(m, int(a[s:s + chunk].max()))
        return m


class BlockSampler:
    """Which blocks rank ``rank`` reads, in order: see the module docstring for the rule.

    Args:
        n_blocks: whole blocks in the stream.
        seed: shuffle seed; epoch ``e`` uses ``np.random.default_rng([seed, e])``.
        rank, world_size: this process's data-parallel rank and the number of ranks.

    Raises:
        ValueError: fewer blocks than ranks, or a rank outside ``[0, world_size)``.
    """

    def __init__(self, n_blocks: int, seed: int, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
        if n_blocks < world_size:
            raise ValueError(
                f"the data has {n_blocks} blocks, fewer than world_size={world_size}: "
                "use more data or a smaller seq_len"
            )
        self.n_blocks, self.seed, self.rank, self.world_size = n_blocks, seed, rank, world_size
        self._cache: dict[int, np.ndarray] = {}

    def epoch_blocks(self, epoch: int) -> np.ndarray:
        """Block indices of epoch ``epoch`` of the global stream, int64 shape ``(n_blocks,)``."""
        if epoch not in self._cache:
            if len(self._cache) >= 2:  # a micro-batch spans at most a few epochs
                self._cache.pop(min(self._cache))
            self._cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)
        return self._cache[epoch]

    def global_blocks(self, position: int, count: int) -> np.ndarray:
        """``S[position : position + count]`` of the global stream, int64 shape ``(count,)``."""
        return self._at(position + np.arange(count, dtype=np.int64))

    def blocks(self, position: int, count: int) -> np.ndarray:
        """This rank's ``count`` blocks of the micro-batch that starts at global ``position``:
        ``S[position + rank + world_size * j]``, int64 shape ``(count,)``."""
        return self._at(position + self.rank + self.world_size * np.arange(count, dtype=np.int64))

    def _at(self, pos: np.ndarray) -> np.ndarray:
        epoch, idx = np.divmod(pos, self.n_blocks)
        out = np.empty(pos.shape[0], dtype=np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = self.epoch_blocks(int(e))[idx[sel]]
        return out


class DataModule:
    """Training and validation batches for one data-parallel rank (see module docstring).

    Attributes:
        tokenizer: ``transformers.PreTrainedTokenizerFast`` (save it with checkpoints), or None for
            the ``tokens`` source.
        vocab_size: tokenizer vocabulary size (ids are in ``[0, vocab_size)``); a model with a
            smaller vocabulary must be refused by the trainer.
        eos_id: document separator id.
        seq_len, micro_batch, seed, rank, world_size: as given to :func:`build_datamodule`.
        info: provenance (source, manifest path, token counts) for logging.

    Batches are ``torch.int64`` tensors of shape ``(B, T)`` on the CPU; labels are the inputs
    (HF causal LMs shift internally).

    Raises:
        DataError: the training stream holds fewer whole blocks than there are ranks.
    """

    def __init__(self, train: TokenStream, val: TokenStream | None, *, seq_len: int, micro_batch: int,
                 seed: int, rank: int = 0, world_size: int = 1, tokenizer=None, vocab_size: int,
                 eos_id: int, fingerprint: str, info: dict | None = None):
        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len and micro_batch must be >= 1; got {seq_len}, {micro_batch}")
        self.train_stream, self.val_stream = train, val
        self.seq_len, self.micro_batch, self.seed = seq_len, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.fingerprint = fingerprint
        self.info = dict(info or {})
        self.n_blocks = len(train) // seq_len
        if self.n_blocks < world_size:
            what = ("empty (0 tokens)" if len(train) == 0 else
                    f"{len(train)} tokens = {self.n_blocks} blocks of model.seq_len={seq_len}")
            raise DataError(
                f"training data {train.names} is {what}, fewer blocks than world_size="
                f"{world_size}: add data or lower model.seq_len"
            )
        self.sampler = BlockSampler(self.n_blocks, seed, rank, world_size)
        self.position = 0  # global: blocks of the stream consumed by all ranks together

    # -- training -------------------------------------------------------------------------------
    @property
    def blocks_per_epoch(self) -> int:
        """Blocks of one epoch of the global stream (``n_blocks``; about ``n_blocks / W`` per rank)."""
        return self.n_blocks

    @property
    def epoch(self) -> int:
        """Epoch of the next global block (0-based)."""
        return self.position // self.n_blocks

    def _gather(self, stream: TokenStream, block_ids: np.ndarray) -> torch.Tensor:
        T = self.seq_len
        x_BT = np.stack([stream.read(int(b) * T, T) for b in block_ids])
        return torch.from_numpy(x_BT.astype(np.int64))

    def train_batches(self) -> Iterator[torch.Tensor]:
        """Endless iterator of training batches, int64 ``(B, T)``, starting at the saved position;
        ``B`` is ``micro_batch`` when the batch is drawn (the trainer's uneven micro-batches set it).

        The position advances (by ``world_size * B``, for all ranks) when a batch is yielded, so
        ``state_dict()`` taken after using a batch resumes with the next one. No prefetching
        (nothing is lost on checkpoint).
        """
        while True:
            ids = self.sampler.blocks(self.position, self.micro_batch)
            batch = self._gather(self.train_stream, ids)
            self.position += self.world_size * self.micro_batch
            yield batch

    def state_dict(self) -> dict:
        """Exact data position: the next ``train_batches()`` batch after :meth:`load_state_dict`.

        Rank- and world-size-independent (the global position), so one copy serves every rank
        of a resumed run with any number of ranks and any micro-batch.
        """
        return {
            "version": STATE_VERSION, "position": self.position,
            "seq_len": self.seq_len, "seed": self.seed, "world_size": self.world_size,
            "n_blocks": self.n_blocks, "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, d: dict) -> None:
        """Restore the position from :meth:`state_dict` (saved with any world size).

        A version-1 state (per-rank counter ``blocks_consumed`` of the rank's stream
        ``perm[r::W][:n_blocks // W]``) is converted to ``W * blocks_consumed``: exact for one rank
        or inside the first epoch, where both orders agree.

        Raises:
            ValueError: the state was saved with different data (fingerprint, n_blocks), seq_len
                or seed, so the same position would mean different blocks; or a version-1 state
                of several ranks past its first epoch.
        """
        version = d.get("version")
        if version not in (1, STATE_VERSION):
            raise ValueError(f"data state version {version!r} unsupported (expected {STATE_VERSION})")
        for key in ("fingerprint", "n_blocks", "seq_len", "seed"):
            if d[key] != getattr(self, key):
                raise ValueError(
                    f"data state was saved with {key}={d[key]!r} but this run has {getattr(self, key)!r}: "
                    "resume with the same data, seq_len and seed"
                )
        if version == 1:
            w, c = int(d["world_size"]), int(d["blocks_consumed"])
            if w > 1 and c > self.n_blocks // w:
                raise ValueError(
                    f"data state version 1 of {w} ranks is past its first epoch ({c} blocks per "
                    f"rank > {self.n_blocks // w}); its order differs from version 2: resume it "
                    "with the twell release that wrote it"
                )
            self.position = w * c
        else:
            self.position = int(d["position"])

    # -- validation -----------------------------------------------------------------------------
    def val_batches(self, max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """Held-out blocks in stream order, int64 ``(B, T)``; the same every call.

        Rank ``r`` takes every ``world_size``-th block starting at ``r`` (equal counts); the last
        batch may hold fewer than ``B`` blocks. Yields nothing if there is no validation data.
        """
        if self.val_stream is None:
            return
        n = len(self.val_stream) // self.seq_len
        mine = np.arange(self.rank, n - n % self.world_size, self.world_size)
        for i, s in enumerate(range(0, len(mine), self.micro_batch)):
            if max_batches is not None and i >= max_batches:
                return
            yield self._gather(self.val_stream, mine[s:s + self.micro_batch])

    @property
    def val_blocks(self) -> int:
        """Validation blocks of this rank."""
        if self.val_stream is None:
            return 0
        return (len(self.val_stream) // self.seq_len) // self.world_size
