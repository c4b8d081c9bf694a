"""The norm benchmark's rows and table (``studies.kernel_bench.norm``): the rates from
hand-computed cases, and the fused add's rows at a small shape through the Triton interpreter
(not a timing); the timed cases need CUDA and Liger-Kernel (``scripts/bench_norm.py``)."""

import pytest

from studies.kernel_bench.common import cpu_timer
from studies.kernel_bench.norm import COLUMNS, _row, add_norm_rows, summary
from tests.ops.ell_cases import DEV, TRITON


def test_row_rates_by_hand():
    """1 GB in 0.5 ms is 2000 GB/s; Liger's 0.75 ms over 0.5 ms is 1.5x."""
    r = _row(4096, 2048, "bwd", 0.5, 10**9, 0.75, "1/4/8", (1e-7, 2e-7), True)
    assert tuple(r) == COLUMNS
    assert r["gbps"] == 2000.0 and r["vs_base"] == 1.5 and r["default"]


def test_summary_shows_liger_default_and_five_fastest():
    rows = [_row(8, 4, "liger_fwd", 0.1, 0, 0.1), _row(8, 4, "liger_bwd", 0.2, 0, 0.2),
            _row(8, 4, "fwd", 0.05, 0, 0.1)]
    rows += [_row(8, 4, "bwd", 0.1 + i / 100, 0, 0.2, f"{i}/1/4", default=i == 6)
             for i in range(8)]
    table = summary(rows)
    launches = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| bwd")]
    assert launches == ["6/1/4 (default)", "0/1/4", "1/1/4", "2/1/4", "3/1/4", "4/1/4"]
    assert "| fwd |  | 0.0500 | 0 | 2.00x |" in table


def test_summary_shows_the_add_rows_after_the_launches():
    rows = [_row(8, 4, "fwd", 0.05, 0, 0.1), _row(8, 4, "add_unfused_fwd", 0.3, 0, 0.3),
            _row(8, 4, "add_fwd", 0.2, 0, 0.3), _row(8, 4, "bwd", 0.1, 0, 0.2, "1/1/4", default=True)]
    ops = [line.split(" | ")[0][2:] for line in summary(rows).splitlines()
           if line.startswith("| ") and not line.startswith("| op")]
    assert ops == ["fwd", "bwd", "add_unfused_fwd", "add_fwd"]
    assert "| add_fwd |  | 0.2000 | 0 | 1.50x |" in summary(rows)


@pytest.mark.skipif(not TRITON, reason="Triton (or its interpreter) absent")
def test_add_norm_rows_check_and_rate():
    """The four add rows at 6 x 40 (a partial block) on the test device: the checks pass (the
    sum PyTorch's, normed the unfused bits under the interpreter, gradients near fp64), the
    bytes are 12 and 16 an element plus rstd, and each fused row is rated on its unfused one."""
    rows = add_norm_rows(6, 40, device=DEV, timer=cpu_timer)
    assert [r["op"] for r in rows] == ["add_unfused_fwd", "add_unfused_bwd", "add_fwd", "add_bwd"]
    assert all(tuple(r) == COLUMNS for r in rows)
    for r, per_elem in zip(rows, (12, 16, 12, 16)):
        assert r["gbps"] == pytest.approx((6 * 40 * per_elem + 6 * 4) / r["ms"] / 1e6)
    assert rows[2]["vs_base"] == pytest.approx(rows[0]["ms"] / rows[2]["ms"])
    assert rows[3]["vs_base"] == pytest.approx(rows[1]["ms"] / rows[3]["ms"])
    if DEV == "cpu":
        assert rows[2]["err_dx"] == 0.0
    assert rows[3]["err_dx"] < 1e-5 and rows[3]["err_dw"] < 1e-5
