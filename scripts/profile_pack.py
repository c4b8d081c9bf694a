"""Profile target for `ncu`, and a quick timing of the pack / compaction kernels alone (GPU only).

    ncu --clock-control none --kernel-name regex:"pack|compact" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis python scripts/profile_pack.py
    python scripts/profile_pack.py --time     # median ms per version at 0.3 / 1 / 3 %, outputs checked

One call each of the TwELL pack (v1, v2, v4, v5) and the training compaction (v2-v4) at M=16384,
H=5632, bf16. With ``--time``: each version timed with ``triton.testing.do_bench`` and its
output compared with v4's (pack) / v3's (compaction): equal counts and words / columns.

Why: run 2 (BENCHMARKS.md) measured both at ~0.27-0.45 ms for a 184 MB bf16 read, 5-7x their
bandwidth floor; the counters say what limits them.
"""

import argparse

import torch

from twell.ops import sparse_train_triton as stt
from twell.ops.twell_pack import pack_dense


def gate(m: int, h: int, dens: float) -> torch.Tensor:
    """relu(g) > 0 with probability ``dens``: a shifted normal, bf16."""
    thr = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - dens)).item()
    return (torch.randn(m, h, device="cuda") - thr).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time", action="store_true", help="time every version instead of one call")
    args = ap.parse_args()
    torch.manual_seed(0)
    m, h = 16384, 5632
    if not args.time:
        g = gate(m, h, 0.003)
        for version in (1, 2, 4, 5):
            pack_dense(g, 8, stats=True, version=version)
        for variant in ("v2", "v3", "v4"):
            with stt.kernel_config(compact=variant):
                stt.compact(g, 128)
        torch.cuda.synchronize()
        print("profiled: pack v1, v2, v4, v5; compact v2, v3, v4")
        return
    import triton.testing

    for dens in (0.003, 0.01, 0.03):
        g = gate(m, h, dens)
        ref, _ = pack_dense(g, 8, version=4)
        for version in (2, 4, 5):
            tw, _ = pack_dense(g, 8, version=version)
            valid, cols, _, _ = tw.slots()
            rvalid, rcols, _, _ = ref.slots()
            ok = (torch.equal(tw.counts, ref.counts) and torch.equal(valid, rvalid)
                  and torch.equal(cols[valid], rcols[rvalid]))
            ms = triton.testing.do_bench(lambda v=version, g=g: pack_dense(g, 8, version=v), rep=50)
            print(f"density {dens:.3f} pack v{version}: {ms:.4f} ms  {'ok' if ok else 'MISMATCH'}")
        with stt.kernel_config(compact="v3"):
            c_ref = stt.compact(g, 128)
        for variant in ("v2", "v3", "v4"):
            with stt.kernel_config(compact=variant):
                c = stt.compact(g, 128)
                valid = torch.arange(128, device="cuda")[None, :] < c[2].clamp(max=128)[:, None]
                ok = (torch.equal(c[2], c_ref[2]) and torch.equal(c[3], c_ref[3])
                      and torch.equal(c[0][valid], c_ref[0][valid]))
                ms = triton.testing.do_bench(lambda g=g: stt.compact(g, 128), rep=50)
            print(f"density {dens:.3f} compact {variant}: {ms:.4f} ms  {'ok' if ok else 'MISMATCH'}")


if __name__ == "__main__":
    main()
