"""Synthetic token streams for smoke runs (CPU tests and ``--smoke`` modes): no corpus needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_successor_tokens(path: Path, n_tokens: int, vocab: int, seed: int = 0) -> Path:
    """Write a uint16 token file of ``n_tokens`` ids in ``[0, vocab)``: documents (id 0 ends
    one, 2 % of positions) whose next token follows a fixed random successor table 90 % of the
    time, else a uniform id; a tiny model learns it and turns sparse in a few steps. Returns
    ``path`` (parent folders created).

    Raises:
        ValueError: ``vocab`` outside [2, 65536] or ``n_tokens`` < 0.
    """
    if not 2 <= vocab <= 65536 or n_tokens < 0:
        raise ValueError(f"write_successor_tokens: vocab must be in [2, 65536] and n_tokens >= 0; "
                         f"got vocab={vocab}, n_tokens={n_tokens}")
    rng = np.random.default_rng(seed)
    nxt = np.concatenate([[1], rng.permutation(np.arange(1, vocab))])
    out, cur = np.empty(n_tokens, dtype=np.uint16), 1
    for i in range(n_tokens):
        if rng.random() < 0.02:
            out[i], cur = 0, int(rng.integers(1, vocab))
            continue
        out[i] = cur
        cur = int(nxt[cur]) if rng.random() < 0.9 else int(rng.integers(1, vocab))
    path.parent.mkdir(parents=True, exist_ok=True)
    out.tofile(path)
    return path
