"""Data parallelism with ``ffn.impl=twell``: 2 gloo ranks on CPU (torchrun), the sparse
training kernels in the Triton interpreter (``TRITON_INTERPRET=1``), against one process on the
same global batch, and against the dense PyTorch path.

Setup (``tests/ddp_worker.py``): the tiny test model with FFN width H = 32, whose ELL capacity is
16 (``twell.stats.default_ell_capacity``), so at initialisation (~50 % of units
active) every forward has both light rows (<= 16 active units: the ELL SDDMM/SpMM/dW kernels)
and heavy rows (the dense backup) -- the test checks that both ran, on every rank. L1 = 0.5 so
the L1 gradient through the kernels matters; AdamW at a constant lr 3e-3 from step 1 (no
warmup), 2 steps of 4 sequences x 32 tokens; DDP: 2 ranks x micro-batch 2, single process:
micro-batch 4. Rank r reads blocks ``perm[r::2]``, so the two ranks together read exactly the
single process's blocks at every step (``train.data.packing``).

Tolerances (fp32; measured differences in parentheses, this CPU):

* loss / CE / L1 per step, abs 1e-5 (<= 6e-7). Step 1 differs only by summation order (per-rank
  means averaged vs one mean; row blocks of 64 vs 128 in the GEMMs and kernels): a few fp32
  ulps of ~4. Step 2 adds the parameter differences below.
* grad norm (before clipping), rel 1e-5: catches a missing or doubled all-reduce, which Adam's
  per-element normalisation would hide from the parameters (a constant gradient scale does
  not change an Adam update).
* parameters after 2 steps, max abs 1e-5 (<= 4e-7), while every matrix moved by ~2 x lr = 6e-3.
  Adam's update ``lr * m / (sqrt(v) + eps)`` is ~``lr * sign(g)`` per element, insensitive to
  rounding of g except where |g| is near eps = 1e-8; there an fp32 rounding difference of
  ~1e-11 moves the update by at most ``lr * 1e-11 / (4 eps)`` ~ 1e-6. A rank that applied its
  own un-reduced gradient would differ by up to 2 x lr (~6e-3) on many elements.
* the two ranks' parameters are bitwise equal (they apply the same all-reduced gradient).
* L0 (mean active units per token) within 1e-3 relative, max active units and dead fraction
  exactly: a ReLU boundary flip by rounding would change a count by 1 (none seen).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import read_metrics, write_tokens

ROOT = Path(__file__).resolve().parents[2]
LR = 3e-3
COMMON = ["model.intermediate_size=32", "sparsity.l1_coeff=0.5", "optim.warmup_steps=0",
          'optim.schedule="constant"', f"optim.lr={LR}", "trainer.global_batch=4"]


def _worker(run_dir: Path, tokens: Path, over: list[str], nproc: int, env: dict):
    """Start one worker run (torchrun for nproc > 1); returns the Popen."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
              if nproc > 1 else [sys.executable])
    cmd = [*launch, "-m", "tests.ddp_worker", "--tokens", str(tokens), "--run-dir", str(run_dir),
           "--steps", "2", "--over", *COMMON, *over]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_two_ranks_twell_matches_one_process_and_torch(tmp_path):
    tokens = write_tokens(tmp_path / "train.bin", n_tokens=8_000)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "1", "WANDB_MODE": "disabled"}
    runs = {  # all three at once (~30 s on 2 cores)
        "ddp_twell": _worker(tmp_path / "ddp_twell", tokens,
                             ["trainer.micro_batch=2", 'ffn.impl="twell"'], 2, env),
        "one_twell": _worker(tmp_path / "one_twell", tokens,
                             ["trainer.micro_batch=4", 'ffn.impl="twell"'], 1, env),
        "one_torch": _worker(tmp_path / "one_torch", tokens, ["trainer.micro_batch=4"], 1, env),
    }
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} failed:\n{out[-3000:]}"

    # the sparse kernels really ran, in the interpreter, with light and heavy rows on each rank
    for name, ranks in (("ddp_twell", (0, 1)), ("one_twell", (0,))):
        for r in ranks:
            calls = json.loads((tmp_path / name / f"ffn_calls_rank{r}.json").read_text())
            assert len(calls) == 2 * 2  # 2 steps x 2 layers, one micro-step per step
            assert {c["backend"] for c in calls} == {"triton"}
            assert all(c["light"] > 0 and c["heavy"] > 0 for c in calls), calls
            assert all(c["n"] == (64 if name == "ddp_twell" else 128) for c in calls)
            # step 1 measures per call; step 2 runs without host sync, its dense-backup capacity
            # (the same on every rank: the step's maximum over ranks) holding the heavy rows
            assert [c["backup_rows"] for c in calls[:2]] == [-1, -1]
            assert all(c["backup_rows"] >= c["heavy"] for c in calls[2:]), calls
    assert not json.loads((tmp_path / "one_torch" / "ffn_calls_rank0.json").read_text())

    # same initial weights everywhere (the comparison starts from one point)
    init = _params(tmp_path / "one_torch" / "init_params.pt")
    for name in ("ddp_twell", "one_twell"):
        other = _params(tmp_path / name / "init_params.pt")
        assert all(torch.equal(init[k], other[k]) for k in init)

    ddp0 = _params(tmp_path / "ddp_twell" / "params_rank0.pt")
    ddp1 = _params(tmp_path / "ddp_twell" / "params_rank1.pt")
    assert all(torch.equal(ddp0[k], ddp1[k]) for k in ddp0), "DDP replicas diverged"
    # both steps changed every matrix by about 2 lr (Adam's first updates are ~lr * sign(g))
    moved = {k: (ddp0[k] - init[k]).abs().max().item() for k in ddp0 if ddp0[k].dim() == 2}
    assert all(1.5 * LR < m < 2.5 * LR for m in moved.values()), moved
    for ref in ("one_twell", "one_torch"):
        diff = _max_abs_diff(ddp0, _params(tmp_path / ref / "params_rank0.pt"))
        assert diff < 1e-5, (ref, diff)
    assert _max_abs_diff(_params(tmp_path / "one_twell" / "params_rank0.pt"),
                         _params(tmp_path / "one_torch" / "params_rank0.pt")) < 1e-5

    got = read_metrics(tmp_path / "ddp_twell")
    assert [r["step"] for r in got] == [1, 2]
    for ref in ("one_twell", "one_torch"):
        want = read_metrics(tmp_path / ref)
        assert [r["step"] for r in want] == [1, 2]
        for a, b in zip(got, want):
            for key in ("loss", "ce", "l1"):
                assert a[key] == pytest.approx(b[key], abs=1e-5), (ref, a["step"], key)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (ref, a["step"])
            assert a["l0_mean"] == pytest.approx(b["l0_mean"], rel=1e-3), (ref, a["step"])
            assert a["nnz_max"] == b["nnz_max"] and a["dead_frac"] == b["dead_frac"]
            assert a["tokens"] == b["tokens"] == a["step"] * 4 * 32
    assert got[1]["loss"] < got[0]["loss"]  # the steps did something
