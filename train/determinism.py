"""``trainer.deterministic``: a bitwise-reproducible run (the project's rule: fast paths may use
non-deterministic reductions within bf16 noise; this key keeps a reproducible path).

What varies from run to run otherwise, and what the trainer does about each under the key:

* PyTorch / CUDA ops with non-deterministic kernels: :func:`enable` turns on
  ``torch.use_deterministic_algorithms`` (an op without a deterministic version then raises:
  :func:`error_line` makes that one line with the fix), cuDNN's deterministic algorithms without
  benchmarking, and cuBLAS's deterministic workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when
  unset). Called at the start of the trainer's setup, before the process group (NCCL reads the
  flag there) and before any GPU work; :func:`restore` puts the process's settings back.
* ``ffn.impl=auto``'s choices by timing (training: ``twell.nn.chooser``'s measured
  chooser; inference, so validation and evals: ``twell.ops.auto``): the trainer builds its plan
  untimed and gives every FFN :func:`untimed_policy`, so paths follow the density rule, a
  function of the data.
* ``trainer.memory=auto``'s micro-batch and recomputation by measured speed: refused by
  ``TrainerConfig`` unless the user sets them (the planner then only checks that they fit).

Wall-clock metrics (times, throughput, MFU) and memory peaks are measurements and still vary.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from train.config import ConfigError

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the values cuBLAS is deterministic with
# the start of torch's error for an op without a deterministic implementation
_NO_DETERMINISTIC = "does not have a deterministic implementation"


@dataclass(frozen=True)
class Saved:
    """The process's settings before :func:`enable` (what :func:`restore` puts back)."""

    algorithms: bool
    warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cublas: str | None


def enable(*, cuda: bool) -> Saved:
    """Deterministic algorithms, cuDNN deterministic without benchmark and (unless set)
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``; returns the settings before.

    Raises:
        ConfigError: ``cuda`` and CUBLAS_WORKSPACE_CONFIG set to a value cuBLAS is not
            deterministic with.
    """
    cublas = os.environ.get(CUBLAS_ENV)
    if cuda and cublas is not None and cublas not in CUBLAS_DETERMINISTIC:
        raise ConfigError(
            f"trainer.deterministic=true: {CUBLAS_ENV}={cublas!r} makes cuBLAS non-deterministic;"
            f" unset it (the trainer then sets :4096:8) or set it to :4096:8 or :16:8.")
    saved = Saved(torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled(),
                  torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, cublas)
    if cublas is None:
        os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return saved


def restore(saved: Saved | None) -> None:
    """Put back what :func:`enable` changed (nothing for None)."""
    if saved is None:
        return
    torch.use_deterministic_algorithms(saved.algorithms, warn_only=saved.warn_only)
    torch.backends.cudnn.deterministic = saved.cudnn_deterministic
    torch.backends.cudnn.benchmark = saved.cudnn_benchmark
    if saved.cublas is None:
        os.environ.pop(CUBLAS_ENV, None)


def untimed_policy(policy):
    """``policy`` (a :class:`twell.policy.FFNPolicy`) with ``auto``'s measured choices off in
    training (``train_measure``) and inference (``infer_measure``): the density rule decides."""
    return dataclasses.replace(policy, train_measure=False, infer_measure=False)


def error_line(e: BaseException) -> str | None:
    """One line for torch's error about an op without a deterministic implementation under
    ``trainer.deterministic=true`` (naming the op and the fix); None for any other error."""
    msg = " ".join(str(e).split())
    if not isinstance(e, RuntimeError) or _NO_DETERMINISTIC not in msg:
        return None
    op = msg.split(_NO_DETERMINISTIC)[0].strip() or "an operation"
    return (f"trainer.deterministic=true: {op} has no deterministic implementation in PyTorch "
            "(torch.use_deterministic_algorithms); set trainer.deterministic=false to run it "
            "(non-deterministic within bf16 noise), or change the setting that uses it.")


__all__ = ["CUBLAS_DETERMINISTIC", "CUBLAS_ENV", "Saved", "enable", "error_line", "restore",
           "untimed_policy"]
