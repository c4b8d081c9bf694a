"""FSDP2 for the trainer: ``fully_shard`` per decoder layer, set up from accelerate's launcher,
and full (gathered) state dicts that load on any number of ranks, sharded or not.

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 \\
        -m train experiment=paper_1p5b

accelerate's launcher turns the YAML's ``fsdp_config`` into ``FSDP_*`` environment variables
and ``ACCELERATE_USE_FSDP=true``; :func:`fsdp_settings_from_env` reads them when the trainer
starts. The trainer then shards the model itself (:func:`apply_fsdp2`, torchtitan's recipe:
each ``LlamaDecoderLayer`` one FSDP group, the root holding the tied embedding / LM head and
the final norm) instead of through ``Accelerator.prepare``. Why: accelerate refuses FSDP on CPU
(gloo), where the CI tests run, and its FSDP2 code changes from release to release; this way
the CPU tests run the code the GPUs run. accelerate still provides the launcher, the process
group, the device and the collectives (``Accelerator.reduce``).

Mixed precision (``trainer.precision``): bf16 = ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the all-gathered weights are bf16 copies of the fp32 master shards, the
gradients are reduce-scattered in fp32 into fp32 shards, AdamW updates fp32 (no autocast: the
weights already arrive in bf16). fp32 = everything fp32.

The sparse training op (``twell::ffn_train_fwd``) needs nothing from FSDP: FSDP2 all-gathers a
decoder layer's weights before its forward (and again before its backward, after
resharding), so the op receives plain, unsharded ``(H, D)`` tensors; the weight gradients it
returns land in the unsharded parameters' ``.grad``, which FSDP2 reduce-scatters into the
sharded ``DTensor`` gradients (tests/e2e/test_train_multiprocess.py checks both).

Checkpoints: :func:`model_state_dict` and :func:`optimizer_state_dict` return, on rank 0, the
same full tensors and the same formats as an unsharded model (``model.state_dict()``; the
optimizer's ``state_dict()`` with integer parameter ids), so one checkpoint format serves
1 process, DDP and FSDP with any world size.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from train.config import ConfigError


def check_launch(cpu: bool, env=None) -> None:
    """Refuse a multi-process launch whose processes would not join one run.

    ``accelerate launch --num_processes N`` (and torchrun) set ``WORLD_SIZE=N``; on a machine
    without a GPU accelerate forms the process group only with ``cpu=True``
    (``trainer.cpu=true``: DDP over gloo), else every process becomes its own 1-process run in
    the same run dir (measured: accelerate 1.15, ``distributed_type`` NO, ``num_processes`` 1
    on each of 2 ranks). Called before the trainer is built (``train.main.run``).

    Args:
        cpu: ``trainer.cpu``.
        env: the environment (default ``os.environ``).

    Raises:
        ConfigError: WORLD_SIZE > 1 without a CUDA device and without trainer.cpu=true, or more
            processes on this machine (LOCAL_WORLD_SIZE) than it has GPUs.
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE") or 1)
    if world <= 1 or cpu:
        return
    local = int(env.get("LOCAL_WORLD_SIZE") or world)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise ConfigError(
            f"the launcher started {world} processes (WORLD_SIZE={world}) but this machine has no "
            "GPU and trainer.cpu=false, so each process would train alone as its own 1-process "
            "run; add trainer.cpu=true to train them together on the CPU (DDP over gloo), or "
            f"launch on a machine with {local} GPUs.")
    if gpus < local:
        raise ConfigError(
            f"the launcher started {local} processes on this machine (LOCAL_WORLD_SIZE={local}) "
            f"but it has {gpus} GPU(s); launch with --num_processes {gpus} (one per GPU), or add "
            "trainer.cpu=true to train on the CPU.")


@dataclass
class FSDPSettings:
    """FSDP2 options the trainer honours (from the accelerate YAML's ``fsdp_config``)."""

    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward and gather them again for the
    backward (full shard, ZeRO-3); false keeps them until the backward (ZeRO-2-like)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward: the same mechanism as
    ``trainer.grad_checkpointing`` (either switch turns it on, applied once)."""


def _flag(env, key: str, default: str) -> bool:
    value = env.get(key, default).strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"{key}={env.get(key)!r} (from the accelerate config) must be true or "
                          "false; fix it in the accelerate YAML.")
    return value in ("true", "1", "yes")


def fsdp_settings_from_env(env=None) -> FSDPSettings | None:
    """The FSDP2 settings accelerate's launcher exported, or None when it did not ask for FSDP.

    Reads ``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``, ``FSDP_RESHARD_AFTER_FORWARD``,
    ``FSDP_ACTIVATION_CHECKPOINTING``, ``FSDP_AUTO_WRAP_POLICY``,
    ``FSDP_TRANSFORMER_CLS_TO_WRAP``, ``FSDP_OFFLOAD_PARAMS``, ``FSDP_STATE_DICT_TYPE`` and
    ``FSDP_CPU_RAM_EFFICIENT_LOADING`` (``env`` defaults to ``os.environ``).

    Raises:
        ConfigError: an option the trainer does not implement (FSDP1, parameter offload,
            sharded state dicts, another wrap unit than the decoder layer), naming the YAML key.
    """
    env = os.environ if env is None else env
    if not _flag(env, "ACCELERATE_USE_FSDP", "false"):
        return None
    if env.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(f"fsdp_version={env.get('FSDP_VERSION', '1')} in the accelerate config: "
                          "the trainer implements FSDP2 only; set fsdp_version: 2 "
                          "(configs/accelerate/fsdp2.yaml).")
    if _flag(env, "FSDP_OFFLOAD_PARAMS", "false"):
        raise ConfigError("fsdp_offload_params: true is not supported by the trainer; set it to "
                          "false in the accelerate config.")
    if _flag(env, "FSDP_CPU_RAM_EFFICIENT_LOADING", "false"):
        raise ConfigError("fsdp_cpu_ram_efficient_loading: true is not supported (the model is "
                          "built on every rank); set it to false in the accelerate config.")
    sd_type = env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    if sd_type != "FULL_STATE_DICT":
        raise ConfigError(f"fsdp_state_dict_type: {sd_type}: the trainer writes full state dicts "
                          "(they load on any number of ranks); set fsdp_state_dict_type: "
                          "FULL_STATE_DICT.")
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    cls = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer")
    if policy != "TRANSFORMER_BASED_WRAP" or cls != "LlamaDecoderLayer":
        raise ConfigError(f"fsdp_auto_wrap_policy={policy}, fsdp_transformer_layer_cls_to_wrap="
                          f"{cls}: the trainer shards per decoder layer; set "
                          "TRANSFORMER_BASED_WRAP and LlamaDecoderLayer.")
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().upper()
    reshard = {"FULL_SHARD": "TRUE", "SHARD_GRAD_OP": "FALSE"}.get(reshard, reshard)
    return FSDPSettings(
        reshard_after_forward=_flag({"k": reshard}, "k", "true"),
        activation_checkpointing=_flag(env, "FSDP_ACTIVATION_CHECKPOINTING", "false"))


@contextmanager
def hidden_from_accelerate():
    """Hide ``ACCELERATE_USE_FSDP`` while the ``Accelerator`` is built, so accelerate sets up a
    plain process group (DDP-style) and leaves the sharding to :func:`apply_fsdp2`."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def apply_fsdp2(model: nn.Module, settings: FSDPSettings, *, device: torch.device,
                world_size: int, param_dtype: torch.dtype | None) -> None:
    """Shard a ``LlamaForCausalLM`` in place with ``torch.distributed.fsdp.fully_shard``.

    Every ``model.model.layers[i]`` is one FSDP group (its weights all-gathered before its
    forward and backward, its gradients reduce-scattered after its backward); the root group
    holds the rest (tied embedding / LM head, final norm) and is not resharded after the
    forward (the LM head is needed again first thing in the backward).

    Args:
        model: the model, fp32 (the master weights); moved to ``device`` first.
        settings: :class:`FSDPSettings`.
        device: this rank's device (the mesh's device type).
        world_size: ranks in the 1-D mesh (the default process group must be initialised).
        param_dtype: ``torch.bfloat16`` for bf16 compute (gradients reduced in fp32), or None
            (fp32 throughout).

    Raises:
        ConfigError: no process group (not started by a launcher).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not torch.distributed.is_initialized():
        raise ConfigError("ACCELERATE_USE_FSDP=true but no process group: start the run with "
                          "accelerate launch --config_file configs/accelerate/fsdp2.yaml.")
    model.to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    mp = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
          if param_dtype is not None else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=settings.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def is_sharded(model: nn.Module) -> bool:
    """Is ``model`` (or the module inside a wrapper) an FSDP2 module?"""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` (a shard, or the replicated grad norm of sharded gradients) as the full plain
    tensor (a collective for a shard: every rank calls it); other tensors unchanged."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def model_state_dict(model: nn.Module) -> dict:
    """Full model weights on CPU (``model.state_dict()`` names) on rank 0; sharded models are
    gathered (a collective: every rank calls it; ranks > 0 get ``{}``)."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(model, options=_full_options(cpu_offload=True))
    # a tied weight (the LM head) comes back as its own copy; drop it as save_pretrained does
    # for an unsharded model's shared tensor
    seen, tied = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return {k: v for k, v in full.items() if k not in tied}


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state in ``torch.optim.Optimizer.state_dict()`` format (integer ids in
    parameter-group order) with full tensors, on rank 0; a collective for sharded models
    (ranks > 0 get ``{}``)."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    if not full:
        return {}
    ids, groups = {}, []
    for g in full["param_groups"]:
        groups.append({**g, "params": [ids.setdefault(fqn, len(ids)) for fqn in g["params"]]})
    return {"state": {ids[fqn]: s for fqn, s in full["state"].items()}, "param_groups": groups}


def load_model_state_dict(model: nn.Module, state: dict) -> tuple[list[str], list[str]]:
    """Load full weights (every rank passes the whole dict); returns (missing, unexpected)."""
    if not is_sharded(model):
        return model.load_state_dict(state, strict=False)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # (a copy: set_model_state_dict replaces the dict's tensors by this rank's shards)
    return set_model_state_dict(model, dict(state), options=_full_options(strict=False))


def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict) -> None:
    """Load an :func:`optimizer_state_dict` (integer ids, full tensors) on every rank; a sharded
    model's ranks keep their shards of it."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = {p: n for n, p in model.named_parameters()}
    fqns = [names[p] for g in optimizer.param_groups for p in g["params"]]
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in state["param_groups"]]
    full = {"state": {fqns[i]: dict(s) for i, s in state["state"].items()},  # copies: see above
            "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, full, options=_full_options())


def host_group(num_processes: int):
    """The group for host-side all-reduces (stops, failed saves, timings; no GPU sync): False
    on one process, None where the default group is gloo already, else a new gloo group (every
    rank calls this)."""
    if num_processes == 1:
        return False
    dist = torch.distributed
    return None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def host_sum(values: list[float], group) -> list[float]:
    """``values`` summed over ranks on the host ``group`` (:func:`host_group`)."""
    v = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(v, group=group)
    return v.tolist()


def host_max(flag: int, group) -> int:
    """The largest ``flag`` over ranks on the host ``group``; ``flag`` itself on one process
    (``group`` False)."""
    if group is False:
        return int(flag)
    v = torch.tensor([int(flag)], dtype=torch.int64)
    torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(v.item())


def end_process_group() -> None:
    """Destroy the process group of a multi-process launch, if any; call it once, at the
    process's end (a sweep's jobs share the group), when every rank ended its runs together.
    Left to the interpreter's shutdown, gloo's worker threads can abort the process (SIGABRT,
    "terminate called without an active exception"; pytorch/pytorch#190489), which failed a
    finished two-rank run in CI. After a failure it stays (a rank still in a collective would
    hang the destroy; torchtitan does the same)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # A finished Trainer sits in reference cycles (gc frees it, refcounts do not), so its
        # DDP module and reducer, which hold the group, would otherwise be freed by a later
        # collection or the interpreter's shutdown, after the group is gone: freed here first.
        gc.collect()
        torch.distributed.destroy_process_group()
