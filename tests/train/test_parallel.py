"""FSDP2 settings from accelerate's launcher variables (train/parallel.py): what the trainer
honours, what it refuses (one line naming the YAML key), and the variables accelerate's launcher
really exports for configs/accelerate/fsdp2.yaml; a multi-process launch on a machine without
GPUs needs trainer.cpu=true. The sharded training itself runs in
tests/e2e/test_train_multiprocess.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.train_utils import tiny_config, write_tokens
from train.config import ConfigError
from train.parallel import (
    FSDPSettings,
    check_launch,
    fsdp_settings_from_env,
    hidden_from_accelerate,
)

ROOT = Path(__file__).resolve().parents[2]
BASE = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


def test_a_launch_the_accelerator_would_not_join_is_refused(monkeypatch):
    """accelerate launch --num_processes 2 without a GPU and without trainer.cpu=true: each
    rank would train alone (accelerate: distributed_type NO, 1 process); say so."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    two = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1"}
    with pytest.raises(ConfigError) as err:
        check_launch(False, two)
    msg = str(err.value)
    assert msg.startswith("the launcher started 2 processes (WORLD_SIZE=2) but this machine has "
                          "no GPU and trainer.cpu=false") and "add trainer.cpu=true" in msg
    check_launch(True, two)  # DDP over gloo
    check_launch(False, {})  # a plain process
    check_launch(False, {"WORLD_SIZE": "1"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE=2\) but it has 1 GPU\(s\); launch "
                                          r"with --num_processes 1"):
        check_launch(False, two)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_launch(False, two)


def test_the_cli_refuses_it_before_the_run_starts(tmp_path):
    """Through twell-train (the launcher's variables set by hand on one CPU process)."""
    import subprocess

    if __import__("torch").cuda.is_available():
        pytest.skip("the machine has a GPU")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    run_dir = tmp_path / "r"
    r = subprocess.run([sys.executable, "-m", "train", f"hydra.run.dir={run_dir}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and "add trainer.cpu=true" in err[0], err
    assert not run_dir.exists()


def test_settings_from_env():
    assert fsdp_settings_from_env({}) is None
    assert fsdp_settings_from_env({"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "1"}) is None
    assert fsdp_settings_from_env(BASE) == FSDPSettings(reshard_after_forward=True,
                                                        activation_checkpointing=False)
    got = fsdp_settings_from_env({**BASE, "FSDP_RESHARD_AFTER_FORWARD": "false",
                                  "FSDP_ACTIVATION_CHECKPOINTING": "true"})
    assert got == FSDPSettings(reshard_after_forward=False, activation_checkpointing=True)
    # FSDP1 strategy names, which the launcher passes through unchanged
    assert not fsdp_settings_from_env({**BASE, "FSDP_RESHARD_AFTER_FORWARD": "SHARD_GRAD_OP"}
                                      ).reshard_after_forward


@pytest.mark.parametrize("env,key", [
    ({"FSDP_VERSION": "1"}, "fsdp_version"),
    ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params"),
    ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}, "fsdp_cpu_ram_efficient_loading"),
    ({"FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}, "fsdp_state_dict_type"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "fsdp_auto_wrap_policy"),
    ({"FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaMLP"}, "fsdp_transformer_layer_cls_to_wrap"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "maybe"}, "FSDP_ACTIVATION_CHECKPOINTING"),
])
def test_unsupported_settings_are_refused_naming_the_key(env, key):
    with pytest.raises(ConfigError, match=key) as e:
        fsdp_settings_from_env({**BASE, **env})
    assert "\n" not in str(e.value)


def test_the_launcher_exports_what_fsdp2_yaml_says():
    """accelerate's own launcher code turns configs/accelerate/fsdp2.yaml into the variables."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(ROOT / "configs/accelerate/fsdp2.yaml"), "--num_processes", "2",
         "-m", "train"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    assert fsdp_settings_from_env(env) == FSDPSettings(reshard_after_forward=True,
                                                       activation_checkpointing=True)


def test_hidden_from_accelerate_restores_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with hidden_from_accelerate():
        assert "ACCELERATE_USE_FSDP" not in os.environ
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"


def test_trainer_refuses_compile_and_a_missing_process_group(tmp_path, monkeypatch):
    from train.trainer import Trainer

    tokens = write_tokens(tmp_path / "t.bin", n_tokens=4_000)
    for k, v in BASE.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="trainer.compile"):
        Trainer(tiny_config(tokens, **{"trainer.compile": True}), tmp_path / "a")
    with pytest.raises(ConfigError, match="accelerate launch --config_file"):
        Trainer(tiny_config(tokens), tmp_path / "b")


def _reinit_worker(out: str) -> None:
    """torchrun worker of the re-init test: the same re-init on an FSDP-sharded and on an
    unsharded copy of one model; rank 0 saves both gate weights."""
    import torch
    from accelerate import Accelerator

    from train.config import ModelConfig
    from train.model import build_model, ffn_modules
    from train.parallel import apply_fsdp2, end_process_group, plain
    from train.sparsity import reinit_dead_gates

    acc = Accelerator(cpu=True)
    cfg = ModelConfig(name="t", vocab_size=64, hidden_size=32, intermediate_size=37, num_layers=2,
                      num_heads=2, seq_len=16)  # H = 37: uneven shards (19 + 18 rows)
    models = []
    for shard in (False, True):
        torch.manual_seed(0)
        m = build_model(cfg)
        if shard:
            apply_fsdp2(m, FSDPSettings(), device=acc.device, world_size=2, param_dtype=None)
        dead_LH = torch.zeros(2, 37, dtype=torch.bool)
        dead_LH[0, [0, 5, 18, 19, 36]] = True  # both sides of the shard boundary
        dead_LH[1, 20:] = True
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            reinit_dead_gates(ffn_modules(m), dead_LH, lam=0.5, std=0.02, generator=gen)
        models.append({f"{i}": plain(f.gate_proj.weight.detach()).clone()
                       for i, f in enumerate(ffn_modules(m))})
    if acc.is_main_process:
        torch.save(models, out)
    acc.wait_for_everyone()
    end_process_group()  # left to the interpreter's shutdown, gloo can abort a rank (SIGABRT)


def test_dead_unit_reinit_on_sharded_weights_equals_unsharded(tmp_path):
    import socket
    import subprocess

    import torch

    out = tmp_path / "w.pt"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                             "2", "--master_port", str(port), "-m", "tests.train.test_parallel",
                             str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.terminate()  # torchrun stops its workers on SIGTERM
            proc.communicate(timeout=30)
    assert proc.returncode == 0, log[-3000:]
    plain_w, sharded_w = torch.load(out)
    for k in plain_w:
        assert torch.equal(plain_w[k], sharded_w[k]), k
    # and the re-init did something: dead rows moved, live rows did not (vs a fresh init)
    from train.config import ModelConfig
    from train.model import build_model, ffn_modules

    torch.manual_seed(0)
    fresh = build_model(ModelConfig(name="t", vocab_size=64, hidden_size=32,
                                    intermediate_size=37, num_layers=2, num_heads=2, seq_len=16))
    w0 = ffn_modules(fresh)[0].gate_proj.weight.detach()
    moved = (plain_w["0"] != w0).any(dim=1)
    assert moved.nonzero().flatten().tolist() == [0, 5, 18, 19, 36]


if __name__ == "__main__":
    _reinit_worker(sys.argv[1])
