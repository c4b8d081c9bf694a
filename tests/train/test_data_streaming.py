"""fineweb_edu streaming path against a local jsonl stand-in (the hub is never contacted)."""

import json

import numpy as np
import pytest
import torch

from tests.train.test_data_corpus import byte_tok, expected_ids, split_docs  # noqa: F401 (fixture)
from train.data import DataConfig, build_datamodule
from train.data.build import is_val, norm_hash

VF = 0.2


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    d = tmp_path / "fineweb_standin"
    d.mkdir()
    docs = []
    for f in range(2):
        rows = [{"text": f"file {f} doc {i}: " + "word " * (i % 7 + 1), "id": i} for i in range(30)]
        rows.append({"text": "literal <|endoftext|> inside a document stays text", "id": 99})
        (d / f"part-{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        docs += [r["text"] for r in rows]
    return str(d), docs


def dm_for(hub_dir, tok, rank=0, world_size=1, seed=0, T=16, B=2):
    cfg = DataConfig(source="fineweb_edu", hub_dataset=hub_dir, tokenizer=tok, val_fraction=VF, shuffle_buffer=8)
    return build_datamodule(cfg, seq_len=T, micro_batch=B, seed=seed, rank=rank, world_size=world_size)


def whole_docs(stream):
    """Complete documents of a stream that may end mid-document."""
    return split_docs(stream[: np.flatnonzero(stream == 0)[-1] + 1])


def take_tokens(dm, n):
    it, out = dm.train_batches(), []
    while sum(x.numel() for x in out) < n:
        out.append(next(it).reshape(-1))
    return torch.cat(out).numpy()[:n]


def test_one_epoch_serves_every_training_document_once(hub, byte_tok):  # noqa: F811
    hub_dir, docs = hub
    train = [d for d in docs if not is_val(norm_hash(d), VF)]
    assert 0 < len(train) < len(docs)
    dm = dm_for(hub_dir, byte_tok)
    assert dm.vocab_size == 257 and dm.eos_id == 0
    n = sum(len(expected_ids(d)) for d in train)
    got = take_tokens(dm, n)
    assert sorted(split_docs(got)) == sorted(expected_ids(d)[:-1] for d in train)
    # Shuffled: not the file order; epoch 1 is in another order than epoch 0.
    assert split_docs(got) != [expected_ids(d)[:-1] for d in train]
    two = take_tokens(dm_for(hub_dir, byte_tok), 2 * n)
    assert split_docs(two[n:]) != split_docs(two[:n])
    assert sorted(split_docs(two[n:])) == sorted(split_docs(two[:n]))


def test_resume_and_ranks(hub, byte_tok):  # noqa: F811
    hub_dir, _ = hub
    ref = dm_for(hub_dir, byte_tok, rank=1, world_size=2)
    it = ref.train_batches()
    for _ in range(25):  # crosses this rank's epoch end (about 24 training docs ~ 330 tokens)
        next(it)
    state = json.loads(json.dumps(ref.state_dict()))  # survives JSON (checkpoint metadata)
    expected = [next(it) for _ in range(30)]
    assert ref.epoch >= 1
    fresh = dm_for(hub_dir, byte_tok, rank=1, world_size=2)
    fresh.load_state_dict(state)
    got = fresh.train_batches()
    for e in expected:
        torch.testing.assert_close(next(got), e, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rank"):
        dm_for(hub_dir, byte_tok, rank=0, world_size=2).load_state_dict(state)
    # Ranks read disjoint documents (one file each here).
    r0 = set(map(tuple, whole_docs(take_tokens(dm_for(hub_dir, byte_tok, rank=0, world_size=2), 200))))
    r1 = set(map(tuple, whole_docs(take_tokens(dm_for(hub_dir, byte_tok, rank=1, world_size=2), 200))))
    assert r0 and r1 and not (r0 & r1)


def test_micro_batch_is_read_at_every_batch(hub, byte_tok):  # noqa: F811
    """The trainer's uneven micro-batches (3, 3, 2 of a step of 8) set ``micro_batch`` before
    each draw: the batches take those sizes and the same tokens, in order, as batches of 2."""
    hub_dir, _ = hub
    ref = take_tokens(dm_for(hub_dir, byte_tok, B=2), 8 * 16)
    dm = dm_for(hub_dir, byte_tok, B=2)
    it, got = dm.train_batches(), []
    for size in (3, 3, 2):
        dm.micro_batch = size
        got.append(next(it))
    assert [x.shape for x in got] == [(3, 16), (3, 16), (2, 16)]
    assert np.array_equal(torch.cat(got).reshape(-1).numpy(), ref)


def test_val_batches_are_held_out_and_fixed(hub, byte_tok):  # noqa: F811
    hub_dir, docs = hub
    dm = dm_for(hub_dir, byte_tok, T=8, B=2)
    v1 = torch.cat([b.reshape(-1) for b in dm.val_batches()]).numpy()
    v2 = torch.cat([b.reshape(-1) for b in dm.val_batches()]).numpy()
    np.testing.assert_array_equal(v1, v2)
    val = [d for d in docs if is_val(norm_hash(d), VF)]
    want = np.concatenate([expected_ids(d) for d in val])  # unshuffled stream order
    np.testing.assert_array_equal(v1, want[: v1.size])
    assert v1.size == (want.size // 8) * 8
    assert len(list(dm.val_batches(max_batches=1))) == 1
