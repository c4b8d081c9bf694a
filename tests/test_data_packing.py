"""Packing, shuffling, rank sharding and exact resume of train.data on small generated token files.

The reference is position arithmetic on a stream whose tokens are all distinct (ids 1..N, with
EOS=0 between documents), so every served block can be located in the stream independently.
"""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from train.data import DataConfig, DataError, build_datamodule, register_configs
from train.data.packing import BlockSampler, TokenStream

EOS = 0


def make_stream(n_docs=37, seed=0):
    """Distinct ids 1..N split into documents of random length, EOS after each document."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 40, n_docs)
    parts, nxt = [], 1
    for n in lens:
        parts += [np.arange(nxt, nxt + n, dtype=np.uint16), np.array([EOS], np.uint16)]
        nxt += n
    return np.concatenate(parts)


def write_files(tmp_path, stream, cuts):
    """Split `stream` at `cuts` into alternately .bin and .npy files; return their paths."""
    paths = []
    for i, piece in enumerate(np.split(stream, cuts)):
        if i % 2:
            p = tmp_path / f"part{i}.npy"
            np.save(p, piece)
        else:
            p = tmp_path / f"part{i}.bin"
            piece.astype("<u2").tofile(p)
        paths.append(str(p))
    return paths


def dm_for(paths, T, B, seed=0, rank=0, world_size=1, **cfg):
    cfg = DataConfig(source="tokens", paths=paths, val_fraction=0.0, **cfg)
    return build_datamodule(cfg, seq_len=T, micro_batch=B, seed=seed, rank=rank, world_size=world_size)


def block_index(stream, block, T):
    """Index of `block` in `stream` (located by its first non-EOS token; all ids are distinct)."""
    j = int(np.flatnonzero(block != EOS)[0])
    pos = int(np.flatnonzero(stream == block[j])[0]) - j
    assert pos % T == 0, f"block does not start on a block boundary (pos {pos})"
    np.testing.assert_array_equal(stream[pos:pos + T], block)
    return pos // T


@pytest.mark.parametrize("T,B", [(16, 3), (7, 5), (50, 1)])
def test_one_epoch_serves_every_whole_block_once(tmp_path, T, B):
    stream = make_stream()
    paths = write_files(tmp_path, stream, [100, 101, 333])  # block reads cross file boundaries
    dm = dm_for(paths, T, B)
    n_blocks = len(stream) // T
    assert dm.n_blocks == n_blocks and dm.blocks_per_epoch == n_blocks
    it = dm.train_batches()
    blocks = []
    while len(blocks) < n_blocks:
        x = next(it)
        assert x.dtype == torch.int64 and x.shape == (B, T)
        blocks += list(x.numpy().astype(np.uint16))
    idx = [block_index(stream, b, T) for b in blocks]
    assert sorted(idx[:n_blocks]) == list(range(n_blocks))  # each whole block exactly once
    served = np.concatenate(blocks[:n_blocks])
    np.testing.assert_array_equal(np.sort(served), np.sort(stream[: n_blocks * T]))
    # The tail (len % T tokens after the last whole block) is never served.
    tail = stream[n_blocks * T:]
    assert len(tail) == len(stream) % T
    assert not np.isin(tail[tail != EOS], served).any()
    # A batch straddling the epoch boundary continues with epoch 1's permutation.
    extra = idx[n_blocks:]
    perm1 = np.random.default_rng([0, 1]).permutation(n_blocks)
    assert extra == list(perm1[: len(extra)])


def test_shuffle_is_deterministic_and_differs_per_epoch(tmp_path):
    paths = write_files(tmp_path, make_stream(), [])
    a = BlockSampler(50, seed=3)
    b = BlockSampler(50, seed=3)
    np.testing.assert_array_equal(a.epoch_blocks(0), b.epoch_blocks(0))
    assert not np.array_equal(a.epoch_blocks(0), a.epoch_blocks(1))
    assert not np.array_equal(a.epoch_blocks(0), BlockSampler(50, seed=4).epoch_blocks(0))
    assert sorted(a.epoch_blocks(1)) == list(range(50))
    x0 = next(dm_for(paths, 8, 4, seed=1).train_batches())
    x1 = next(dm_for(paths, 8, 4, seed=1).train_batches())
    torch.testing.assert_close(x0, x1, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_are_disjoint_equal_and_cover_the_epoch(tmp_path, world_size):
    stream = make_stream(n_docs=41, seed=1)
    paths = write_files(tmp_path, stream, [250])
    T, B = 9, 2
    n_blocks = len(stream) // T
    per_rank = n_blocks // world_size
    seen = []
    for r in range(world_size):
        dm = dm_for(paths, T, B, seed=7, rank=r, world_size=world_size)
        assert dm.blocks_per_epoch == per_rank
        it = dm.train_batches()
        blocks = np.concatenate([next(it).numpy() for _ in range(-(-per_rank // B))])[:per_rank]
        seen.append([block_index(stream, b.astype(np.uint16), T) for b in blocks])
    flat = [i for s in seen for i in s]
    assert len(flat) == len(set(flat)) == per_rank * world_size  # disjoint, equal counts
    perm = np.random.default_rng([7, 0]).permutation(n_blocks)
    assert set(flat) == set(perm[: per_rank * world_size])  # leftover: last n_blocks % W of perm
    assert set(range(n_blocks)) - set(flat) == set(perm[per_rank * world_size:])


@pytest.mark.parametrize("k", [1, 5, 11])  # 6 blocks per rank-epoch, B=3: batches straddle epoch ends
def test_resume_yields_the_same_next_batches(tmp_path, k):
    stream = make_stream(n_docs=10, seed=2)
    paths = write_files(tmp_path, stream, [60])
    T, B = len(stream) // 13, 3
    ref = dm_for(paths, T, B, seed=5, rank=1, world_size=2)
    it = ref.train_batches()
    for _ in range(k):
        next(it)
    state = ref.state_dict()
    expected = [next(it) for _ in range(6)]
    fresh = dm_for(paths, T, B, seed=5, rank=1, world_size=2)
    fresh.load_state_dict(state)
    got = fresh.train_batches()
    for e in expected:
        torch.testing.assert_close(next(got), e, rtol=0, atol=0)
    assert fresh.state_dict() == ref.state_dict()
    assert state["blocks_consumed"] == k * B


def test_resume_refuses_a_different_setup(tmp_path):
    paths = write_files(tmp_path, make_stream(), [])
    state = dm_for(paths, 8, 2).state_dict()
    with pytest.raises(ValueError, match="seq_len"):
        dm_for(paths, 9, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        dm_for(paths, 8, 2, seed=1).load_state_dict(state)
    (tmp_path / "o").mkdir()
    other = write_files(tmp_path / "o", make_stream(seed=9), [])
    with pytest.raises(ValueError, match="fingerprint|n_blocks"):
        dm_for(other, 8, 2).load_state_dict(state)
    dm_for(paths, 8, 5).load_state_dict(state)  # micro_batch may change: position is in blocks


def test_validation_split_and_val_batches(tmp_path):
    stream = make_stream(n_docs=60, seed=3)
    paths = write_files(tmp_path, stream, [400])
    T, B = 10, 4
    cfg = DataConfig(source="tokens", paths=paths, val_fraction=0.1)
    dm = build_datamodule(cfg, seq_len=T, micro_batch=B, seed=0)
    n_blocks = len(stream) // T
    n_val = round(0.1 * n_blocks)
    assert dm.n_blocks == n_blocks - n_val and dm.val_blocks == n_val
    val = torch.cat(list(dm.val_batches())).numpy()
    ref = stream[(n_blocks - n_val) * T:].astype(np.int64)
    np.testing.assert_array_equal(val.reshape(-1), ref[: n_val * T])
    again = torch.cat(list(dm.val_batches())).numpy()
    np.testing.assert_array_equal(val, again)
    assert len(list(dm.val_batches(max_batches=1))) == 1
    it = dm.train_batches()
    train = torch.cat([next(it) for _ in range(-(-dm.n_blocks // B))]).numpy()[: dm.n_blocks]
    assert not np.isin(val[val != EOS], train).any()  # held out blocks never trained on
    # Two ranks split the validation blocks between them.
    v0 = list(build_datamodule(cfg, seq_len=T, micro_batch=B, seed=0, rank=0, world_size=2).val_batches())
    v1 = list(build_datamodule(cfg, seq_len=T, micro_batch=B, seed=0, rank=1, world_size=2).val_batches())
    rows0, rows1 = torch.cat(v0).numpy(), torch.cat(v1).numpy()
    assert len(rows0) == len(rows1) == n_val // 2
    np.testing.assert_array_equal(rows0, val[0: 2 * (n_val // 2): 2])
    np.testing.assert_array_equal(rows1, val[1: 2 * (n_val // 2): 2])


def test_vocab_size_and_eos(tmp_path):
    stream = make_stream()
    paths = write_files(tmp_path, stream, [])
    dm = dm_for(paths, 8, 2)
    assert dm.vocab_size == int(stream.max()) + 1 and dm.eos_id == 0 and dm.tokenizer is None
    with pytest.raises(DataError, match="vocab_size"):
        dm_for(paths, 8, 2, vocab_size=int(stream.max()))


def test_bad_token_files_name_the_file(tmp_path):
    stream = make_stream()
    bad = tmp_path / "odd.bin"
    bad.write_bytes(stream.tobytes()[:-1])
    with pytest.raises(DataError, match="odd.bin.*not a multiple of 2"):
        dm_for([str(bad)], 8, 2)
    npy = tmp_path / "cut.npy"
    np.save(npy, stream)
    npy.write_bytes(npy.read_bytes()[:-10])
    with pytest.raises(DataError, match="cut.npy"):
        dm_for([str(npy)], 8, 2)
    np.save(tmp_path / "f32.npy", stream.astype(np.float32))
    with pytest.raises(DataError, match="f32.npy.*uint16"):
        dm_for([str(tmp_path / "f32.npy")], 8, 2)
    with pytest.raises(DataError, match="nothere.bin"):
        dm_for([str(tmp_path / "nothere.bin")], 8, 2)
    small = tmp_path / "small.bin"
    stream[:5].tofile(small)
    with pytest.raises(DataError, match="small.bin.*world_size"):
        dm_for([str(small)], 8, 2)


def test_token_stream_read_and_split():
    a, b = np.arange(5, dtype=np.uint16), np.arange(5, 12, dtype=np.uint16)
    s = TokenStream([a, b])
    np.testing.assert_array_equal(s.read(3, 6), np.arange(3, 9))
    head, tail = s.split(7)
    assert len(head) == 7 and len(tail) == 5
    np.testing.assert_array_equal(tail.read(0, 5), np.arange(7, 12))
    with pytest.raises(IndexError):
        s.read(10, 3)


def test_config_validation_and_hydra_schema():
    with pytest.raises(ValueError, match="data.source"):
        DataConfig(source="web")
    with pytest.raises(ValueError, match="data.paths"):
        DataConfig(source="tokens")
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig(val_fraction=0.7)
    from hydra.core.config_store import ConfigStore

    register_configs()
    node = ConfigStore.instance().load("data/base_data.yaml").node
    merged = OmegaConf.merge(node, {"source": "tokens", "paths": ["a.bin"], "val_fraction": 0.0})
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, DataConfig) and cfg.paths == ["a.bin"]
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(node, {"no_such_field": 1})
    with pytest.raises(ValidationError):
        OmegaConf.merge(node, {"val_fraction": "lots"})


def test_config_yamls_validate_against_the_dataclass():
    from pathlib import Path

    files = sorted((Path(__file__).parents[1] / "configs" / "data").glob("*.yaml"))
    assert {f.stem for f in files} >= {"offline_mix", "tokens", "files", "fineweb_edu"}
    for f in files:
        merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(f))
        if f.stem in ("tokens", "files"):  # paths: ??? must be given on the command line
            merged.paths = ["x.bin"]
        cfg = OmegaConf.to_object(merged)
        assert isinstance(cfg, DataConfig) and cfg.source == f.stem
