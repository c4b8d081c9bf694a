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
