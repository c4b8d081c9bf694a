"""The sparse FFN ops on recorded layers and i.i.d. rows, beside dense cuBLAS (one GPU, < 10 min).

    # recorded layers (twell.nn.record files: scripts/record_acts.py, bench_model.py --acts-dir)
    python scripts/bench_real_layers.py --layers acts/acts_1p5b_l3.safetensors,... --out "$OUT"
    # also the paper's CUDA ops from a checkout of SakanaAI/sparser-faster-llms (JIT-built)
    TORCH_CUDA_ARCH_LIST=9.0a python scripts/bench_real_layers.py --layers ... --paper-src DIR
    # CPU: tiny shapes, the PyTorch backend, the code paths only (no timing claims)
    python scripts/bench_real_layers.py --smoke --out /tmp/kb
    # 5 timing rounds, then every op's kernels under torch.profiler
    python scripts/bench_real_layers.py --layers ... --rounds 5 --profile --out "$OUT"

Every case (each recorded layer, then i.i.d. rows at ``--iid`` densities of shape ``--shape``)
is checked first (every op against fp32; an op of ours off by more than 3x the dense bf16
path's error stops the run with exit code 1), then timed with ``triton.testing.do_bench``
medians: forward (dense cuBLAS, ``twell``, ``twell_heavy_first``: rows longest first,
``twell_hot``: hot units from the layer's own counts, ``twell_long``: the 128 longest rows through
a dense backup, ``ell_nosync`` / ``ell_hot``: the training layout's forward alone, ``ell_graph``:
``ell_nosync``'s forward in one CUDA graph, CUDA only)
and training (forward + backward with the L1 term: ``torch``, ``ell``, ``ell_nosync``,
``ell_graph`` (``ell_nosync`` in one CUDA graph; CUDA only, skipped with the reason on the
CPU), ``ell_hot``), ``auto`` (training: ``twell.ops.ffn_train_auto.AutoFFNTrain``, which
times those variants on the case before the check and runs the fastest; its choice and medians
printed) and ``paper`` (ops and method: ``studies.kernel_bench.real_layers``). The timing runs
in ``--rounds`` interleaved rounds (every op once per round, the op order rotated each round):
an op's ``ms`` is the median over rounds,
``spread_pct`` (max - min) / median over rounds in %. Writes ``real_layers.csv`` and ``iid.csv``
(columns ``real_layers.COLUMNS``, ``spread_pct`` last) under ``--out`` (default
outputs/kernel_bench) after every case and prints a short table last (each ratio with its op's
spread, ``1.39x±4``; the base ms with the baseline's).

``--profile``: after a case's timing, every op runs under ``torch.profiler``
(``studies.kernel_bench.kernel_profile``): wall ms per call (CUDA events) against the GPU's busy
ms per call, kernels and host syncs per call, the dense baseline over the op by wall and by
GPU busy time, and the longest kernels; an op with wall >> busy is host-bound. Writes
``kernel_profile.md`` and ``kernel_profile.csv`` under ``--out`` (on the CPU smoke run the
"kernels" are the top-level PyTorch ops: the code path only).
BENCHMARKS.md, "Hot/cold split", has the predictions.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from studies.kernel_bench.cases import first_token_case
from studies.kernel_bench.real_layers import (
    ROUNDS,
    cpu_timer,
    gpu_timer,
    iid_case,
    load_paper_ops,
    recorded_case,
    run_cases,
    summary_table,
)
from twell.nn.record import save_ffn_layer
from twell.policy import FFNPolicy


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--layers", default="", help="comma-separated recorded-layer files")
    ap.add_argument("--iid", default=None,
                    help="i.i.d. densities (fractions, comma-separated; '' = none; default "
                         "0.003,0.01,0.03,0.1, --smoke 0.05)")
    ap.add_argument("--first-tokens", type=float, default=None, metavar="DENSITY",
                    help="also each --iid density with a first token of this density in every "
                         "2048 rows (studies.kernel_bench.cases.first_token_case: the recorded "
                         "layers' dense first tokens without a model)")
    ap.add_argument("--shape", default="16384,2048,5632", help="M,D,H of the i.i.d. cases")
    ap.add_argument("--kinds", default="fwd,train", help="fwd and / or train")
    ap.add_argument("--paper-src", type=Path, default=None,
                    help="checkout of SakanaAI/sparser-faster-llms: also time its ops")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder of the two CSVs (default outputs/kernel_bench; --smoke: a temp "
                         "dir); docs/kernel_bench holds the published run")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="interleaved timing rounds: ms = median over rounds, spread_pct = "
                         "(max - min) / median (empty with 1 round)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile every op: kernel_profile.md and .csv under --out")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny shapes, one synthetic recorded layer: exercises the code only")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds: at least 1; got {a.rounds}")
    a.kinds = tuple(k for k in a.kinds.split(",") if k)
    if not set(a.kinds) <= {"fwd", "train"} or not a.kinds:
        ap.error(f"--kinds: fwd and / or train; got {a.kinds}")
    if a.iid is None:
        a.iid = "0.05" if a.smoke else "0.003,0.01,0.03,0.1"
    if a.first_tokens is not None and not max(
            [float(v) for v in a.iid.split(",") if v] or [0.0]) < a.first_tokens < 1:
        ap.error(f"--first-tokens {a.first_tokens}: must be above every --iid density and "
                 "below 1 (e.g. 0.15)")
    if a.out is None:
        a.out = Path(tempfile.mkdtemp(prefix="kernel_bench_")) if a.smoke else \
            Path("outputs/kernel_bench")
    try:  # before any case is timed: a bad --out must not cost a case of device time
        a.out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=a.out).close()
    except OSError as e:
        ap.error(f"--out {a.out}: not a writable folder ({e.strerror}); pass one you can write")
    return a


def smoke_layer(folder: Path) -> Path:
    """A tiny synthetic recorded layer (the file format end to end on the CPU)."""
    c = iid_case(64, 32, 300, 0.03, seed=1, device="cpu")
    return save_ffn_layer(folder / "acts_smoke_l0.safetensors", c.x, c.wg, c.wu, c.wd,
                          {"size": "smoke", "layer": 0})


def main(argv=None) -> int:
    a = parse_args(argv)
    if not a.smoke and not torch.cuda.is_available():
        sys.exit("bench_real_layers.py needs a CUDA GPU (or --smoke on the CPU)")
    dev = "cpu" if a.smoke else "cuda"
    timer = cpu_timer if a.smoke else gpu_timer
    m, d, h = (64, 32, 300) if a.smoke else (int(v) for v in a.shape.split(","))
    layers = [Path(p) for p in a.layers.split(",") if p]
    if a.smoke and not layers:
        layers = [smoke_layer(a.out)]
    policy = FFNPolicy.from_env()
    paper = load_paper_ops(a.paper_src)
    where = torch.cuda.get_device_name() if dev == "cuda" else "CPU smoke run"
    header = f"{where}, torch {torch.__version__}; policy {policy}"
    print(f"# {header}; {a.rounds} timing rounds", flush=True)
    if a.smoke:
        header += (" (CPU: wall by the host clock; the 'kernels' are the top-level PyTorch "
                   "ops: the code path only, not a GPU measure)")
    cases = [("real_layers", lambda p=p: recorded_case(p, device=dev)) for p in layers]
    cases += [("iid", lambda v=float(v): iid_case(m, d, h, v, device=dev))
              for v in a.iid.split(",") if v]
    if a.first_tokens is not None:
        cases += [("iid", lambda v=float(v): first_token_case(
            m, d, h, v, first_density=a.first_tokens, seq_len=min(2048, m), device=dev))
            for v in a.iid.split(",") if v]
    rows, status = run_cases(cases, policy, paper, timer, header, out=a.out, kinds=a.kinds,
                             rounds=a.rounds, profile=a.profile)
    print(f"# wrote {a.out}/real_layers.csv, {a.out}/iid.csv"
          + (f", {a.out}/kernel_profile.md, {a.out}/kernel_profile.csv" if a.profile else "")
          + (" (smoke: CPU times, not performance numbers)" if a.smoke else ""))
    print(summary_table(rows["real_layers"] + rows["iid"]))
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
