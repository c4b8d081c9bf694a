"""Hot/cold split of the sparse FFN ops (``hot_units``) and the helpers that pick the hot set.

Training: ``sparse_ffn_train(..., hot_units=S)`` against fp64 dense autograd (the references and
the verbose comparison of ``tests/ops/train_cases.py``): output, dx, dWg, dWu, dWd with the
L1 term in the loss, and the statistics of the whole FFN. Both backends: PyTorch in float64
(tight tolerance) and the Triton kernels in float32 (on CPU through ``TRITON_INTERPRET=1``).
Shape legend: N tokens, D model width, H FFN width, k hot units.
"""

import math

import pytest
import torch

from tests.ops.train_cases import (
    BACKEND_DTYPES,
    DEV,
    assert_close,
    check_case,
    make_inputs,
    needs_triton,
    reference,
    run_ours,
)
from twell.ops import ffn_train
from twell.ops.ffn_train import sparse_ffn_train
from twell.ops.hot_units import check_hot_units, hot_unit_count, hot_units_from_counts
from twell.policy import FFNPolicy


def make_case(n, d, h, *, seed, hot=3, threshold=1.5, zero_rows=(), dense_rows=()):
    """fp64 inputs (``make_inputs``) whose first ``hot`` units are active in every non-zero
    token, with all-zero tokens ``zero_rows`` and fully active tokens ``dense_rows`` (feature 1
    is 1 only there and its gate weight is +50, so every unit fires)."""
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=threshold, seed=seed, hot=hot,
                                    zero_rows=zero_rows)
    x[:, 1] = 0.0
    wg[:, 1] = 50.0
    for r in dense_rows:
        x[r, 1] = 1.0
    return x, wg, wu, wd, dy


def active(x, wg):
    """(N, H) bool: the gate fires (fp64)."""
    return ~((x @ wg.T) <= 0)


def cold_heavy(x, wg, hot, cap):
    """Tokens with more than ``cap`` active cold units (what the dense backup must hold)."""
    act = active(x, wg).clone()
    if hot is not None and hot.numel():
        act[:, hot] = False
    return int((act.sum(1) > cap).sum())


def hot_set(kind, x, wg, cap):
    """The hot set of a test case: none, empty, a few units (the always-active ones and two
    more), every unit, or units active in the heavy rows (also computed by the backup)."""
    h = wg.shape[0]
    if kind == "none":
        return None
    if kind == "empty":
        return torch.empty((0,), dtype=torch.int64)
    if kind == "few":
        return torch.tensor([0, 1, 2, h // 2, h - 1])
    if kind == "all":
        return torch.arange(h)
    act = active(x, wg)
    heavy = act.sum(1) > cap
    assert heavy.any()
    in_heavy = act[heavy].any(0).nonzero().reshape(-1)
    return in_heavy[:: max(1, in_heavy.numel() // 9)][:9]  # ~9 units, also 0..2


def run_case(x, wg, wu, wd, dy, hot, *, dtype, rel, backend, l1_coeff=0.5, **kw):
    hot_dev = None if hot is None else hot.to(DEV)
    return check_case(x, wg, wu, wd, dy, l1_coeff=l1_coeff, dtype=dtype, rel=rel,
                      backend=backend, hot_units=hot_dev, **kw)


# --- PyTorch backend, float64: every hot set, odd shapes, zero and fully dense rows -----------

@pytest.mark.parametrize("kind", ["none", "empty", "few", "all", "heavy"])
@pytest.mark.parametrize("n,d,h", [(1, 16, 64), (7, 23, 300), (1000, 24, 300)])
@pytest.mark.parametrize("mode", ["measure", "all_dense", "nosync"])
def test_torch_backend_fp64_hot_sets(kind, n, d, h, mode):
    x, wg, wu, wd, dy = make_case(n, d, h, seed=n + d, zero_rows=(0,) if n > 1 else (),
                                  dense_rows=(n - 1,) if n > 2 else ())
    cap = h // 16
    if kind == "heavy" and not (active(x, wg).sum(1) > cap).any():
        pytest.skip("no heavy row at this shape")
    hot = hot_set(kind, x, wg, cap)
    kw = {"ell_capacity": cap, "dense_row_fraction": 1.0}
    if mode == "all_dense":
        kw["dense_row_fraction"] = 0.0
    elif mode == "nosync":
        kw["backup_rows"] = cold_heavy(x, wg, hot, cap) + 2
        if cold_heavy(x, wg, hot, cap) > n - 1:  # the no-sync backup holds at most N - 1 rows
            pytest.skip("more heavy rows than a no-sync backup can hold")
    st = run_case(x, wg, wu, wd, dy, hot, dtype=torch.float64, rel=1e-10, backend="torch", **kw)
    assert st.heavy_rows.item() == cold_heavy(x, wg, hot, cap)


def test_l1_term_alone_reaches_the_hot_units():
    """dy = 0: the gradients are the L1 term's only; hot units carry most of them."""
    x, wg, wu, wd, _ = make_case(9, 16, 64, seed=3, dense_rows=(4,))
    dy = torch.zeros(9, 16, dtype=torch.float64)
    hot = torch.tensor([0, 1, 2, 40])
    run_case(x, wg, wu, wd, dy, hot, dtype=torch.float64, rel=1e-10, backend="torch",
             l1_coeff=0.7, ell_capacity=4, dense_row_fraction=1.0)
    _, _, g = run_ours(x, wg, wu, wd, dy, 0.7, torch.float64, backend="torch", ell_capacity=4,
                       hot_units=hot)
    assert g[1][hot[:3]].abs().amax().item() > 0  # dWg of the hot units: from the L1 term


def test_hot_units_shrink_the_heavy_rows():
    """Units active in every token push rows over the ELL capacity; as hot units they leave
    the ELL part, so fewer rows are heavy (and the statistics still count them)."""
    x, wg, wu, wd, dy = make_case(33, 40, 300, seed=5, hot=12)
    cap = 16
    hot = torch.arange(12)
    assert cold_heavy(x, wg, None, cap) > cold_heavy(x, wg, hot, cap)
    _, st_all, _ = run_ours(x, wg, wu, wd, dy, 0.5, torch.float64, backend="torch",
                            ell_capacity=cap)
    _, st_hot, _ = run_ours(x, wg, wu, wd, dy, 0.5, torch.float64, backend="torch",
                            ell_capacity=cap, hot_units=hot)
    assert st_all.heavy_rows.item() == cold_heavy(x, wg, None, cap)
    assert st_hot.heavy_rows.item() == cold_heavy(x, wg, hot, cap)
    assert st_hot.nnz_sum.item() == st_all.nnz_sum.item() == active(x, wg).sum().item()
    assert torch.equal(st_hot.active_counts, st_all.active_counts)


# --- Triton kernels, float32 ---------------------------------------------------------------

TRITON_HOT_CASES = [  # (n, d, h, kind, ell_capacity, dense_row_fraction)
    (1, 16, 64, "all", 4, 1.0),
    (7, 23, 300, "few", 20, 1.0),  # odd D, H not a multiple of 256, one fully dense row
    (33, 40, 300, "heavy", 10, 1.0),  # hot units that are also in the dense backup's rows
    (33, 40, 300, "few", 10, 0.0),  # the all-dense fallback
]


@needs_triton
@pytest.mark.parametrize("n,d,h,kind,cap,frac", TRITON_HOT_CASES)
def test_triton_fp32_hot_sets(n, d, h, kind, cap, frac):
    x, wg, wu, wd, dy = make_case(n, d, h, seed=n + h, zero_rows=(0,) if n > 1 else (),
                                  dense_rows=(n - 1,) if n > 2 else ())
    hot = hot_set(kind, x, wg, cap)
    st = run_case(x, wg, wu, wd, dy, hot, dtype=torch.float32, rel=2e-5, backend="triton",
                  ell_capacity=cap, dense_row_fraction=frac)
    assert st.heavy_rows.item() == cold_heavy(x, wg, hot, cap)


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_nosync_with_hot_units_exact_and_overflow_reported(backend, dtype, rel):
    """No-sync capacity >= the cold heavy rows: exact. Below it: the statistics report the true
    cold count (> capacity) and exactly the rows left out differ from the reference."""
    x, wg, wu, wd, dy = make_case(33, 40, 300, seed=21, hot=6, dense_rows=(5, 9))
    hot = torch.tensor([0, 1, 2, 3, 4, 5, 150])
    r = cold_heavy(x, wg, hot, 20)
    assert 2 < r < cold_heavy(x, wg, None, 20)
    run_case(x, wg, wu, wd, dy, hot, dtype=dtype, rel=rel, backend=backend, ell_capacity=20,
             backup_rows=r)
    y_r, _, _ = reference(x, wg, wu, wd, dy, 0.5)
    y, st, _ = run_ours(x, wg, wu, wd, dy, 0.5, dtype, ell_capacity=20, backend=backend,
                        backup_rows=r - 2, hot_units=hot.to(DEV))
    assert st.heavy_rows.item() == r
    bad = ((y.double().cpu() - y_r).abs().amax(1) > 1e-3 * y_r.abs().max()).sum().item()
    assert bad == 2


NONFINITE = [float("nan"), float("inf"), float("-inf")]
HOT_PATHS = [("backup", {}), ("ell", {"ell_capacity": 64, "dense_row_fraction": 1.0}),
             ("all_dense", {"dense_row_fraction": 0.0}), ("nosync", {"backup_rows": None})]


@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path,opts", HOT_PATHS, ids=[p for p, _ in HOT_PATHS])
@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_nonfinite_row_with_hot_units(backend, dtype, rel, path, opts, value):
    """A NaN / inf in x[3]: as fp64 dense PyTorch, y[3] and dx[3] non-finite, the L1 term
    non-finite, every other row exact; the hot units' slice is dense math, so where the rest
    runs dense math (backup, all-dense, no-sync) every output's non-finite pattern equals the
    reference's. A NaN gate counts as active in the hot units too (statistics)."""
    x, wg, wu, wd, dy = make_inputs(9, 16, 64, threshold=1.5, seed=61, hot=2)
    x = x.clone()
    x[3, 5] = value
    hot = torch.tensor([0, 1, 30]).to(DEV)
    ok = [i for i in range(9) if i != 3]
    y_r, st_r, g_r = reference(x, wg, wu, wd, dy, 0.5)
    kw = dict(opts)
    if path == "nosync":
        _, st0, _ = run_ours(x, wg, wu, wd, dy, 0.5, dtype, backend=backend, hot_units=hot)
        kw["backup_rows"] = int(st0.heavy_rows.item())
        assert kw["backup_rows"] >= 1
    y, st, g = run_ours(x, wg, wu, wd, dy, 0.5, dtype, backend=backend, hot_units=hot, **kw)
    y, g = y.cpu(), [t.cpu() for t in g]
    assert not torch.isfinite(y[3]).any() and not torch.isfinite(g[0][3]).any()
    assert not torch.isfinite(st.l1).item()
    assert_close("y (finite rows)", y[ok], y_r[ok], rel)
    assert_close("dx (finite rows)", g[0][ok], g_r[0][ok], rel)
    for name, a, b in zip(("dWg", "dWu", "dWd"), g[1:], g_r[1:]):
        assert not torch.isfinite(a).all(), name
        if path != "ell":
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name
    if path != "ell":
        assert torch.equal(torch.isfinite(y), torch.isfinite(y_r))
        assert torch.equal(torch.isfinite(g[0]), torch.isfinite(g_r[0]))
    if math.isnan(value):
        assert torch.equal(st.active_counts.cpu(), st_r.active_counts)


def test_hot_units_trace_compile_and_checkpoint():
    """The op with a hot set traces (fake impl: (N, k) saved slices), checkpoints, and passes
    opcheck."""
    from tests.ops.train_cases import check_compiled_and_checkpointed

    x, wg, wu, wd, dy = make_case(13, 16, 64, seed=12, threshold=0.8)
    hot = torch.tensor([0, 1, 2, 33])

    def f(x, wg, wu, wd, dy):
        y, st = sparse_ffn_train(x, wg, wu, wd, backend="torch", ell_capacity=8, hot_units=hot)
        return (y * dy).sum() + 0.5 * st.l1

    check_compiled_and_checkpointed(f, x, wg, wu, wd, dy)
    args = tuple(t.float() for t in (x, wg, wu, wd)) + (8, 1.0, "torch", -1, hot)
    torch.library.opcheck(ffn_train._ffn_train_fwd, args)


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


def test_policy_hot_fields_validated():
    assert (FFNPolicy().hot_unit_fraction, FFNPolicy().max_hot_units) == (1 / 64, 512)
    with pytest.raises(ValueError, match="FFNPolicy.hot_unit_fraction"):
        FFNPolicy(hot_unit_fraction=1.5)
    with pytest.raises(ValueError, match="FFNPolicy.max_hot_units"):
        FFNPolicy(max_hot_units=-16)
