"""Multi-process training on CPU (gloo) launched as on GPUs, with
``accelerate launch --config_file configs/accelerate/{ddp,fsdp2}.yaml --num_processes 2``:
DDP and FSDP2 against one process over the same global batch, checkpoints resumed on another
number of processes (and from FSDP to unsharded and back), and a dense-backup capacity overflow
on one rank redone on every rank.

Setup (``tests/ddp_worker.py``; ``ffn.impl=twell`` on the sparse training op's PyTorch
backend: no ``TRITON_INTERPRET``, so the runs take seconds): the tiny test model with FFN width
H = 32 (ELL capacity 16: at initialisation every forward has light rows on the ELL path and
heavy rows on the dense backup), L1 = 0.5, dead-unit re-init on (its noise is drawn every step),
AdamW at a constant lr 3e-3, 4 steps of 4 sequences x 32 tokens, a checkpoint at step 2. One
process: micro-batch 4; two processes: micro-batch 2 each. fsdp2.yaml also turns on activation
checkpointing (each decoder layer recomputed in the backward). Step 1 measures the dense-backup
capacity per call; steps 2-4 run without host sync on the capacity from the step before.

Tolerances (fp32; measured differences in parentheses, this CPU) as in
tests/e2e/test_train_ddp_twell.py, whose docstring derives them: loss / CE / L1 abs 1e-5 (<= 5e-7),
grad norm (before clipping) rel 1e-5 (<= 1.1e-7; a missing or doubled gradient reduction changes
it by ~2x), parameters after 4 steps max abs 1e-5 (<= 1.4e-7; every matrix moved by ~4 lr, a
rank applying its own gradient would differ by ~lr on many elements), L0 rel 1e-3, max active
units and dead fraction exactly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.train_utils import read_metrics, write_tokens

ROOT = Path(__file__).resolve().parents[2]
LR = 3e-3
STEPS = 4
COMMON = ["model.intermediate_size=32", "sparsity.l1_coeff=0.5", "optim.warmup_steps=0",
          'optim.schedule="constant"', f"optim.lr={LR}", "trainer.global_batch=4",
          'ffn.impl="twell"', "trainer.save_every=2", "sparsity.reinit_dead=true"]
ACCELERATE = Path(sys.executable).parent / "accelerate"
TIMEOUT = 240  # s per launch; a rank waiting for a collective the other skipped hangs until then
pytestmark = pytest.mark.slow


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("TRITON_INTERPRET", None)  # the op's PyTorch backend (scripts/test.sh sets it)
    return env


def _free_port() -> int:
    with socket.socket() as s:  # concurrent launches must not share the rendezvous port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir: Path, tokens: Path, kind: str, *args: str, micro_batch: int | None = None,
            over: tuple[str, ...] = ()):
    """Start one worker run: kind one (a plain process), ddp or fsdp (2 processes through
    ``accelerate launch`` with that config). Returns the Popen."""
    nproc = 1 if kind == "one" else 2
    launch = ([sys.executable] if kind == "one" else
              [str(ACCELERATE), "launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / ("ddp.yaml" if kind == "ddp" else "fsdp2.yaml")),
               "--num_processes", "2", "--main_process_port", str(_free_port())])
    mb = micro_batch or 4 // nproc
    cmd = [*launch, "-m", "tests.ddp_worker", "--tokens", str(tokens), "--run-dir", str(run_dir),
           "--steps", str(STEPS), *args, "--over", *COMMON, f"trainer.micro_batch={mb}", *over]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen) -> str:
    """End a launch: SIGTERM (the launcher's torchrun agent then stops its workers), then
    SIGKILL; returns its output."""
    proc.terminate()
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]


def _wait(runs: dict) -> None:
    """Wait for every launch; on a failure or timeout stop the others too (no stray ranks)."""
    try:
        for name, proc in runs.items():
            try:
                out, _ = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                out = _stop(proc)
                pytest.fail(f"{name} did not finish in {TIMEOUT} s (a rank waiting on a "
                            f"collective the others skipped?):\n{out[-3000:]}")
            assert proc.returncode == 0, f"{name} failed:\n{out[-3000:]}"
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                _stop(proc)


def _load(path: Path):
    return torch.load(path, weights_only=True)


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _calls(run: Path, rank: int) -> list[dict]:
    """The rank's sparse FFN forwards, without the recomputations of activation checkpointing
    (fsdp2.yaml turns it on: each attempt's forward L0, L1 is followed in the backward by
    L1, L0 again, which must repeat the forward's rows and capacities)."""
    calls = json.loads((run / f"ffn_calls_rank{rank}.json").read_text())
    if "fsdp" not in run.name:
        return calls
    assert len(calls) % 4 == 0, calls
    fwd = []
    for i in range(0, len(calls), 4):
        assert calls[i + 2:i + 4] == calls[i:i + 2][::-1], calls[i:i + 4]
        fwd += calls[i:i + 2]
    return fwd


def _rows(batches: list[torch.Tensor]) -> list[tuple]:
    return sorted(tuple(r.tolist()) for b in batches for r in b)


def _assert_same_steps(got: list[dict], want: list[dict], label: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want], label
    for a, b in zip(got, want):
        for key in ("loss", "ce", "l1"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (label, a["step"], key)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (label, a["step"])
        assert a["l0_mean"] == pytest.approx(b["l0_mean"], rel=1e-3), (label, a["step"])
        assert a["nnz_max"] == b["nnz_max"] and a["dead_frac"] == b["dead_frac"], label
        assert a["tokens"] == b["tokens"] == a["step"] * 4 * 32, label


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 4-step runs: one process, DDP, FSDP and FSDP in bf16 (all at once)."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    tokens = write_tokens(tmp / "train.bin", n_tokens=8_000)
    runs = {kind: _launch(tmp / kind, tokens, kind) for kind in ("one", "ddp", "fsdp")}
    runs["fsdp_bf16"] = _launch(tmp / "fsdp_bf16", tokens, "fsdp",
                                over=('trainer.precision="bf16"',))
    _wait(runs)
    return tmp, tokens


def test_ddp_and_fsdp_match_one_process(straight):
    tmp, _ = straight
    one = tmp / "one"
    init = _load(one / "init_params.pt")
    final = _load(one / "params_rank0.pt")
    want = read_metrics(one)
    assert [r["step"] for r in want] == [1, 2, 3, 4] and want[-1]["loss"] < want[0]["loss"]
    moved = {k: (final[k] - init[k]).abs().max().item() for k in final if final[k].dim() == 2}
    assert all(2 * LR < m < 5 * LR for m in moved.values()), moved
    one_batches = _load(one / "batches_rank0.pt")
    assert len(one_batches) == STEPS and one_batches[0].shape == (4, 32)
    for kind in ("ddp", "fsdp"):
        run = tmp / kind
        assert all(torch.equal(init[k], v) for k, v in _load(run / "init_params.pt").items())
        p0, p1 = _load(run / "params_rank0.pt"), _load(run / "params_rank1.pt")
        assert all(torch.equal(p0[k], p1[k]) for k in p0), f"{kind}: replicas diverged"
        assert _max_abs_diff(p0, final) < 1e-5, kind
        _assert_same_steps(read_metrics(run), want, kind)
        # the data shards: each step the two ranks read disjoint halves of one process's batch
        b0, b1 = _load(run / "batches_rank0.pt"), _load(run / "batches_rank1.pt")
        assert len(b0) == len(b1) == STEPS
        for step, (x0, x1, x) in enumerate(zip(b0, b1, one_batches)):
            assert x0.shape == x1.shape == (2, 32)
            assert not set(_rows([x0])) & set(_rows([x1])), (kind, step)
            assert _rows([x0, x1]) == _rows([x]), (kind, step)
        # the sparse op ran on both paths, on every rank, on whole (unsharded) weights
        for r in (0, 1):
            calls = _calls(run, r)
            assert len(calls) == STEPS * 2  # 2 layers, no step redone
            assert {c["backend"] for c in calls} == {"torch"}  # the PyTorch backend on the CPU
            assert all(c["light"] > 0 and c["heavy"] > 0 and c["n"] == 64 for c in calls), calls
            assert all(c["w_type"] == "Parameter" and c["w_shape"] == [32, 32] for c in calls)
            assert [c["backup_rows"] for c in calls[:2]] == [-1, -1]
            assert all(c["backup_rows"] >= c["heavy"] for c in calls[2:]), calls
    # FSDP really sharded: every rank holds half the rows of each matrix (weights, AdamW state)
    for r in (0, 1):
        shards = json.loads((tmp / "fsdp" / f"shards_rank{r}.json").read_text())
        assert shards["model.layers.0.mlp.gate_proj.weight"] == [16, 32]
        assert shards["model.layers.1.mlp.down_proj.weight"] == [16, 32]  # (D, H) rows: D / 2
        assert shards["model.embed_tokens.weight"] == [32, 32]  # 64 vocab rows / 2
    assert json.loads((tmp / "ddp" / "shards_rank1.json").read_text())[
        "model.layers.0.mlp.gate_proj.weight"] == [32, 32]


def test_fsdp_bf16_computes_in_bf16_over_fp32_master_weights(straight):
    """precision=bf16 under FSDP: the op receives bf16 copies of the gathered weights, the
    master weights stay fp32, and the losses follow the fp32 run within bf16 noise (abs 5e-3;
    measured <= 4e-4; bf16 keeps 8 bits of mantissa: ~4e-3 relative per rounding)."""
    tmp, _ = straight
    run = tmp / "fsdp_bf16"
    for r in (0, 1):
        calls = _calls(run, r)
        assert calls and {c["w_dtype"] for c in calls} == {"bfloat16"}
    assert {v.dtype for v in _load(run / "params_rank0.pt").values()} == {torch.float32}
    assert {c["w_dtype"] for c in _calls(tmp / "fsdp", 0)} == {"float32"}
    got, want = read_metrics(run), read_metrics(tmp / "one")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], abs=5e-3), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-2), a["step"]


# source run, launch kind of the resumed run, its micro-batch (2 on 1 process and 1 on 2:
# 2 micro-steps per step, DDP's no_sync and FSDP's per-micro-step reduce-scatter)
RESUMES = {"ddp_to_one": ("ddp", "one", 2), "one_to_ddp": ("one", "ddp", 1),
           "fsdp_to_one": ("fsdp", "one", 4), "one_to_fsdp": ("one", "fsdp", 1)}


def test_checkpoint_resumes_on_another_number_of_processes(straight):
    """Step-2 checkpoints of 1 process, DDP and FSDP continue on another number of processes
    (sharded <-> unsharded) exactly like the uninterrupted runs: the same blocks each step, the
    same losses, gradient norms, sparsity and final weights (fp32 tolerance)."""
    tmp, tokens = straight
    runs = {name: _launch(tmp / name, tokens, kind, "--resume",
                          str(tmp / src / "checkpoints" / "step2"), micro_batch=mb)
            for name, (src, kind, mb) in RESUMES.items()}
    _wait(runs)
    meta = json.loads((tmp / "fsdp" / "checkpoints" / "step2" / "metadata.json").read_text())
    assert meta["world_size"] == 2
    want = read_metrics(tmp / "one")
    one_batches = _load(tmp / "one" / "batches_rank0.pt")
    final = _load(tmp / "one" / "params_rank0.pt")
    for name, (src, kind, mb) in RESUMES.items():
        run = tmp / name
        got = read_metrics(run)
        assert [r["step"] for r in got] == [3, 4], name
        _assert_same_steps(got, want[2:], name)
        _assert_same_steps(got, read_metrics(tmp / src)[2:], name)  # the source's own steps 3-4
        assert _max_abs_diff(_load(run / "params_rank0.pt"), final) < 1e-5, name
        nproc = 1 if kind == "one" else 2
        read = [_load(run / f"batches_rank{r}.pt") for r in range(nproc)]
        per_step = 4 // (nproc * mb)  # micro-batches per step and rank
        for k in range(2):  # the blocks of steps 3 and 4 are those of the straight run
            mine = [x for b in read for x in b[k * per_step:(k + 1) * per_step]]
            assert _rows(mine) == _rows([one_batches[2 + k]]), (name, k)


def test_capacity_overflow_on_one_rank_is_redone_on_every_rank(straight):
    """A fixed capacity C (``--capacity``) between the two ranks' heavy-row counts of step 2:
    one rank's FFN calls overflow, the other's do not. The overflow is decided on the heavy-row
    maxima all-reduced over the ranks, so both ranks discard the attempt and redo step 2
    measuring per call (a rank that went on alone would leave the other waiting in a
    collective: the launch would time out); the run still matches one process."""
    tmp, tokens = straight
    heavy = [[c["heavy"] for c in _calls(tmp / "ddp", r)[2:4]] for r in (0, 1)]  # step 2
    cap = min(max(h) for h in heavy)
    assert max(max(h) for h in heavy) > cap, f"the ranks' step-2 heavy rows tie: {heavy}"
    runs = {kind: _launch(tmp / f"overflow_{kind}", tokens, kind, "--capacity", str(cap))
            for kind in ("ddp", "fsdp")}
    _wait(runs)
    for kind in ("ddp", "fsdp"):
        run = tmp / f"overflow_{kind}"
        calls = [_calls(run, r) for r in (0, 1)]
        first = [c[2:4] for c in calls]  # step 2, first attempt, capacity C
        assert all(c["backup_rows"] == cap for f in first for c in f)
        over = [any(c["heavy"] > cap for c in f) for f in first]
        assert sorted(over) == [False, True], (kind, first)  # only one rank overflowed
        # both ranks redid step 2 per call (-1) and went on with the same decisions
        assert [c["backup_rows"] for c in calls[0]] == [c["backup_rows"] for c in calls[1]]
        assert [c["backup_rows"] for c in calls[0][:6]] == [-1, -1, cap, cap, -1, -1], kind
        got = read_metrics(run)
        assert got[1].get("ffn_backup_redos", 0) >= 1 and "ffn_backup_redos" not in got[0]
        _assert_same_steps(got, read_metrics(tmp / "one"), kind)
        assert _max_abs_diff(_load(run / "params_rank0.pt"),
                             _load(tmp / "one" / "params_rank0.pt")) < 1e-5, kind


def test_ddp_with_lean_saves_is_bitwise_the_same(straight):
    """trainer.recompute_norms / recast_attn_weights forced on under DDP (their default turns
    them on in DDP runs on GPUs): the same losses, gradient norms and final weights on both
    ranks, bitwise, as without them; fp32 (the norm outputs recomputed) and bf16 autocast (the
    attention weights' casts recast)."""
    tmp, tokens = straight
    lean = ("trainer.recompute_norms=true", "trainer.recast_attn_weights=true")
    bf16 = ('trainer.precision="bf16"',)
    runs = {"ddp_lean": _launch(tmp / "ddp_lean", tokens, "ddp", over=lean),
            "ddp_bf16": _launch(tmp / "ddp_bf16", tokens, "ddp", over=bf16),
            "ddp_bf16_lean": _launch(tmp / "ddp_bf16_lean", tokens, "ddp", over=bf16 + lean)}
    _wait(runs)
    for plain, on in (("ddp", "ddp_lean"), ("ddp_bf16", "ddp_bf16_lean")):
        got, want = read_metrics(tmp / on), read_metrics(tmp / plain)
        assert [r["step"] for r in got] == [1, 2, 3, 4], on
        assert [(r["loss"], r["grad_norm"]) for r in got] == \
            [(r["loss"], r["grad_norm"]) for r in want], on
        for r in (0, 1):
            a, b = _load(tmp / on / f"params_rank{r}.pt"), _load(tmp / plain / f"params_rank{r}.pt")
            assert all(torch.equal(a[k], b[k]) for k in b), (on, r)
