"""The ReLU + ELL compaction kernels (``twell.ops.compact``: ``compact``, ``compact_heavy``) alone,
against the PyTorch backend's compaction (``twell.ops.reference.sparse_train_torch``), exactly:
columns and values of every valid slot, per-row and per-unit counts, nnz_eff and the heavy-row
count, at several rows / warps per program, with rows above capacity and an all-zero row.

On CPU the kernels run through ``TRITON_INTERPRET=1`` (tests/conftest.py).
"""

import pytest
import torch

from twell.ops.launch import kernel_config
from twell.ops.reference import sparse_train_torch
from twell.ops.train_backend import triton_backend

from .train_cases import DEV, make_inputs, needs_triton


@needs_triton
def test_compact_counts_match_torch():
    """The compaction kernel at several rows / warps / columns per program equals the PyTorch
    compaction exactly, including rows above capacity, an all-zero row and H not a multiple of
    the column block (300 columns: 2 steps of 256, 10 of 32, 1 of 512, whose prefetched second
    step is wholly out of range)."""
    tk = triton_backend()
    x, wg, _, _, _ = make_inputs(37, 24, 300, threshold=1.2, seed=23, zero_rows=(3,))
    g = (x @ wg.T).float().to(DEV)
    col_r, val_r, nnz_r, cnt_r = sparse_train_torch.compact(g, 16)
    assert (nnz_r > 16).any() and (nnz_r == 0).any()
    for block_n, warps, block_h in ((1, 1, 256), (4, 1, 256), (4, 4, 256), (8, 2, 256),
                                    (4, 2, 256), (1, 1, 32), (2, 2, 512)):
        with kernel_config(compact_block_n=block_n, compact_warps=warps,
                           compact_block_h=block_h):
            col, val, nnz, cnt = tk.compact(g, 16)
        assert torch.equal(nnz, nnz_r) and torch.equal(cnt, cnt_r), (block_n, warps, block_h)
        valid = sparse_train_torch.valid_slots(torch.clamp(nnz_r, max=16), 16)
        assert torch.equal(col[valid], col_r[valid]) and torch.equal(val[valid], val_r[valid])


@needs_triton
def test_compact_heavy_bookkeeping_matches_torch():
    """nnz_eff (0 on rows above capacity) and the heavy-row count, written by the compaction
    kernel, equal the PyTorch backend's."""
    tk = triton_backend()
    x, wg, _, _, _ = make_inputs(37, 24, 300, threshold=1.2, seed=23, zero_rows=(3,))
    g = (x @ wg.T).float().to(DEV)
    ref = sparse_train_torch.compact_heavy(g, 16)
    assert 0 < int(ref[5]) < 37 and int(ref[5]) == int((ref[2] > 16).sum())
    for block_n, warps in ((1, 1), (4, 2)):
        with kernel_config(compact_block_n=block_n, compact_warps=warps):
            out = tk.compact_heavy(g, 16)
        for name, a, b in zip(("nnz", "counts", "nnz_eff", "n_heavy"), out[2:], ref[2:]):
            assert torch.equal(a.cpu(), b.cpu()), (block_n, name)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compact_activity_by_value_in_every_dtype(dtype):
    """Active = not (g <= 0), by value in every dtype: hand-counted rows of negatives, -0.0, +0.0,
    tiny positives and NaN. Triton's interpreter compares bf16 by its bits (every negative and
    -0.0 active); the kernel compares in fp32, so the CPU tests see the GPU's counts."""
    nan = float("nan")
    rows = [[-1.0, -0.0, 0.0, 2.0, -3.5, 1e-3, nan, -1e-3],  # active: 2.0, 1e-3, NaN
            [-0.0] * 8,  # none
            [0.5, -0.5, 0.25, -0.25, 0.0, 4.0, -4.0, 8.0]]  # 0.5, 0.25, 4.0, 8.0
    g = torch.tensor(rows, dtype=dtype, device=DEV)
    col, val, nnz, cnt = triton_backend().compact(g, 8)
    assert nnz.tolist() == [3, 0, 4]
    assert cnt.tolist() == [1, 0, 1, 1, 0, 2, 1, 1]
    assert col[0, :3].tolist() == [3, 5, 6] and col[2, :4].tolist() == [0, 2, 5, 7]
    assert torch.equal(val[2, :4].float().cpu(), torch.tensor([0.5, 0.25, 4.0, 8.0]))


@needs_triton
def test_compact_refuses_bad_capacity_and_dtype():
    """kc must be an int >= 1 (kc=0 returned (N, 0) outputs, kc=-3 a bare RuntimeError) and g
    fp16 / bf16 / fp32 (int32 was accepted): each a one-line ValueError naming the argument."""
    tk = triton_backend()
    g = torch.randn(4, 40, device=DEV)
    for fn in (tk.compact, tk.compact_heavy):
        for kc in (0, -3, 2.0, True):
            with pytest.raises(ValueError, match=r"^kc: .*int >= 1; got"):
                fn(g, kc)
        with pytest.raises(ValueError, match=r"^g_NH: dtype .*got torch.int32"):
            fn(g.to(torch.int32), 4)
        assert fn(g.half(), 4)[1].shape == (4, 4)
