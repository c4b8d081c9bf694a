"""Profile target for `ncu`, and a quick timing of the pack / compaction kernels alone (GPU only).

    ncu --clock-control none --kernel-name regex:"pack|compact" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python scripts/profile_pack.py
    python scripts/profile_pack.py --time     # median ms per launch shape at 0.3 / 1 / 3 %

One call each of the TwELL pack and the training compaction at M=16384, H=5632, bf16. With
``--time``: each launch shape timed with ``triton.testing.do_bench`` and its output compared with
the default shape's (equal counts and words / columns), and the default against the times
recorded in BENCHMARKS.md (:data:`RECORDED`; the superseded versions are at git commit 629013a).

Why: the first versions of both took ~0.27-0.45 ms for a 184 MB bf16 read, 5-7x their bandwidth
floor (BENCHMARKS.md, "Why the pack and compaction kernels are slow"); the counters say what
limits them.
"""

import argparse

import torch

from twell.ops.compact import compact
from twell.ops.launch import kernel_config
from twell.ops.twell_pack import pack_dense

# the default kernels' ms recorded on one H200 (BENCHMARKS.md, "Training FFN")
RECORDED = {("pack", 0.003): 0.139, ("pack", 0.01): 0.195, ("pack", 0.03): 0.209,
            ("compact", 0.003): 0.141, ("compact", 0.01): 0.205, ("compact", 0.03): 0.230}
PACK_SHAPES = ({}, {"block_m": 2, "num_warps": 1}, {"block_m": 2, "num_warps": 2})
COMPACT_SHAPES = ({}, {"compact_block_n": 2, "compact_warps": 1},
                  {"compact_block_n": 2, "compact_warps": 2})


def gate(m: int, h: int, dens: float) -> torch.Tensor:
    """relu(g) > 0 with probability ``dens``: a shifted normal, bf16."""
    thr = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - dens)).item()
    return (torch.randn(m, h, device="cuda") - thr).to(torch.bfloat16)


def _same_pack(tw, ref) -> bool:
    valid, cols, _, _ = tw.slots()
    rvalid, rcols, _, _ = ref.slots()
    return (torch.equal(tw.counts, ref.counts) and torch.equal(valid, rvalid)
            and torch.equal(cols[valid], rcols[rvalid]))


def _same_compact(c, ref, kc) -> bool:
    valid = torch.arange(kc, device="cuda")[None, :] < c[2].clamp(max=kc)[:, None]
    return (torch.equal(c[2], ref[2]) and torch.equal(c[3], ref[3])
            and torch.equal(c[0][valid], ref[0][valid]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time", action="store_true", help="time every launch shape instead of one call")
    args = ap.parse_args()
    torch.manual_seed(0)
    m, h, kc = 16384, 5632, 128
    if not args.time:
        g = gate(m, h, 0.003)
        pack_dense(g, 8, stats=True)
        compact(g, kc)
        torch.cuda.synchronize()
        print("profiled: pack, compact (default launch shapes)")
        return
    import triton.testing

    for dens in (0.003, 0.01, 0.03):
        g = gate(m, h, dens)
        ref, _ = pack_dense(g, 8)
        for kw in PACK_SHAPES:
            ok = _same_pack(pack_dense(g, 8, **kw)[0], ref)
            ms = triton.testing.do_bench(lambda kw=kw, g=g: pack_dense(g, 8, **kw), rep=50)
            rec = f"  (recorded default: {RECORDED[('pack', dens)]:.3f} ms)" if not kw else ""
            print(f"density {dens:.3f} pack {kw or 'default'}: {ms:.4f} ms  "
                  f"{'ok' if ok else 'MISMATCH'}{rec}")
        c_ref = compact(g, kc)
        for kw in COMPACT_SHAPES:
            with kernel_config(**kw):
                ok = _same_compact(compact(g, kc), c_ref, kc)
                ms = triton.testing.do_bench(lambda g=g: compact(g, kc), rep=50)
            rec = f"  (recorded default: {RECORDED[('compact', dens)]:.3f} ms)" if not kw else ""
            print(f"density {dens:.3f} compact {kw or 'default'}: {ms:.4f} ms  "
                  f"{'ok' if ok else 'MISMATCH'}{rec}")


if __name__ == "__main__":
    main()
