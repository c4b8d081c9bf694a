"""FSDP2 settings from accelerate's launcher variables (train/parallel.py): what the trainer
honours, what it refuses (one line naming the YAML key), and the variables accelerate's launcher
really exports for configs/accelerate/fsdp2.yaml. The sharded training itself runs in
tests/test_train_multiprocess.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.train_utils import tiny_config, write_tokens
from train.config import ConfigError
from train.parallel import FSDPSettings, fsdp_settings_from_env, hidden_from_accelerate

ROOT = Path(__file__).resolve().parent.parent
BASE = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


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
