"""The hot set's helpers (``twell.ops.hot_units``): its checks (``check_hot_units``, through the
training op and alone) and how it is picked from the per-unit counts (``hot_unit_count``,
``hot_units_from_counts``), against hand-computed cases. The ops with a hot set: the training
op's in ``test_ffn_train.py`` (the hot/cold split section), the inference op's in
``test_ffn.py``. Shape legend: N tokens, D model width, H FFN width, k hot units.
"""

import pytest
import torch

from tests.ops.train_cases import make_inputs
from twell.ops.ffn_train import sparse_ffn_train
from twell.ops.hot_units import check_hot_units, hot_unit_count, hot_units_from_counts
from twell.policy import FFNPolicy


def test_bad_hot_units_name_the_argument():
    x, wg, wu, wd, _ = make_inputs(3, 16, 64)
    for bad, match in ((torch.tensor([0.5]), "integer"), (torch.zeros(2, 2, dtype=torch.long),
                                                           "1-D"),
                       (torch.tensor([64]), r"\[0, 64\)"), (torch.tensor([-1]), r"\[0, 64\)"),
                       (torch.tensor([3, 3]), "repeated"), (torch.arange(65), "more than H")):
        with pytest.raises(ValueError, match=f"sparse_ffn_train: hot_units.*{match}"):
            sparse_ffn_train(x, wg, wu, wd, backend="torch", hot_units=bad)
    assert check_hot_units(torch.tensor([], dtype=torch.int32), 64, x.device, "f") is None
    assert check_hot_units(torch.tensor([5, 2], dtype=torch.int32), 64, x.device,
                           "f").dtype == torch.int64


# --- picking the hot set ----------------------------------------------------------------------

def test_hot_unit_count_rounds_up_to_16_and_caps():
    """k = units above fraction * N, rounded up to a multiple of 16, capped (hand-computed)."""
    counts = torch.zeros(100, dtype=torch.int32)
    counts[:17] = 101  # 17 units above 6400 / 64 = 100 tokens
    counts[17] = 100  # exactly at the threshold: not hot
    assert hot_unit_count(counts, 6400) == 32
    assert hot_unit_count(counts.numpy(), 6400, FFNPolicy(max_hot_units=16)) == 16
    assert hot_unit_count(counts.tolist(), 6400, FFNPolicy(hot_unit_fraction=0.5)) == 0
    assert hot_unit_count(counts[:20], 6400) == 20  # capped at H
    assert hot_unit_count(counts, 0) == 0
    with pytest.raises(ValueError, match="1-D"):
        hot_unit_count(counts[None], 6400)


def test_hot_units_from_counts_top_k_ascending():
    counts = torch.tensor([5, 90, 3, 70, 0, 88, 1], dtype=torch.int32)
    assert hot_units_from_counts(counts, 100, 3).tolist() == [1, 3, 5]
    assert hot_units_from_counts(counts, 100, 0).tolist() == []
    assert hot_units_from_counts(counts, 100, 7).tolist() == list(range(7))
    # k from the policy (one host copy): 1/64 of 100 tokens = 1.56: units 0, 1, 2, 3, 5 -> 16,
    # capped at H = 7
    assert hot_units_from_counts(counts, 100).tolist() == list(range(7))
    pol = FFNPolicy(hot_unit_fraction=0.6, max_hot_units=16)
    assert hot_units_from_counts(counts, 100, policy=pol).tolist() == list(range(7))
    with pytest.raises(ValueError, match="k must be in"):
        hot_units_from_counts(counts, 100, 8)
