"""The norm benchmark's rows and table (``studies.kernel_bench.norm``): the rates from
hand-computed cases; the timed cases need CUDA and Liger-Kernel (``scripts/bench_norm.py``)."""

from studies.kernel_bench.norm import COLUMNS, _row, summary


def test_row_rates_by_hand():
    """1 GB in 0.5 ms is 2000 GB/s; Liger's 0.75 ms over 0.5 ms is 1.5x."""
    r = _row(4096, 2048, "bwd", 0.5, 10**9, 0.75, "1/4/8", (1e-7, 2e-7), True)
    assert tuple(r) == COLUMNS
    assert r["gbps"] == 2000.0 and r["vs_liger"] == 1.5 and r["default"]


def test_summary_shows_liger_default_and_five_fastest():
    rows = [_row(8, 4, "liger_fwd", 0.1, 0, 0.1), _row(8, 4, "liger_bwd", 0.2, 0, 0.2),
            _row(8, 4, "fwd", 0.05, 0, 0.1)]
    rows += [_row(8, 4, "bwd", 0.1 + i / 100, 0, 0.2, f"{i}/1/4", default=i == 6)
             for i in range(8)]
    table = summary(rows)
    launches = [line.split(" | ")[1] for line in table.splitlines() if line.startswith("| bwd")]
    assert launches == ["6/1/4 (default)", "0/1/4", "1/1/4", "2/1/4", "3/1/4", "4/1/4"]
    assert "| fwd |  | 0.0500 | 0 | 2.00x |" in table
