"""Profile target for `ncu`: one call each of the TwELL pack (v1, v2, v3) and the training
compaction (v2, v3) at M=16384, H=5632, 0.3 % density, bf16 (GPU only).

    ncu --clock-control none --kernel-name regex:"pack|compact" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis python scripts/profile_pack.py

Why: run 2 (BENCHMARKS.md) measured both at ~0.27-0.45 ms for a 184 MB bf16 read, 5-7x their
bandwidth floor, and no launch-shape change moved them; the counters say what limits them.
"""

import torch

from twell.ops import sparse_train_triton as stt
from twell.ops.twell_pack import pack_dense


def main() -> None:
    torch.manual_seed(0)
    m, h, dens = 16384, 5632, 0.003
    # relu(g) > 0 with probability `dens`: a shifted normal
    thr = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - dens)).item()
    g = (torch.randn(m, h, device="cuda") - thr).to(torch.bfloat16)
    for version in (1, 2, 3):
        pack_dense(g, 8, stats=True, version=version)
    for variant in ("v2", "v3"):
        with stt.kernel_config(compact=variant):
            stt.compact(g, 128)
    torch.cuda.synchronize()
    print("profiled: pack v1, v2, v3; compact v2, v3")


if __name__ == "__main__":
    main()
