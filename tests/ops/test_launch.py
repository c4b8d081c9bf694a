"""Launch shapes of the training kernels (``twell.ops.launch``): ``kernel_config``'s checks of
its overrides (and the restored defaults after a failed attempt), and the dW kernel's D slice
chosen to fit the gathered x / dy columns in L2 (``dw_launch``), against hand-computed sizes."""

import pytest


def test_kernel_config_rejects_bad_values():
    launch = pytest.importorskip("twell.ops.launch")  # needs triton
    with pytest.raises(ValueError, match="sddmm_block_k must be a power of 2"), \
            launch.kernel_config(sddmm_block_k=6):
        pass
    with pytest.raises(ValueError, match="unknown key"), launch.kernel_config(spmm_blockk=8):
        pass
    with pytest.raises(ValueError, match="dw_block_d must be a positive int"), \
            launch.kernel_config(dw_block_d=-1):
        pass
    with pytest.raises(ValueError, match="dw_block_d must be a power of 2"), \
            launch.kernel_config(dw_block_d=24):
        pass
    with pytest.raises(ValueError, match="dense_block_n must be a power of 2"), \
            launch.kernel_config(dense_block_n=12):
        pass
    for bad in (2, -1):
        with pytest.raises(ValueError, match="dw_d_outer must be 0 or 1"), \
                launch.kernel_config(dw_d_outer=bad):
            pass
    with launch.kernel_config(dw_d_outer=0):
        pass
    from twell.ops.launch import _DEFAULT_CONFIG

    assert launch.CONFIG == _DEFAULT_CONFIG  # restored after the failed attempts


def test_dw_launch_fits_the_gathered_slices_in_l2():
    """dw_block_d=0 (auto): the widest power-of-2 D slice in [128, 1024] whose x and dy columns
    over all N rows fit in dw_l2_bytes, D slice outermost; a set dw_block_d wins."""
    from twell.ops.launch import CONFIG, dw_launch, kernel_config

    l2 = CONFIG["dw_l2_bytes"]
    assert l2 == 16 * 2**20
    # N 32768 bf16 x and dy: 4 bytes a column element -> 16 MiB / (32768 * 4) = 128 columns
    assert dw_launch(32768, 2048, 4) == (128, True)
    assert dw_launch(16384, 2048, 4) == (256, True)
    # 1024 would fit the L2 at N 4096: the accumulators' registers cap it (1024 * 2 warps / 8)
    assert CONFIG["dw_warps"] == 2 and CONFIG["dw_block_j"] == 8
    assert dw_launch(4096, 2048, 4) == (256, True)
    with kernel_config(dw_warps=4, dw_block_j=4):  # 1024 columns' accumulators fit: L2 decides
        assert dw_launch(4096, 2048, 4) == (1024, True)  # 2048 would fit: capped at 1024
    assert dw_launch(1 << 20, 2048, 4) == (128, True)  # nothing fits: the narrowest slice
    assert dw_launch(16384, 48, 4) == (64, True)  # at most D's power of 2
    with kernel_config(dw_block_d=1024, dw_d_outer=0):
        assert dw_launch(32768, 2048, 4) == (1024, False)
    with kernel_config(dw_l2_bytes=8 * 2**20):
        assert dw_launch(16384, 2048, 4) == (128, True)  # 8 MiB / 64 KiB a column = 128
