"""Packing, shuffling, rank sharding and exact resume of train.data on small generated token files.

The reference is position arithmetic on a stream whose tokens are all distinct (ids 1..N, with
EOS=0 between documents), so every served block can be located in the stream independently.
"""

from pathlib import Path

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
def test_ranks_are_disjoint_and_read_the_global_stream(tmp_path, world_size):
    """Rank r's j-th block of a micro-batch at position p is S[p + r + W*j] of the global stream
    S = perm_0 ++ perm_1 (epochs of all blocks, whatever W): the ranks' batches are disjoint, each
    epoch serves every block exactly once over all ranks (n_blocks % W != 0 here, so micro-batches
    straddle the epoch end), and the W ranks together read what one process reads."""
    stream = make_stream(n_docs=41, seed=1)
    paths = write_files(tmp_path, stream, [250])
    T, B = 8, 2  # 103 blocks
    n_blocks = len(stream) // T
    assert n_blocks % world_size and n_blocks % (world_size * B)
    steps = -(-2 * n_blocks // (world_size * B))  # a little over two epochs
    per_rank = []
    for r in range(world_size):
        it = dm_for(paths, T, B, seed=7, rank=r, world_size=world_size).train_batches()
        per_rank.append([[block_index(stream, b.astype(np.uint16), T) for b in next(it).numpy()]
                         for _ in range(steps)])
    one = dm_for(paths, T, world_size * B, seed=7).train_batches()
    perm = [np.random.default_rng([7, e]).permutation(n_blocks) for e in range(3)]
    S = np.concatenate(perm)
    for k in range(steps):
        got = [per_rank[r][k] for r in range(world_size)]
        flat = [i for g in got for i in g]
        want = [block_index(stream, b.astype(np.uint16), T) for b in next(one).numpy()]
        p = k * world_size * B
        assert flat and sorted(flat) == sorted(want) == sorted(S[p:p + world_size * B])
        for r in range(world_size):
            assert got[r] == [S[p + r + world_size * j] for j in range(B)]
        assert len(set(flat)) == len(flat)  # disjoint within the step
    order = [per_rank[r][k][j] for k in range(steps) for j in range(B) for r in range(world_size)]
    assert sorted(order[:n_blocks]) == list(range(n_blocks))  # epoch 0: every block once
    assert sorted(order[n_blocks:2 * n_blocks]) == list(range(n_blocks))  # and epoch 1


@pytest.mark.parametrize("k", [1, 5, 11])  # 13 blocks, 2 ranks x B=3: batches straddle epoch ends
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
    assert state["position"] == k * B * 2  # global: both ranks' blocks


@pytest.mark.parametrize("new_world,new_B", [(1, 4), (1, 2), (4, 1), (2, 2)])
def test_resume_on_another_number_of_ranks_continues_the_global_stream(tmp_path, new_world, new_B):
    """2 ranks x B=2 for 5 micro-batches (position 20 of 17-block epochs), then any W x B reads
    exactly the blocks one uninterrupted process reads next, step by step (4 blocks a step)."""
    stream = make_stream(n_docs=12, seed=4)
    paths = write_files(tmp_path, stream, [])
    T = len(stream) // 17
    old = [dm_for(paths, T, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    for dm in old:
        it = dm.train_batches()
        for _ in range(5):
            next(it)
    state = old[0].state_dict()
    assert state == old[1].state_dict() and state["position"] == 20
    ref = dm_for(paths, T, 4, seed=3)
    ref.load_state_dict(state)
    ref_it = ref.train_batches()
    new = []
    for r in range(new_world):
        dm = dm_for(paths, T, new_B, seed=3, rank=r, world_size=new_world)
        dm.load_state_dict(state)
        new.append(dm.train_batches())
    accum = 4 // (new_world * new_B)
    for _ in range(6):
        want = sorted(map(tuple, next(ref_it).numpy()))
        got = sorted(tuple(x) for _ in range(accum) for it in new for x in next(it).numpy())
        assert got == want


def test_version1_state_converts_inside_the_first_epoch(tmp_path):
    paths = write_files(tmp_path, make_stream(), [])
    dm = dm_for(paths, 8, 2, rank=1, world_size=2)
    v1 = {**dm.state_dict(), "version": 1, "blocks_consumed": 6}
    v1.pop("position")
    dm.load_state_dict(v1)
    assert dm.position == 12
    with pytest.raises(ValueError, match="past its first epoch"):
        dm.load_state_dict({**v1, "blocks_consumed": dm.n_blocks // 2 + 1})
    one = dm_for(paths, 8, 2)
    one.load_state_dict({**v1, "world_size": 1, "blocks_consumed": 3 * dm.n_blocks + 1})
    assert one.position == 3 * dm.n_blocks + 1  # one rank: the two orders are the same


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
    dm_for(paths, 8, 2, rank=1, world_size=3).load_state_dict(state)  # and the world size


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

    files = sorted((Path(__file__).parents[2] / "configs" / "data").glob("*.yaml"))
    assert {f.stem for f in files} >= {"offline_mix", "tokens", "files", "fineweb_edu"}
    for f in files:
        merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(f))
        if f.stem in ("tokens", "files"):  # paths: ??? must be given on the command line
            merged.paths = ["x.bin"]
        cfg = OmegaConf.to_object(merged)
        assert isinstance(cfg, DataConfig) and cfg.source == f.stem


def test_a_fifo_a_device_or_a_folder_is_named_for_what_it_is(tmp_path):
    """A data file that exists but is no regular file was reported as "does not exist"; a FIFO
    or /dev/zero would block or read without end if opened. Each is refused at once naming its
    kind, for token files (tokens source) and text inputs (files source) alike."""
    import os
    import re
    import time

    from train.data.build import spec_from_config

    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    cases = [(fifo, "is a FIFO (named pipe), not a regular file"),
             (tmp_path, "is a folder, not a regular file"),
             (tmp_path / "gone.bin", "does not exist")]
    if os.path.exists("/dev/zero"):
        cases.append((Path("/dev/zero"), "is a character device, not a regular file"))
    t0 = time.monotonic()
    for path, want in cases:
        with pytest.raises(DataError) as err:
            dm_for([str(path)], 8, 2)
        assert str(err.value) == f"token file {path} {want}" + (
            "" if want == "does not exist" else "; give a file of tokens or text on disk")
        with pytest.raises(DataError, match=re.escape(f"data.paths: input file {path} {want}")):
            spec_from_config(DataConfig(source="files", paths=[str(path)]))
    assert time.monotonic() - t0 < 10  # nothing blocked on the FIFO
