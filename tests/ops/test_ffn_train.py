"""The ``ell`` training path of the gated FFN (``twell.ops.ffn_train.sparse_ffn_train``: hybrid ELL
+ dense backup) against fp64 dense autograd.

Reference: ``twell.ops.reference.gated_ffn_torch`` in float64 with PyTorch autograd; loss
``sum(y * dy) + c * l1``. Both backends are checked: the pure-PyTorch one in float64 (tight
tolerance) and the Triton kernels in float32 (on CPU through ``TRITON_INTERPRET=1``, set by
tests/conftest.py when no GPU is present), with the kernels' launch shapes swept through the
op; the no-sync mode, non-finite inputs on every training path (dense mode included), the saved
state, and the hot/cold split (``hot_units=S``: the hot units dense, the cold ones in the ELL op;
every hot set, zero and fully dense rows, the no-sync mode, non-finite rows); the hot set's
helpers: ``test_hot_units.py``. Dense mode alone: ``test_ffn_dense_train.py``; the kernels alone: ``test_compact.py``,
``test_sddmm.py``, ``test_spmm.py``, ``test_dw.py``, ``test_elementwise.py``. Shape legend: N
tokens, D model width, H FFN width.
"""

import math

import pytest
import torch

from twell.ops import ffn_dense_train, ffn_train
from twell.ops.ffn_train import sparse_ffn_train
from twell.ops.reference import gated_ffn_torch
from twell.stats import default_ell_capacity

from .train_cases import (
    BACKEND_DTYPES,
    DEV,
    assert_close,
    check_case,
    check_compiled_and_checkpointed,
    loss_grads,
    make_inputs,
    needs_triton,
    reference,
    run_ours,
)


def n_heavy(x, wg, cap):
    """Rows with more active units than the ELL capacity ``cap`` (they go to the dense backup)."""
    return int((((x @ wg.T) > 0).sum(1) > cap).sum())


# --- PyTorch backend, float64: the sparse math itself, many shapes -------------------------


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("d", [16, 40])
@pytest.mark.parametrize("h", [64, 300])
@pytest.mark.parametrize("l1_coeff", [0.0, 0.5])
@pytest.mark.parametrize("cap", ["all_light", "mixed"])
def test_torch_backend_fp64(n, d, h, l1_coeff, cap):
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=1.5, seed=n + d + h)
    kw = {"ell_capacity": h if cap == "all_light" else h // 16, "dense_row_fraction": 1.0}
    if cap == "mixed" and n > 1:
        assert 0 < n_heavy(x, wg, h // 16) < n  # both ELL rows and dense-backup rows
    st = check_case(x, wg, wu, wd, dy, l1_coeff=l1_coeff, dtype=torch.float64, rel=1e-10,
                    backend="torch", **kw)
    assert st.nnz_sum.item() > 0


# --- Triton kernels, float32 ----------------------------------------------------------------


TRITON_CASES = [  # (n, d, h, ell_capacity, dense_row_fraction, l1_coeff)
    (1, 16, 64, 64, 1.0, 0.5),
    (7, 16, 64, 4, 1.0, 0.5),  # rows above capacity mixed with light rows
    (33, 40, 300, 300, 1.0, 0.0),  # all rows in ELL
    (33, 40, 300, 20, 1.0, 0.5),  # mixed, odd widths
    (33, 40, 300, 10, 0.5, 0.5),  # policy: too many heavy rows -> all through the dense backup
    (33, 40, 300, 0, 0.5, 0.5),  # default capacity and policy
]


@needs_triton
@pytest.mark.parametrize("n,d,h,cap,frac,l1_coeff", TRITON_CASES)
def test_triton_fp32(n, d, h, cap, frac, l1_coeff):
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=1.5, seed=3 * n + h)
    if (cap, frac) == (20, 1.0) or (n, cap) == (7, 4):
        assert 0 < n_heavy(x, wg, cap) < n
    if frac == 0.5 and cap:
        assert n_heavy(x, wg, cap) > n // 2
    check_case(x, wg, wu, wd, dy, l1_coeff=l1_coeff, dtype=torch.float32, rel=2e-5,
               ell_capacity=cap, dense_row_fraction=frac, backend="triton")


# Launch shapes: the defaults, and tiny blocks so every loop runs several steps and D is split
# over several programs (D = 40 in slices of 16; 2 slots / entries per step; 4 rows per
# compaction program).
KERNEL_CONFIGS = {
    "default": {},
    "small": {"compact_block_n": 4, "compact_warps": 2, "spmm_block_k": 2, "spmm_block_k2": 2,
              "spmm_block_d": 16, "dw_block_j": 2, "dw_block_d": 16, "sddmm_block_k": 2,
              "sddmm_block_d": 16},
    "compact_2rows": {"compact_block_n": 2, "compact_warps": 2},
    # dW grid with the D slice outermost, D = 40 in three slices of 16
    "dw_d_outer": {"dw_d_outer": 1, "dw_block_d": 16, "dw_block_j": 2},
    # dW with one warp and 4 entries a step (several steps per column)
    "dw_1warp": {"dw_block_j": 4, "dw_warps": 1, "dw_block_d": 16},
}


@needs_triton
@pytest.mark.parametrize("config", sorted(KERNEL_CONFIGS))
@pytest.mark.parametrize("case", ["mixed", "hot"])
def test_triton_kernel_variants(config, case):
    from twell.ops.launch import kernel_config

    if case == "mixed":  # heavy rows + light rows of up to ~40 slots, odd N, D, H
        x, wg, wu, wd, dy = make_inputs(33, 40, 300, threshold=1.5, seed=21)
        kw = {"ell_capacity": 20, "dense_row_fraction": 1.0}
        assert 0 < n_heavy(x, wg, 20) < 33
    else:  # units active in every non-zero token (long CSC columns), all-zero tokens
        x, wg, wu, wd, dy = make_inputs(21, 40, 96, threshold=1.5, seed=22, hot=3,
                                        zero_rows=(0, 4))
        kw = {"ell_capacity": 48, "dense_row_fraction": 1.0}
    with kernel_config(**KERNEL_CONFIGS[config]):
        check_case(x, wg, wu, wd, dy, l1_coeff=0.5, dtype=torch.float32, rel=2e-5,
                   backend="triton", **kw)


# --- Edge cases, both backends ---------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_hot_neurons_and_zero_rows(backend, dtype, rel):
    """Units active in every token (long CSC columns) and tokens with no active unit."""
    x, wg, wu, wd, dy = make_inputs(21, 24, 96, threshold=1.5, seed=5, hot=3, zero_rows=(0, 4))
    st = check_case(x, wg, wu, wd, dy, l1_coeff=0.3, dtype=dtype, rel=rel, backend=backend,
                    ell_capacity=8, dense_row_fraction=1.0)
    assert (st.active_counts[:3] == 19).all()  # hot units: every non-zero token
    _, _, g = run_ours(x, wg, wu, wd, dy, 0.3, dtype, backend=backend, ell_capacity=8,
                       dense_row_fraction=1.0)
    assert g[0][0].abs().max().item() == 0.0  # zero token: no active unit, no gradient


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
@pytest.mark.parametrize("frac", [1.0, 0.5])
def test_every_row_heavy(backend, dtype, rel, frac):
    """Capacity 1 with ~25% density: every row overflows; nothing may be dropped."""
    x, wg, wu, wd, dy = make_inputs(9, 16, 64, threshold=0.7, seed=7)
    st = check_case(x, wg, wu, wd, dy, l1_coeff=0.5, dtype=dtype, rel=rel, backend=backend,
                    ell_capacity=1, dense_row_fraction=frac)
    assert st.nnz_max.item() > 1


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_no_active_unit_at_all(backend, dtype, rel):
    x, wg, wu, wd, dy = make_inputs(5, 16, 64, threshold=1e3, seed=8)
    y, st, g = run_ours(x, wg, wu, wd, dy, 0.5, dtype, backend=backend)
    assert y.abs().max().item() == 0.0 and st.nnz_sum.item() == 0 and st.l1.item() == 0.0
    for t in g:
        assert t.abs().max().item() == 0.0


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_zero_upstream_gradient(backend, dtype, rel):
    """dy = 0: without L1 every gradient is exactly 0; with L1 only the L1 term remains."""
    x, wg, wu, wd, _ = make_inputs(11, 16, 64, threshold=1.5, seed=9)
    dy = torch.zeros(11, 16, dtype=torch.float64)
    _, _, g = run_ours(x, wg, wu, wd, dy, 0.0, dtype, backend=backend, ell_capacity=4,
                       dense_row_fraction=1.0)
    for t in g:
        assert t.abs().max().item() == 0.0
    check_case(x, wg, wu, wd, dy, l1_coeff=0.7, dtype=dtype, rel=rel, backend=backend,
               ell_capacity=4, dense_row_fraction=1.0)


def test_l1_unused_gives_no_l1_gradient():
    """with_stats=False (or l1 not in the loss): gradients of sum(y * dy) alone."""
    x, wg, wu, wd, dy = make_inputs(7, 16, 64, seed=10)
    _, _, g_r = reference(x, wg, wu, wd, dy, 0.0)
    ins = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    y, st = sparse_ffn_train(*ins, with_stats=False, backend="torch", ell_capacity=4)
    assert st is None
    (y * dy).sum().backward()
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), [t.grad for t in ins], g_r):
        assert_close(name, a, b, 1e-10)


# --- Framework integration ---------------------------------------------------------------------


def _loss_fn(backend):
    def f(x, wg, wu, wd, dy):
        y, st = sparse_ffn_train(x, wg, wu, wd, backend=backend, ell_capacity=4,
                                 dense_row_fraction=1.0)
        return (y * dy).sum() + 0.5 * st.l1
    return f


def test_torch_compile_fullgraph():
    """The op traces (fake impl with measured K and R as unbacked sizes) and matches eager."""
    x, wg, wu, wd, dy = make_inputs(7, 16, 64, seed=11)
    torch._dynamo.reset()
    compiled = torch.compile(_loss_fn("torch"), backend="aot_eager", fullgraph=True)
    _, _, g_r = reference(x, wg, wu, wd, dy, 0.5)
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), loss_grads(compiled, x, wg, wu, wd, dy), g_r):
        assert_close(name, a, b, 1e-5)


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=needs_triton)])
def test_checkpoint_non_reentrant(backend):
    from torch.utils.checkpoint import checkpoint

    x, wg, wu, wd, dy = make_inputs(13, 16, 64, seed=12)
    f = _loss_fn(backend)

    def ck(*a):
        return checkpoint(f, *a, use_reentrant=False)

    _, _, g_r = reference(x, wg, wu, wd, dy, 0.5)
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), loss_grads(ck, x, wg, wu, wd, dy), g_r):
        assert_close(name, a, b, 2e-5)


def test_bf16_autocast_fp32_master_weights():
    """Under autocast the op computes in bf16 and fp32 weights receive fp32 gradients that agree
    with the dense path under the same autocast (both bf16-rounded)."""
    x, wg, wu, wd, dy = make_inputs(16, 32, 128, threshold=1.0, seed=13)
    out = {}
    for impl in ("dense", "sparse"):
        ins = [t.float().clone().requires_grad_() for t in (x, wg, wu, wd)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if impl == "dense":
                y, st = gated_ffn_torch(*ins)
            else:
                y, st = sparse_ffn_train(*ins, backend="torch", ell_capacity=16,
                                         dense_row_fraction=1.0)
            assert y.dtype == torch.bfloat16
            ((y.float() * dy.float()).sum() + 0.5 * st.l1).backward()
        assert all(t.grad.dtype == torch.float32 for t in ins)
        out[impl] = (y, [t.grad for t in ins])
    assert_close("y", out["sparse"][0], out["dense"][0], 3e-2)
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), out["sparse"][1], out["dense"][1]):
        assert_close(name, a, b, 3e-2)


@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["ell", "all_dense"])
def test_opcheck(fraction):
    """The op's schema, fake kernel and autograd registration; the all-dense branch too (its
    unread outputs are zeros, so eager and AOT-compiled calls agree)."""
    x, wg, wu, wd, _ = make_inputs(7, 16, 64, seed=14)
    args = tuple(t.float() for t in (x, wg, wu, wd)) + (4, fraction, "torch")
    torch.library.opcheck(ffn_train._ffn_train_fwd, args)


def test_bad_inputs_name_the_argument():
    x, wg, wu, wd, _ = make_inputs(3, 16, 64)
    with pytest.raises(ValueError, match="w_down_DH"):
        sparse_ffn_train(x, wg, wu, wd.t())
    with pytest.raises(ValueError, match="x_ND must be 2-D"):
        sparse_ffn_train(x[None], wg, wu, wd)
    with pytest.raises(ValueError, match="w_gate_HD"):
        sparse_ffn_train(x, None, wu, wd)
    with pytest.raises(ValueError, match="ell_capacity"):
        sparse_ffn_train(x, wg, wu, wd, ell_capacity=-1)
    with pytest.raises(ValueError, match="backend"):
        sparse_ffn_train(x, wg, wu, wd, backend="cuda")


def test_default_capacity_matches_paper_width():
    assert default_ell_capacity(5632) == 128
    assert default_ell_capacity(8) == 8


def test_l1_gradient_is_not_rounded_away_under_bf16_autocast():
    """The L1 term's share of the weight gradients, under bf16 autocast with fp32 master weights,
    against fp64 autograd of the same loss: the ell path adds ``scale * sign(h)`` to the fp32
    dh before anything is rounded, so its L1 share matches fp64 (measured 0.999 / 1.011 for dWg /
    dWu). The dense PyTorch path (bf16 h, bf16 gradient accumulation) kept only ~0.15 of it in
    the same setup, which is why its runs end denser (BENCHMARKS.md, "Training FFN"). Dense
    mode (``dense_ffn_train``) adds the L1 term in fp32 too, but stores dg / du in bf16 for its
    cuBLAS products, so it keeps the torch path's share (asserted equal within 0.05)."""
    torch.manual_seed(0)
    n, d, h, coeff = 2048, 256, 704, 3e-4
    x = torch.randn(n, d)
    wg = torch.randn(h, d) * 0.05
    wg[:, 0], x[:, 0] = -2.0, 1.0  # ~0.6 % of units active: every row on the ELL path
    wu, wd = torch.randn(h, d) * 0.05, torch.randn(d, h) * 0.05
    dy = torch.randn(n, d) / n  # a mean-over-tokens upstream gradient, as from the CE loss

    def grads(fn, dtype, l1, autocast):
        ins = [t.to(dtype).clone().requires_grad_() for t in (x, wg, wu, wd)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, st = fn(*ins)
            loss = (y.float() * dy.to(dtype)).sum() + l1 * st.l1.float()
        loss.backward()
        return [t.grad.double() for t in ins]

    def torch_path(*a):
        return gated_ffn_torch(*a, with_stats=True)

    def sparse_path(*a):
        return sparse_ffn_train(*a, with_stats=True, backend="torch")

    ref = [a - b for a, b in zip(grads(torch_path, torch.float64, coeff, False),
                                 grads(torch_path, torch.float64, 0.0, False))]
    share = {}
    def dense_path(*a):
        return ffn_dense_train.dense_ffn_train(*a, with_stats=True, backend="torch")

    for name, fn in (("sparse", sparse_path), ("dense", dense_path), ("torch", torch_path)):
        got = [a - b for a, b in zip(grads(fn, torch.float32, coeff, True),
                                     grads(fn, torch.float32, 0.0, True))]
        share[name] = [float((g * r).sum() / (r * r).sum()) for g, r in zip(got[1:3], ref[1:3])]
    print("L1 share of dWg, dWu vs fp64:", share)
    for s in share["sparse"]:
        assert 0.9 < s < 1.1, share
    # dense mode stores dg / du in bf16 for cuBLAS: the L1 share is rounded like the torch path's
    for a, b in zip(share["dense"], share["torch"]):
        assert abs(a - b) < 0.05, share


def test_heavy_rows_statistic_counts_tokens_above_the_ell_capacity():
    """FFNStats.heavy_rows (read by ffn_impl=auto): tokens with more active units than the ELL
    capacity in effect, equal on the ell path, dense mode and the PyTorch path."""
    from twell.stats import default_ell_capacity

    x, wg, wu, wd, _ = make_inputs(33, 40, 300, threshold=0.8, seed=41, zero_rows=(2,))
    nnz = ((x @ wg.T) > 0).sum(1)
    kc = default_ell_capacity(300)
    assert 0 < int((nnz > kc).sum()) < 33  # some heavy rows, not all
    _, st_t = gated_ffn_torch(x, wg, wu, wd)
    _, st_d = ffn_dense_train.dense_ffn_train(x, wg, wu, wd, backend="torch")
    _, st_s = sparse_ffn_train(x, wg, wu, wd, backend="torch", dense_row_fraction=1.0)
    for st in (st_t, st_d, st_s):
        assert st.heavy_rows.item() == int((nnz > kc).sum())
    _, st_c = sparse_ffn_train(x, wg, wu, wd, backend="torch", ell_capacity=4)
    assert st_c.heavy_rows.item() == int((nnz > 4).sum())


# --- no-sync mode (backup_rows >= 0): the dense backup's capacity comes from the caller ------


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
@pytest.mark.parametrize("extra", [0, 5])
def test_nosync_backup_capacity_exact_when_it_holds_the_heavy_rows(backend, dtype, rel, extra):
    """With a capacity >= R (the heavy rows), the no-sync forward and backward equal fp64
    autograd: the heavy rows fill the backup in row order, the unused rows (extra) add zeros."""
    x, wg, wu, wd, dy = make_inputs(33, 40, 300, threshold=1.5, seed=21)
    r = n_heavy(x, wg, 20)
    assert 0 < r < 33
    st = check_case(x, wg, wu, wd, dy, l1_coeff=0.5, dtype=dtype, rel=rel, ell_capacity=20,
                    backend=backend, backup_rows=r + extra)
    assert st.heavy_rows.item() == r


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_nosync_without_heavy_rows_and_with_too_small_a_capacity(backend, dtype, rel):
    """No heavy row: any capacity (0, or all padding) is exact. Capacity below R: the stats
    report the true R (> capacity) so the caller sees that the call must be redone, and the
    output of the rows left out is not the reference's (nothing hides it)."""
    x, wg, wu, wd, dy = make_inputs(33, 40, 300, threshold=1.5, seed=21)
    for cap in (0, 3):
        check_case(x, wg, wu, wd, dy, l1_coeff=0.5, dtype=dtype, rel=rel, ell_capacity=64,
                   backend=backend, backup_rows=cap)
    r = n_heavy(x, wg, 20)
    y_r, _, _ = reference(x, wg, wu, wd, dy, 0.5)
    y, st, _ = run_ours(x, wg, wu, wd, dy, 0.5, dtype, ell_capacity=20, backend=backend,
                        backup_rows=r - 2)
    assert st.heavy_rows.item() == r > r - 2
    bad_rows = ((y.double().cpu() - y_r).abs().amax(1) > 1e-3 * y_r.abs().max()).sum().item()
    assert bad_rows == 2


@pytest.mark.parametrize("backup_rows", [0, 20])
def test_nosync_gate_is_freed_before_the_ell_forward(monkeypatch, backup_rows):
    """In the no-sync mode the (N, H) gate pre-activation is no longer alive when the ELL
    forward (SDDMM + SpMM) runs: it would add N x H to the layer's peak beside u and y. Counted
    by the live tensors of shape (N, H) (N = 37, H = 300 match no other tensor of the call)."""
    import gc

    x, wg, wu, wd, _ = make_inputs(37, 24, 300, threshold=1.5, seed=21)
    live = []
    ell_fwd = ffn_train._ell_fwd

    def is_gate(o):
        try:
            # type(), not isinstance(): isinstance reads o.__class__, and torch.distributed's
            # deprecated module proxies warn on every attribute read
            return issubclass(type(o), torch.Tensor) and tuple(o.shape) == (37, 300)
        except Exception:  # noqa: BLE001 (other tests' fake tensors with unbacked sizes)
            return False

    def counting(*args):
        gc.collect()
        live.append(sum(1 for o in gc.get_objects() if is_gate(o)))
        return ell_fwd(*args)

    monkeypatch.setattr(ffn_train, "_ell_fwd", counting)
    _, st = sparse_ffn_train(x.float(), wg.float(), wu.float(), wd.float(), ell_capacity=20,
                             backend="torch", backup_rows=backup_rows)
    assert live == [0]
    assert st.heavy_rows.item() == 15  # heavy rows: with 20 the backup gathered them all


@needs_triton
def test_nosync_triton_adds_rows_without_index_add(monkeypatch):
    """On the Triton backend the no-sync call adds its dense-backup rows into y and dx, and the
    hot units' rows into dWg, dWu and dWd^T, with ``add_rows`` (no atomics; its unused slots,
    index N, skipped), not ``index_add_``: the only ``index_add_`` left is the hot units' int32
    counts. Results equal fp64 autograd."""
    from twell.ops.train_backend import triton_backend

    be = triton_backend()
    calls, index_adds = [], []
    add_rows, index_add_ = be.add_rows, torch.Tensor.index_add_

    def record_add_rows(dst, idx, src):
        calls.append((tuple(dst.shape), int(idx.max())))
        return add_rows(dst, idx, src)

    def record_index_add_(t, *args, **kw):
        index_adds.append(t.dtype)
        return index_add_(t, *args, **kw)

    monkeypatch.setattr(be, "add_rows", record_add_rows)
    monkeypatch.setattr(torch.Tensor, "index_add_", record_index_add_)
    n, d, h = 33, 40, 300
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=1.5, seed=21, hot=3)
    hot = torch.tensor([0, 1, 2, 150])
    r = n_heavy(x, wg, 20)  # hot units counted too: more than the cold heavy rows
    check_case(x, wg, wu, wd, dy, l1_coeff=0.5, dtype=torch.float32, rel=2e-5, ell_capacity=20,
               backend="triton", backup_rows=r + 3, hot_units=hot)
    assert index_adds == [torch.int32]
    assert sorted(calls) == sorted([((n, d), n), ((n, d), n)] + [((h, d), 150)] * 3)


def test_nosync_traces_with_static_shapes_and_checkpoints():
    x, wg, wu, wd, dy = make_inputs(13, 16, 64, seed=12, threshold=0.5)
    r = n_heavy(x, wg, 16)
    assert r > 0

    def f(x, wg, wu, wd, dy):
        y, st = sparse_ffn_train(x, wg, wu, wd, backend="torch", ell_capacity=16,
                                 backup_rows=r + 1)
        return (y * dy).sum() + 0.5 * st.l1

    check_compiled_and_checkpointed(f, x, wg, wu, wd, dy)
    with pytest.raises(ValueError, match="with_stats"):
        sparse_ffn_train(x, wg, wu, wd, with_stats=False, backup_rows=2)


def test_backup_capacity_for_measured_heavy_rows():
    """No heavy row: capacity 0 (no backup work at all); else 1.25 x the count + 16 rows."""
    assert ffn_train.backup_capacity_for(0) == 0
    assert ffn_train.backup_capacity_for(1) == 18
    assert ffn_train.backup_capacity_for(100.0) == 141


# --- non-finite inputs: NaN / inf in one input row reach that row's output and every gradient ---


NONFINITE = [float("nan"), float("inf"), float("-inf")]
# (path, backend, options): the heavy-row dense backup (a NaN row has every unit active: heavy),
# the ELL kernels themselves (capacity H: the non-finite row stays in the ELL part), the op's
# all-dense fallback, the no-sync mode with a capacity that holds the heavy rows, and dense mode
TRAIN_PATHS = [("backup", {}), ("ell", {"ell_capacity": 64, "dense_row_fraction": 1.0}),
               ("all_dense", {"dense_row_fraction": 0.0}), ("nosync", {"backup_rows": None}),
               ("dense", {})]


def _nonfinite_case(value):
    x, wg, wu, wd, dy = make_inputs(9, 16, 64, threshold=1.5, seed=61)
    x = x.clone()
    x[3, 5] = value  # row 3: every gate and up value is non-finite
    return x, wg, wu, wd, dy


def _reference_with_nonfinite(x, wg, wu, wd, dy, l1_coeff):
    """fp64 dense autograd of sum(y * dy) + c * l1 (``reference`` asserts nothing: NaN allowed)."""
    return reference(x, wg, wu, wd, dy, l1_coeff)


@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path,opts", TRAIN_PATHS, ids=[p for p, _ in TRAIN_PATHS])
@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_nonfinite_input_row_reaches_its_output_and_every_gradient(backend, dtype, rel, path, opts,
                                                                   value):
    """A NaN / inf in x[r] gives, as fp64 dense PyTorch does: y[r] and dx[r] non-finite, a
    non-finite L1 term, non-finite entries in dWg, dWu and dWd, and every other row of y and dx
    unchanged. A NaN gate counts as active (``not (g <= 0)``), so a NaN row is heavy and takes
    the dense backup; on the paths that run dense math for that row (dense backup, all-dense,
    no-sync, dense mode) the non-finite pattern of every output equals the reference's. On the
    ELL path inactive units are exact zeros (an -inf gate adds no 0 * inf), so only "contains
    non-finite" is required of the weight gradients there."""
    x, wg, wu, wd, dy = _nonfinite_case(value)
    r, ok = 3, [i for i in range(9) if i != 3]
    y_r, _, g_r = _reference_with_nonfinite(x, wg, wu, wd, dy, 0.5)
    assert not torch.isfinite(y_r[r]).any() and torch.isfinite(y_r[ok]).all()
    kw = dict(opts)
    fn = ffn_dense_train.dense_ffn_train if path == "dense" else sparse_ffn_train
    if path == "nosync":  # the capacity from a measuring call, as the trainer does
        _, st0, _ = run_ours(x, wg, wu, wd, dy, 0.5, dtype, backend=backend)
        kw["backup_rows"] = int(st0.heavy_rows.item())
        assert kw["backup_rows"] >= 1
    y, st, g = run_ours(x, wg, wu, wd, dy, 0.5, dtype, fn=fn, backend=backend, **kw)
    y, g = y.cpu(), [t.cpu() for t in g]
    assert not torch.isfinite(y[r]).any(), f"y[{r}] = {y[r]}"
    assert not torch.isfinite(st.l1).item()
    assert not torch.isfinite(g[0][r]).any(), f"dx[{r}] = {g[0][r]}"
    assert_close("y (finite rows)", y[ok], y_r[ok], rel)
    assert_close("dx (finite rows)", g[0][ok], g_r[0][ok], rel)
    for name, a, b in zip(("dWg", "dWu", "dWd"), g[1:], g_r[1:]):
        assert not torch.isfinite(a).all(), f"{name} is all finite"
        if path != "ell":
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name
    if path != "ell":
        assert torch.equal(torch.isfinite(y), torch.isfinite(y_r))
        assert torch.equal(torch.isfinite(g[0]), torch.isfinite(g_r[0]))


def test_saved_state_between_forward_and_backward_is_what_the_layout_says():
    """What the op keeps for backward, byte for byte (the activation memory of an ``ell``
    layer): x and the three weights (the caller's tensors), nnz_eff (N int32), the ELL columns
    (N x KC int32), g and u at the slots (N x KC), the heavy rows' indices (R int64) and their
    gate and up (R x H each), the CSC order (perm N x KC int32, colptr H + 1 and order H int64),
    nothing else: no transposed Wd copy (the backward makes it)."""
    n, d, h, kc = 33, 40, 300, 20
    x, wg, wu, wd, _ = make_inputs(n, d, h, threshold=1.5, seed=21)
    r = n_heavy(x, wg, kc)
    assert 0 < r < n
    ins = [t.float().requires_grad_() for t in (x, wg, wu, wd)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, st = sparse_ffn_train(*ins, ell_capacity=kc, dense_row_fraction=1.0, backend="torch")
    inputs = {t.data_ptr() for t in ins}
    state = [t for t in saved if t.data_ptr() not in inputs]
    got = sorted((tuple(t.shape), str(t.dtype)) for t in state if t.numel())
    f32, i32, i64 = "torch.float32", "torch.int32", "torch.int64"
    want = sorted([((n,), i32), ((n, kc), i32), ((n, kc), f32), ((n, kc), f32), ((r,), i64),
                   ((r, h), f32), ((r, h), f32), ((n * kc,), i32), ((h + 1,), i64), ((h,), i64)])
    assert got == want
    ((y * torch.ones_like(y)).sum() + st.l1).backward()  # the backward runs from that state
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in ins)


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=needs_triton)])
@pytest.mark.parametrize("hot", [None, (0, 7, 150)], ids=["cold", "hot"])  # hot units added too
@pytest.mark.parametrize("dense_row_fraction", [1.0, 0.0])  # ELL with backup rows; all-dense
def test_under_autocast_the_saved_state_holds_the_master_weights_not_copies(dense_row_fraction,
                                                                           hot, backend):
    """Under bf16 autocast with fp32 master weights the op keeps the caller's fp32 Wg, Wu (H, D)
    and Wd (D, H) and no bf16 copy of any (the forward and the backward each make their own and
    free them). The three weight gradients come back in fp32, equal to the bf16-rounded fp64
    reference within bf16 resolution, on both branches of the backward (with the Triton
    kernels: dWg, dWu written in fp32 by the dW kernel, dWd transposed and cast by
    ``twell.ops.transpose``)."""
    n, d, h, kc = 33, 40, 300, 20
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=1.5, seed=21)
    ins = [t.float().requires_grad_() for t in (x, wg, wu, wd)]
    saved = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, _ = sparse_ffn_train(*ins, ell_capacity=kc, dense_row_fraction=dense_row_fraction,
                                backend=backend,
                                hot_units=None if hot is None else torch.tensor(hot))
    assert y.dtype == torch.bfloat16
    weights = sorted((tuple(t.shape), str(t.dtype)) for t in saved
                     if tuple(t.shape) in {(h, d), (d, h)})
    assert weights == [((d, h), "torch.float32"), ((h, d), "torch.float32"),
                       ((h, d), "torch.float32")]
    for w in ins[1:]:
        assert any(t is w for t in saved)  # the master itself, not a copy of it
    (y.float() * dy.float()).sum().backward()
    assert [(w.grad.dtype, w.grad.shape) for w in ins[1:]] == [
        (torch.float32, (h, d)), (torch.float32, (h, d)), (torch.float32, (d, h))]
    ref = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in (x, wg, wu, wd)]
    y_r = (torch.relu(ref[0] @ ref[1].t()) * (ref[0] @ ref[2].t())) @ ref[3].t()
    (y_r * dy.to(torch.bfloat16).double()).sum().backward()
    for name, i in (("dWg", 1), ("dWu", 2), ("dWd", 3)):
        assert_close(name, ins[i].grad.double(), ref[i].grad, 3e-2)


def test_fp64_input_with_fp32_weights_sums_the_weight_gradients_in_fp64():
    """An fp64 input computes in fp64 (the PyTorch backend) while fp32 weights get fp32
    gradients: each of dWg, dWu, dWd is the fp64 sum rounded once, the fp64 reference's value
    correctly rounded to fp32 (within half an fp32 ulp of it), not a sum accumulated in fp32.
    Every row in ELL (capacity H), so the weight-gradient pass makes all three."""
    n, d, h = 257, 40, 300
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=1.0, seed=5)
    ins = [x.clone().requires_grad_()] + [t.float().requires_grad_() for t in (wg, wu, wd)]
    y, st = sparse_ffn_train(*ins, ell_capacity=h, dense_row_fraction=1.0, backend="torch")
    assert y.dtype == torch.float64
    ((y * dy).sum() + 0.5 * st.l1).backward()
    _, _, g_r = reference(x, *(t.float().double() for t in (wg, wu, wd)), dy, 0.5)
    for name, got, ref in zip(("dWg", "dWu", "dWd"), (t.grad for t in ins[1:]), g_r[1:]):
        assert got.dtype == torch.float32
        err = (got.double() - ref).abs()
        bad = err > ref.abs() * 2.0**-24 * (1 + 1e-6)
        assert not bool(bad.any()), f"{name}: {int(bad.sum())} of {ref.numel()} not rounded once"


@needs_triton
def test_bf16_input_with_fp64_weights_on_the_triton_kernels():
    """fp64 weights with a bf16 input: the Triton kernels compute in bf16 from Wd^T made by the
    transposing cast out of the fp64 Wd; y and the gradients (the weights' in fp64) match the
    fp64 reference of the bf16-rounded operands within bf16 resolution."""
    n, d, h, kc = 33, 40, 300, 20
    x, wg, wu, wd, dy = make_inputs(n, d, h, threshold=1.5, seed=2)
    ins = [x.to(DEV, torch.bfloat16).requires_grad_()] + [
        t.to(DEV).requires_grad_() for t in (wg, wu, wd)]
    y, _ = sparse_ffn_train(*ins, ell_capacity=kc, dense_row_fraction=1.0, backend="triton")
    (y.double() * dy.to(DEV)).sum().backward()
    assert [w.grad.dtype for w in ins[1:]] == [torch.float64] * 3
    ref = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in (x, wg, wu, wd)]
    y_r = (torch.relu(ref[0] @ ref[1].t()) * (ref[0] @ ref[2].t())) @ ref[3].t()
    (y_r * dy).sum().backward()
    assert_close("y", y, y_r, 3e-2)
    for name, got, want in zip(("dx", "dWg", "dWu", "dWd"), ins, ref):
        assert_close(name, got.grad, want.grad, 3e-2)


def test_slot_indices_beyond_int32_are_refused_before_any_work():
    """N x ELL capacity must stay below 2^31 (the CSC order's int32 slot indices): 64 rows at a
    capacity of 2^25 is exactly 2^31, refused with the fix; one slot less passes the check."""
    x, wg, wu, wd, _ = make_inputs(64, 8, 16, seed=3)
    args = [t.float() for t in (x, wg, wu, wd)]
    with pytest.raises(ValueError, match=r"64 x 33554432 must be below 2\^31.*smaller ell_capacity"):
        sparse_ffn_train(*args, ell_capacity=2**25, backend="torch")
    y, _ = sparse_ffn_train(*args, ell_capacity=16, backend="torch")  # a capacity that fits
    assert torch.isfinite(y).all()


# --- the hot/cold split (hot_units=S): the hot units dense, the cold ones in the ELL op ------
# Shape legend here: k hot units.

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


# PyTorch backend, float64: every hot set, odd shapes, zero and fully dense rows -----------

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


# Triton kernels, float32 -------------------------------------------------------------------

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


# --- the layout's forward alone (ell_ffn_forward) -------------------------------------------

FORWARD_MODES = [  # (mode, options beyond the capacity): measure, all-dense fallback, no-sync
    ("measure", {"dense_row_fraction": 1.0}), ("all_dense", {"dense_row_fraction": 0.0}),
    ("nosync", {"dense_row_fraction": 1.0})]


@pytest.mark.parametrize("kind", ["none", "few", "heavy"])
@pytest.mark.parametrize("mode,opts", FORWARD_MODES, ids=[m for m, _ in FORWARD_MODES])
@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_ell_forward_is_the_training_ops_forward(backend, dtype, rel, mode, opts, kind):
    """``ell_ffn_forward``'s y equals ``sparse_ffn_train``'s y bitwise on the same backend (the
    same kernels in the same order, without the CSC order and the saved state) and fp64 dense
    PyTorch within the backend's bound; its heavy-row count is the cold tokens above the
    capacity, counted here in fp64. Cases hold light rows, heavy rows, an all-zero and a fully
    active token, and hot sets (none, a few units, units of the heavy rows)."""
    n, d, h, cap = 40, 24, 300, 12
    x, wg, wu, wd, dy = make_case(n, d, h, seed=71, zero_rows=(0,), dense_rows=(n - 1,))
    hot = hot_set(kind, x, wg, cap)
    hot = None if hot is None else hot.to(DEV)
    want_heavy = cold_heavy(x, wg, None if hot is None else hot.cpu(), cap)
    assert 0 < want_heavy < n - 1
    kw = {"ell_capacity": cap, "backend": backend, "hot_units": hot, **opts}
    if mode == "nosync":
        kw["backup_rows"] = want_heavy + 2
    ins = [t.to(DEV, dtype) for t in (x, wg, wu, wd)]
    y, heavy = ffn_train.ell_ffn_forward(*ins, **kw)
    y_train, st = sparse_ffn_train(*ins, **kw)
    assert torch.equal(y, y_train)
    assert heavy.shape == (1,) and heavy.dtype == torch.int32
    assert int(heavy[0]) == int(st.heavy_rows.item()) == want_heavy
    y_ref, _, _ = reference(x, wg, wu, wd, dy, 0.0)
    assert_close("y", y, y_ref, rel)


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_ell_forward_nosync_capacity_too_small_is_exact_and_reported(backend, dtype, rel):
    """A no-sync capacity below the heavy rows, no hot units: the heavy rows past the backup
    go to the overflow kernel, so y and l1 match fp64 dense PyTorch as a measuring call's do,
    and the count still says how many rows were heavy (what the next capacity must hold).
    The overflow kernel's own cases: ``test_overflow_rows.py``."""
    x, wg, wu, wd, dy = make_case(40, 24, 300, seed=72, zero_rows=(0,), dense_rows=(39,))
    cap = 12
    heavy_rows = active(x, wg).sum(1) > cap
    r = int(heavy_rows.sum())
    assert r >= 3
    ins = [t.to(DEV, dtype) for t in (x, wg, wu, wd)]
    y_ref, st_ref, _ = reference(x, wg, wu, wd, dy, 0.0)
    for c in (0, 1, r - 1):
        y, heavy, st = ffn_train.ell_ffn_forward(*ins, ell_capacity=cap, backend=backend,
                                                 backup_rows=c, dense_row_fraction=1.0,
                                                 with_stats=True)
        assert int(heavy[0]) == r > 1
        assert_close(f"y (capacity {c})", y, y_ref, rel)
        assert_close(f"l1 (capacity {c})", st.l1, st_ref.l1, rel)
    y_exact, _ = ffn_train.ell_ffn_forward(*ins, ell_capacity=cap, backend=backend,
                                           dense_row_fraction=1.0)
    assert_close("y (measuring)", y_exact, y_ref, rel)


@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_ell_forward_nosync_with_hot_units_is_exact_past_the_capacity(backend, dtype, rel):
    """With hot units too, the forward-only no-sync mode is exact below the cold heavy count:
    the overflow kernel computes the rows past the backup with the gate zeroed at the hot units
    (as the backup's) and the hot slice is added once, so y (every row), l1 and the counts
    match fp64 dense PyTorch, and the count says how many rows were heavy. The kernel's own
    hot-unit cases: ``test_overflow_rows.py``."""
    x, wg, wu, wd, dy = make_case(40, 24, 300, seed=72, zero_rows=(0,), dense_rows=(39,))
    cap = 12
    hot = torch.tensor([0, 1, 2])  # the always-active units: every row keeps them
    heavy_rows = active(x, wg)[:, 3:].sum(1) > cap
    r = int(heavy_rows.sum())
    assert r >= 3
    ins = [t.to(DEV, dtype) for t in (x, wg, wu, wd)]
    y_ref, st_ref, _ = reference(x, wg, wu, wd, dy, 0.0)
    for c in (0, 1, r - 1):
        y, heavy, st = ffn_train.ell_ffn_forward(*ins, ell_capacity=cap, backend=backend,
                                                 backup_rows=c, dense_row_fraction=1.0,
                                                 hot_units=hot.to(DEV), with_stats=True)
        assert int(heavy[0]) == int(st.heavy_rows.item()) == r > 1
        assert_close(f"y (capacity {c})", y, y_ref, rel)
        assert_close(f"y, heavy rows (capacity {c})", y[heavy_rows.to(DEV)],
                     y_ref[heavy_rows], rel)
        assert_close(f"l1 (capacity {c})", st.l1, st_ref.l1, rel)
        assert st.nnz_sum.item() == st_ref.nnz_sum.item()
        assert st.nnz_max.item() == st_ref.nnz_max.item()
        assert torch.equal(st.active_counts.cpu(), st_ref.active_counts)


@pytest.mark.parametrize("value", NONFINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_ell_forward_nonfinite_row_reaches_only_its_output(backend, dtype, rel, value):
    """A NaN / inf in x[r]: y[r] is non-finite, as in fp64 dense PyTorch, and every other row
    matches the reference (the row is heavy and takes the dense backup)."""
    x, wg, wu, wd, dy = _nonfinite_case(value)
    y_r, _, _ = _reference_with_nonfinite(x, wg, wu, wd, dy, 0.0)
    ins = [t.to(DEV, dtype) for t in (x, wg, wu, wd)]
    y, _ = ffn_train.ell_ffn_forward(*ins, backend=backend)
    ok = [i for i in range(9) if i != 3]
    assert torch.equal(torch.isfinite(y.cpu()), torch.isfinite(y_r))
    assert not torch.isfinite(y[3]).any()
    assert_close("y (finite rows)", y[ok], y_r[ok], rel)


def test_ell_forward_empty_input_and_bad_arguments():
    """N = 0 gives an empty (0, D) y and a zero count; a wrong shape or option is a ValueError
    naming ``ell_ffn_forward`` or the option."""
    x, wg, wu, wd, _ = make_inputs(4, 16, 64, seed=73)
    y, heavy = ffn_train.ell_ffn_forward(x[:0], wg, wu, wd, backend="torch")
    assert y.shape == (0, 16) and int(heavy[0]) == 0
    with pytest.raises(ValueError, match="ell_ffn_forward"):
        ffn_train.ell_ffn_forward(x, wg[:, :8], wu, wd, backend="torch")
    with pytest.raises(ValueError, match="backup_rows"):
        ffn_train.ell_ffn_forward(x, wg, wu, wd, backend="torch", backup_rows=-2)


@pytest.mark.parametrize("mode,opts", FORWARD_MODES, ids=[m for m, _ in FORWARD_MODES])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_ell_forward_under_bf16_autocast_is_the_training_ops_forward(backend, mode, opts):
    """Under bf16 autocast with fp32 weights y is still bitwise the training op's: the op turns
    autocast off past the cast, as ``twell::ffn_train_fwd`` does (else the PyTorch backend's
    fp32-accumulating gathers and sums would run in bf16)."""
    n, d, h, cap = 40, 24, 300, 12
    x, wg, wu, wd, _ = make_case(n, d, h, seed=74, zero_rows=(0,), dense_rows=(n - 1,))
    want_heavy = cold_heavy(x, wg, None, cap)
    assert 0 < want_heavy < n - 1
    kw = {"ell_capacity": cap, "backend": backend, **opts}
    if mode == "nosync":
        kw["backup_rows"] = want_heavy + 2
    ins = [t.to(DEV, torch.float32) for t in (x, wg, wu, wd)]
    for kwh in (kw, {**kw, "ell_capacity": h}):  # heavy rows, and every row in the ELL part
        with torch.autocast(ins[0].device.type, dtype=torch.bfloat16):
            y, heavy = ffn_train.ell_ffn_forward(*ins, **kwh)
            y_train, st = sparse_ffn_train(*ins, **kwh)
        assert y.dtype == y_train.dtype == torch.bfloat16
        assert torch.equal(y, y_train)
        assert int(heavy[0]) == int(st.heavy_rows.item())


@pytest.mark.parametrize("opts", [{"backup_rows": -2}, {"ell_capacity": -1},
                                  {"dense_row_fraction": 1.5}])
def test_ell_forward_option_errors_name_ell_ffn_forward(opts):
    """A bad option's ValueError names ``ell_ffn_forward``, not the training op."""
    x, wg, wu, wd, _ = make_inputs(4, 16, 64, seed=73)
    with pytest.raises(ValueError, match="^ell_ffn_forward: "):
        ffn_train.ell_ffn_forward(x, wg, wu, wd, backend="torch", **opts)


FWD_CAP = 12  # _forward_case's ELL capacity


def _forward_case(backend, dtype, mode, opts, kind, seed):
    """A 40 x 24 x 300 case at ELL capacity 12 (an all-zero row, a dense row), its hot set of
    ``kind``, the op's keywords for ``mode`` (no-sync: a backup two rows above the cold heavy
    count) and the inputs on DEV in ``dtype``: (x, wg, wu, wd, dy, hot, ins, kw)."""
    n, d, h, cap = 40, 24, 300, FWD_CAP
    x, wg, wu, wd, dy = make_case(n, d, h, seed=seed, zero_rows=(0,), dense_rows=(n - 1,))
    hot = hot_set(kind, x, wg, cap)
    kw = {"ell_capacity": cap, "backend": backend,
          "hot_units": None if hot is None else hot.to(DEV), **opts}
    if mode == "nosync":
        kw["backup_rows"] = cold_heavy(x, wg, hot, cap) + 2
    return x, wg, wu, wd, dy, hot, [t.to(DEV, dtype) for t in (x, wg, wu, wd)], kw


@pytest.mark.parametrize("kind", ["none", "few"])
@pytest.mark.parametrize("mode,opts", FORWARD_MODES, ids=[m for m, _ in FORWARD_MODES])
@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_ell_forward_precomputed_down_t_is_bitwise_the_same(backend, dtype, rel, mode, opts,
                                                            kind):
    """``w_down_t_HD`` (the caller's (H, D) Wd^T, e.g. ``TwELLState.down_t``'s cached copy)
    gives y bitwise equal to the op's own transposing cast, in every mode, with and without
    hot units (their slice reads the same rows)."""
    x, wg, wu, wd, dy, _, ins, kw = _forward_case(backend, dtype, mode, opts, kind, seed=75)
    y, heavy = ffn_train.ell_ffn_forward(*ins, **kw)
    y_t, heavy_t = ffn_train.ell_ffn_forward(*ins, w_down_t_HD=ins[3].T.contiguous(), **kw)
    assert torch.equal(y_t, y) and torch.equal(heavy_t, heavy)
    y_ref, _, _ = reference(x, wg, wu, wd, dy, 0.0)
    assert_close("y", y_t, y_ref, rel)


def test_ell_forward_precomputed_down_t_under_autocast_and_bad_ones():
    """Under bf16 autocast the precomputed Wd^T is in the compute dtype (bf16) and y is bitwise
    the op's own; one of another shape, dtype, device or layout is a ValueError naming
    ``w_down_t_HD``."""
    x, wg, wu, wd, _ = make_inputs(9, 16, 64, seed=76)
    ins = [t.float() for t in (x, wg, wu, wd)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = ffn_train.ell_ffn_forward(*ins, backend="torch")
        y_t, _ = ffn_train.ell_ffn_forward(*ins, backend="torch",
                                           w_down_t_HD=ins[3].T.to(torch.bfloat16).contiguous())
        with pytest.raises(ValueError, match="w_down_t_HD .*bfloat16"):  # fp32: not the compute
            ffn_train.ell_ffn_forward(*ins, backend="torch", w_down_t_HD=ins[3].T.contiguous())
    assert y.dtype == torch.bfloat16 and torch.equal(y_t, y)
    wdt = ins[3].T.contiguous()
    for bad in (ins[3], wdt[:, :8], ins[3].T, wdt.double()):  # (D, H), narrow, strided, fp64
        with pytest.raises(ValueError, match="^ell_ffn_forward: w_down_t_HD must be"):
            ffn_train.ell_ffn_forward(*ins, backend="torch", w_down_t_HD=bad)


@pytest.mark.parametrize("kind", ["none", "heavy"])
@pytest.mark.parametrize("mode,opts", FORWARD_MODES, ids=[m for m, _ in FORWARD_MODES])
@pytest.mark.parametrize("backend,dtype,rel", BACKEND_DTYPES)
def test_ell_forward_stats_are_the_training_ops(backend, dtype, rel, mode, opts, kind):
    """``with_stats=True`` returns ``(y, heavy, stats)`` whose stats equal
    ``sparse_ffn_train``'s on the same input, forward only (l1, nnz_sum, nnz_max,
    active_counts, n_tokens, heavy_rows: the same kernels' outputs, bitwise), and the counts
    the fp64 ones; without it the op still returns ``(y, heavy)``."""
    x, wg, wu, _, _, hot, ins, kw = _forward_case(backend, dtype, mode, opts, kind, seed=77)
    n, cap = x.shape[0], FWD_CAP
    y, heavy, st = ffn_train.ell_ffn_forward(*ins, with_stats=True, **kw)
    with torch.no_grad():
        y_train, st_train = sparse_ffn_train(*ins, **kw)
    assert len(ffn_train.ell_ffn_forward(*ins, **kw)) == 2
    assert torch.equal(y, y_train)
    assert st.n_tokens == st_train.n_tokens == n
    for name in ("l1", "nnz_sum", "nnz_max", "active_counts", "heavy_rows"):
        a, b = getattr(st, name), getattr(st_train, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    act = active(x, wg)
    assert st.nnz_sum.item() == act.sum().item() and st.nnz_max.item() == act.sum(1).max().item()
    assert torch.equal(st.active_counts.cpu(), act.sum(0).int())
    assert int(st.heavy_rows.item()) == int(heavy[0]) == cold_heavy(x, wg, hot, cap)
    u = x @ wu.T
    l1_ref = ((x @ wg.T).clamp(min=0) * u).abs().sum(1).mean()
    assert_close("l1", st.l1, l1_ref, rel)


def test_ell_forward_stats_of_an_empty_input():
    """N = 0 with ``with_stats``: zero l1 and counts, H zero unit counts, no token."""
    x, wg, wu, wd, _ = make_inputs(4, 16, 64, seed=78)
    y, heavy, st = ffn_train.ell_ffn_forward(x[:0], wg, wu, wd, backend="torch",
                                             with_stats=True)
    assert y.shape == (0, 16) and int(heavy[0]) == 0 and st.n_tokens == 0
    assert float(st.l1) == float(st.nnz_sum) == float(st.nnz_max) == float(st.heavy_rows) == 0
    assert st.active_counts.shape == (64,) and st.active_counts.dtype == torch.int32
    assert not st.active_counts.any()
