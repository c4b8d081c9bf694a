"""Throughput metrics: the MFU formula (hand-computed and counted by torch's FlopCounterMode) and
the trainer's per-interval peak memory (readers faked, so the interval logic is what is tested;
and the real CPU readers: an earlier peak in the process is not the run's)."""

from pathlib import Path

import pytest
import torch

from tests.train_utils import read_metrics, tiny_config, write_tokens
from train import metrics_log
from train.config import ConfigError, ModelConfig, TrainerConfig
from train.metrics import device_peak_flops, flops_per_token, matmul_params, mfu
from train.trainer import Trainer


def _tiny_model_cfg(**kw):
    return ModelConfig(name="t", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, seq_len=32, **kw)


def test_flops_per_token_hand_computed():
    c = _tiny_model_cfg()
    # per layer: attention q, k, v, o 4 x 32 x 32 = 4096; gated FFN 3 x 32 x 64 = 6144
    # two layers 20480, LM head 64 x 32 = 2048 -> N_matmul 22528
    assert matmul_params(c) == 22528
    # 6 N = 135168; attention 12 L D T = 12 x 2 x 32 x 32 = 24576
    assert flops_per_token(c) == 159744
    # useful at L0 16 and 32 of H = 64: the up and down products skip 3/4 and 1/2 of the units:
    # 6 x 32 x 64 x 2 x (0.75 + 0.5) = 30720
    assert flops_per_token(c, [16, 32]) == 159744 - 30720
    assert flops_per_token(c, [64, 64]) == flops_per_token(c)  # fully dense: nothing skipped
    ng = _tiny_model_cfg(gated=False)  # FFN 2 D H, only the down product is sparse
    assert flops_per_token(ng) == 6 * (2 * (4096 + 2 * 32 * 64) + 2048) + 24576
    assert flops_per_token(ng, [0, 0]) == flops_per_token(ng) - 6 * 32 * 64 * 2
    gqa = _tiny_model_cfg(num_kv_heads=1)  # k and v project to one head of 16
    assert matmul_params(gqa) == 22528 - 2 * 2 * 32 * 16
    with pytest.raises(ValueError, match="layers"):
        flops_per_token(c, [1.0])
    # MFU: 159744 FLOPs/token at 1e6 tokens/s on a 1 TFLOP/s device
    assert mfu(159744, 1e6, 1e12) == pytest.approx(0.159744)
    assert mfu(159744, 1e6, None) is None


def test_dense_flops_match_flop_counter_of_a_training_step():
    """An independent count: torch's FlopCounterMode over forward + backward of the real model
    (eager attention, so the score products are counted as the matmuls they are)."""
    from torch.utils.flop_counter import FlopCounterMode

    from train.model import build_model

    c = _tiny_model_cfg()
    torch.manual_seed(0)
    model = build_model(c)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 64, (2, c.seq_len))
    with FlopCounterMode(display=False) as fc:
        model(input_ids=ids, labels=ids).loss.backward()
    assert fc.get_total_flops() == flops_per_token(c) * ids.numel()


def test_device_peak_flops():
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, "fp32") is None
    assert device_peak_flops(cpu, "bf16") is None
    assert device_peak_flops(cpu, "fp32", 10.0) == 10e12
    with pytest.raises(ConfigError, match="trainer.peak_tflops"):
        TrainerConfig(peak_tflops=0.0)


def _fake_memory(monkeypatch, used_at_step: dict[int, float]):
    """Readers of a fake device whose peak since the last reset is the largest usage of the steps
    run since; ``resets`` counts the resets."""
    state = {"peak": 0.0, "resets": 0}
    step = Trainer.train_step

    def step_and_use(self, batches, interval):
        step(self, batches, interval)
        state["peak"] = max(state["peak"], used_at_step[self.step])

    def reset(_device):
        state["peak"] = 0.0
        state["resets"] += 1

    monkeypatch.setattr(Trainer, "train_step", step_and_use)
    monkeypatch.setattr(metrics_log, "peak_memory_gb", lambda _device: state["peak"])
    monkeypatch.setattr(metrics_log, "reset_peak_memory", reset)
    return state


def test_peak_memory_per_log_interval_and_run_maximum(tmp_path, monkeypatch):
    tokens = write_tokens(tmp_path / "t.bin", n_tokens=20_000)
    state = _fake_memory(monkeypatch, {1: 5.0, 2: 1.0, 3: 2.0, 4: 1.5, 5: 3.0, 6: 0.5})
    cfg = tiny_config(tokens, **{"trainer.max_steps": 6, "trainer.log_every": 2})
    t = Trainer(cfg, tmp_path / "run")
    t.train()
    t.close()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [2, 4, 6]
    # a high first interval (model set-up, dense start) does not hide the later, lower ones
    assert [r["peak_mem_gb"] for r in rows] == [5.0, 2.0, 3.0]
    assert [r["peak_mem_gb_run"] for r in rows] == [5.0, 5.0, 5.0]
    assert state["resets"] == 4  # when training starts, then after each log line
    # tokens/s and MFU keys are in every line; no MFU on CPU (no peak rate known)
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None and r["mfu_useful"] is None
               for r in rows)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                    reason="Linux's /proc: the resident set's high-water mark can be reset")
def test_a_later_run_in_the_process_does_not_report_an_earlier_peak(tmp_path):
    """The real CPU readers: 400 MiB touched and freed before a run (an earlier sweep job) do
    not show in the run's peak memory."""
    tokens = write_tokens(tmp_path / "t.bin", n_tokens=8000)
    big = bytearray(400 * 2**20)
    big[::4096] = b"x" * len(big[::4096])  # resident, page by page
    del big  # an mmap'ed block: back to the system
    before = metrics_log.peak_memory_gb(torch.device("cpu"))  # the process's peak so far
    t = Trainer(tiny_config(tokens, **{"trainer.max_steps": 2}), tmp_path / "run")
    t.train()
    t.close()
    rows = read_metrics(tmp_path / "run")
    assert rows and all(0 < r["peak_mem_gb_run"] < before - 0.3 for r in rows), (before, rows)


def test_mfu_logged_with_a_configured_peak(tmp_path):
    tokens = write_tokens(tmp_path / "t.bin", n_tokens=20_000)
    cfg = tiny_config(tokens, **{"trainer.max_steps": 2, "trainer.peak_tflops": 1e-3,
                                 "sparsity.l1_coeff": 0.5})
    t = Trainer(cfg, tmp_path / "run")
    t.train()
    line = Trainer._format(t.last)
    t.close()
    for r in read_metrics(tmp_path / "run"):
        want = flops_per_token(cfg.model) * r["tokens_per_s"] / 1e9
        assert r["mfu"] == pytest.approx(want, rel=1e-9)
        useful = flops_per_token(cfg.model, r["l0_layers"]) * r["tokens_per_s"] / 1e9
        assert r["mfu_useful"] == pytest.approx(useful, rel=1e-9)
        assert r["mfu_useful"] <= r["mfu"]
    assert "mfu" in line and "tok/s" in line and "(run " in line


def test_the_step_line_shows_the_coefficient_only_when_asked():
    """format_record: the constant schedule's line is unchanged (no coefficient); with
    show_coeff (a schedule whose coefficient moves) ``l1 coeff`` follows the learning rate."""
    m = {"step": 7, "loss": 2.5, "ce": 2.25, "l1": 0.5, "l1_coeff": 3.8123e-4, "l0_mean": 29.04,
         "l0_min": 20.0, "l0_max": 40.0, "nnz_max": 120.0, "dead_frac": 0.025, "lr": 1e-3,
         "grad_norm": 0.75, "tokens_per_s": 1234.4, "mfu": None, "peak_mem_gb": 1.5,
         "peak_mem_gb_run": 2.0}
    plain = ("step 7: loss 2.5000 ce 2.2500 l1 0.5 l0 29.0 [20.0-40.0] max 120 dead 2.5% "
             "lr 0.001 gnorm 0.75 1234 tok/s mem 1.50 GB (run 2.00)")
    assert metrics_log.format_record(m) == plain
    assert metrics_log.format_record(m, show_coeff=True) == plain.replace(
        "lr 0.001 gnorm", "lr 0.001 l1 coeff 0.000381 gnorm")


CUDA = torch.device("cuda")


class _CudaPeak:
    """A CUDA device's peak-allocation counter, faked on torch.cuda's reader and resetter (what
    the metrics, the failed step's release and the re-plan call): ``use(gb)`` allocates up to
    ``gb`` GiB and frees it again; a reset sets the peak to what stays allocated."""

    def __init__(self, monkeypatch, held_gb: float = 1.0) -> None:
        self.held, self.peak, self.resets = held_gb, held_gb, 0
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak * 2**30)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def use(self, gb: float) -> None:
        self.peak = max(self.peak, gb)

    def reset(self, device=None) -> None:
        self.peak, self.resets = self.held, self.resets + 1


def _cuda_metrics(tmp_path) -> metrics_log.MetricsLogger:
    acc = type("Acc", (), {"device": CUDA, "num_processes": 1})()
    return metrics_log.MetricsLogger(tmp_path / "metrics.jsonl", acc, _tiny_model_cfg(), None,
                                     is_main=False)


def _peaks(m: metrics_log.MetricsLogger) -> tuple[float, float]:
    """``(peak_mem_gb, peak_mem_gb_run)`` of a log line of one made-up step (CPU tensors)."""
    from types import SimpleNamespace

    iv = metrics_log.Interval.zeros(2, "cpu")
    iv.steps, iv.ffn_tokens, iv.grad_norm, iv.lr, iv.l1_coeff = 1, 1, torch.tensor(1.0), 0.1, 0.0
    r = m.train_record(iv, step=1, tokens_seen=1, dead_L=None, plan=SimpleNamespace(layers=[]),
                       auto=False)
    return r.peak_mem_gb, r.peak_mem_gb_run


class _FailingTrainer:
    """What ``train.loop.guarded_step`` uses of a trainer: each ``run_step`` attempt allocates
    up to its GiB, the ``"oom"`` ones then run out of memory and step down."""

    def __init__(self, metrics, cuda: _CudaPeak, attempts: list) -> None:
        from types import SimpleNamespace

        self.metrics, self.cuda, self.attempts = metrics, cuda, iter(attempts)
        self.device, self.world_size, self.update_began, self.step, self.mlps = CUDA, 1, False, 0, []
        self.optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        self.data = SimpleNamespace(state_dict=dict)
        self.runlog = SimpleNamespace(print=lambda line, bar=None: None)
        self.memory = SimpleNamespace(step_down=lambda: "stepped down", record={},
                                      after_step=lambda: None)

    def run_step(self, batches, interval) -> None:
        gb, outcome = next(self.attempts)
        self.cuda.use(gb)
        if outcome == "oom":
            raise torch.cuda.OutOfMemoryError("simulated: CUDA out of memory")
        self.step += 1


def test_a_failed_step_keeps_the_peaks_before_it(tmp_path, monkeypatch):
    """The release after a failed step (train.memory.release_failed_step, before the redo)
    resets the device's peak counter: the interval's peak and the run's still hold the steps
    before the failure, and the failed attempt's own allocations (the run held them)."""
    from train.loop import guarded_step

    cuda = _CudaPeak(monkeypatch)
    m = _cuda_metrics(tmp_path)
    m.reset_peak()
    # interval 1: 4 GiB, an attempt out of memory after 6, its redo at 3
    # interval 2: 8 GiB, an attempt out of memory after 5 (a larger block failed), redo at 2
    tr = _FailingTrainer(m, cuda, [(4.0, "ok"), (6.0, "oom"), (3.0, "ok"),
                                   (8.0, "ok"), (5.0, "oom"), (2.0, "ok"), (1.5, "ok")])
    assert [guarded_step(tr, None, None, None) for _ in range(3)] == [True, False, True]
    assert _peaks(m) == (6.0, 6.0)
    assert [guarded_step(tr, None, None, None) for _ in range(3)] == [True, False, True]
    assert _peaks(m) == (8.0, 8.0)
    assert guarded_step(tr, None, None, None)
    assert _peaks(m) == (1.5, 8.0)  # nothing held over from the interval before
    assert cuda.resets == 1 + 2 + 3  # start, each release, each log line


def test_a_re_plan_keeps_the_peaks_of_the_steps_before_it(tmp_path, monkeypatch):
    """A re-plan's probes reset the device's peak counter (each probe measures its own) and the
    re-plan resets it after them: the interval's peak still holds the steps before it and none
    of the probes'."""
    from types import SimpleNamespace

    from train.memory import Measurement, MemoryPlanner, TrainerMemory

    cuda = _CudaPeak(monkeypatch)
    m = _cuda_metrics(tmp_path)
    m.reset_peak()

    def probe(c):  # as train.memory.ProbeRunner: a reset, then the probe's own peak
        cuda.reset()
        cuda.use(50.0)
        return Measurement(10.0 + c.micro_batch, 1.0 + c.micro_batch)

    tr = SimpleNamespace(device=CUDA, metrics=m, step=3, optimizer=torch.optim.SGD(
        [torch.zeros(1, requires_grad=True)], lr=0.1), set_step_shape=lambda *a: None,
        cfg=SimpleNamespace(model=SimpleNamespace(seq_len=32)))
    tm = TrainerMemory(tr)
    tm.probe = probe
    tm.planner = MemoryPlanner(probe, batch_per_rank=4, seq_len=32, budget_gb=100.0,
                               recompute=("none",))
    tm.apply(tm.planner.choose())
    cuda.reset()  # the run starts (plan_memory, train.loop.run)
    cuda.use(7.0)  # the steps before the re-plan
    tm.replan("test")
    cuda.use(2.0)  # the steps after it
    assert _peaks(m) == (7.0, 7.0)
