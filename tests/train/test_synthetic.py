"""train.data.synthetic: the smoke runs' token stream against its own definition."""

import itertools

import numpy as np
import pytest

from train.data.synthetic import write_successor_tokens


def test_successor_stream_statistics_and_determinism(tmp_path):
    n, vocab = 50_000, 64
    p = write_successor_tokens(tmp_path / "a" / "t.bin", n, vocab, seed=3)
    t = np.fromfile(p, dtype=np.uint16)
    assert t.shape == (n,) and t.min() >= 0 and t.max() < vocab
    assert np.array_equal(t, np.fromfile(write_successor_tokens(tmp_path / "b.bin", n, vocab, 3),
                                          dtype=np.uint16))
    assert not np.array_equal(t, np.fromfile(write_successor_tokens(tmp_path / "c.bin", n, vocab,
                                                                    4), dtype=np.uint16))
    # 2 % document ends; after a non-end token the successor table is followed 90 % of the time
    # (plus 1/63 by chance) unless the next position ends a document (2 %)
    assert (t == 0).mean() == pytest.approx(0.02, abs=0.003)
    pairs = {}
    for a, b in itertools.pairwise(t):
        if a and b:
            pairs.setdefault(int(a), []).append(int(b))
    follow = np.mean([np.mean(np.array(v) == np.bincount(v).argmax()) for v in pairs.values()
                      if len(v) > 50])
    assert follow == pytest.approx(0.9 + 0.1 / 63, abs=0.02)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab must be in"):
        write_successor_tokens(tmp_path / "t.bin", 10, 1)
    with pytest.raises(ValueError, match="n_tokens >= 0"):
        write_successor_tokens(tmp_path / "t.bin", -1, 64)
    assert np.fromfile(write_successor_tokens(tmp_path / "e.bin", 0, 64), np.uint16).size == 0
