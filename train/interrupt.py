"""Stopping a training run on SIGTERM or SIGINT without losing the steps since the last save.

SLURM, Kubernetes, ``docker stop`` and ``timeout`` send SIGTERM before SIGKILL; Ctrl-C sends
SIGINT. While :meth:`train.trainer.Trainer.train` runs, the first of either only sets a flag
(:class:`StopSignals`); the trainer finishes the optimizer step it is in, writes a checkpoint,
prints and logs one line and raises :class:`TrainingInterrupted` (an evaluation or validation
running when the signal comes ends at its next forward: :class:`StopRequested`), and
``twell-train`` exits with
the shell's code for the signal (:func:`exit_code`: 128 + the signal number, 143 for SIGTERM,
130 for SIGINT). A second signal stops at once (no checkpoint). Under a launcher (torchrun,
``accelerate launch``) each worker gets the signal twice, from the terminal or scheduler and
forwarded by the launcher: a repeat within :func:`launcher_grace_s` of the first counts as the
same one. Before the first step (``twell-train`` loading the trainer, building the corpus,
loading data or model), :func:`stops_before_training` stops at once on either signal and names
what the run was doing (:class:`SetupInterrupted`): nothing was trained.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Self

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15, ``"SIGINT"`` for 2."""
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """The exit code a shell reports for a process ended by ``signum`` (128 + its number)."""
    return 128 + int(signum)


def launcher_grace_s() -> float:
    """Seconds in which a repeated signal counts as the first: 2 under torchrun / accelerate
    launch (``TORCHELASTIC_RUN_ID`` set: the launcher forwards the signal its workers already
    got, milliseconds later), else 0 (a second Ctrl-C stops at once)."""
    return 2.0 if "TORCHELASTIC_RUN_ID" in os.environ else 0.0


def stop_name(signals: StopSignals | None) -> str:
    """The name of the signal ``signals`` received, or a stop asked for by another rank."""
    signum = signals.signum if signals is not None else 0
    return signal_name(signum) if signum else "a stop signal on another rank"


def stopped_line(signum: int, step: int, last_ckpt: str, advice: str) -> str:
    """The line of a run stopped after ``step``, the step a ``signum`` interrupted: where its
    checkpoint is (``last_ckpt``, shell-quoted; "" for none), how to resume (``advice``) and
    the exit code."""
    saved = f"checkpoint written to {last_ckpt}; " if last_ckpt else ""
    return (f"received {signal_name(signum)} at step {step}: {saved}{advice} (exit code "
            f"{exit_code(signum)})")


def interrupted_line(e: KeyboardInterrupt, step: int, last_ckpt: str,
                     advice: str) -> str:
    """The line of a run that the interrupt ``e`` (not a reported stop after a step) ended at
    once at ``step``: the newest complete checkpoint ``last_ckpt``, how to resume ``advice``."""
    name = signal_name(e.signum if isinstance(e, TrainingInterrupted) else signal.SIGINT)
    how = ("interrupted" if not isinstance(e, TrainingInterrupted)
           else f"received {name}: stopped at once (no step finished since the last "
                "checkpoint, so none is lost)" if e.first
           else f"received a second {name}: stopped at once")
    return f"{how} at step {step}; newest complete checkpoint: {last_ckpt}; {advice}"


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped on a signal.

    Attributes:
        signum: the signal (SIGTERM or SIGINT).
        reported: whether its line (step, checkpoint, how to resume) is already printed and
            logged (a stop after a step); False for a signal raised at once.
        first: a first signal raised at once because no finished step was unsaved
            (``StopSignals(at_once=...)``); False for a second signal.
        exit_code: 128 + signum.
    """

    def __init__(self, signum: int, message: str = "", *, reported: bool = False,
                 first: bool = False) -> None:
        super().__init__(message or f"received {signal_name(signum)}")
        self.signum = int(signum)
        self.reported = reported
        self.first = first
        self.exit_code = exit_code(signum)


class SetupInterrupted(TrainingInterrupted):
    """A run stopped by SIGINT / SIGTERM before its first step (:func:`stops_before_training`):
    nothing was trained. ``phase``: what it was doing (:func:`setup_phase`)."""

    def __init__(self, signum: int, phase: str) -> None:
        super().__init__(signum, f"received {signal_name(signum)} while {phase}")
        self.phase = phase


# What a run stopped before its first step was doing: the innermost of these functions on the
# stop's traceback (train/trainer.py's set-up calls them in this order)
SETUP_PHASES = {
    "find_resume": "checking the checkpoint to resume",
    "build_datamodule": "loading the data",
    "build_corpus": "building the corpus",
    "attach_model": "building the model",
    "wrap_model": "preparing the model",
    "resume": "loading the checkpoint",
    "plan_memory": "planning the memory",
    "start_wandb": "starting wandb",
}


def setup_phase(tb) -> str:
    """What the traceback ``tb`` of a stop before the first step was doing: the innermost
    :data:`SETUP_PHASES` function on it, else "loading the trainer" while a module was being
    imported, else "setting up"."""
    names = [frame.f_code.co_name for frame, _ in traceback.walk_tb(tb)]
    for name in reversed(names):
        if name in SETUP_PHASES:
            return SETUP_PHASES[name]
    return "loading the trainer" if "<module>" in names else "setting up"


def _raise_sigterm(signum: int, frame) -> None:
    raise TrainingInterrupted(signum)


@contextmanager
def stops_before_training() -> Iterator[None]:
    """Inside (``twell-train`` from its start until the trainer is ready to train), SIGTERM
    raises :class:`TrainingInterrupted` as Ctrl-C raises KeyboardInterrupt (in the main thread,
    where SIGTERM had its default action; its handler comes back on exit), and either leaves as
    :class:`SetupInterrupted` naming the phase (:func:`setup_phase`), so the caller can clean
    up and say in one line that nothing was trained.

    Raises:
        SetupInterrupted: a SIGINT or SIGTERM came inside.
    """
    old = None
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        old = signal.signal(signal.SIGTERM, _raise_sigterm)
    try:
        yield
    except SetupInterrupted:
        raise
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, TrainingInterrupted) else signal.SIGINT
        phase = setup_phase(e.__traceback__)
        # what the stopped frames held goes now: a progress bar closes (its last state and a
        # newline) before the caller's line, not after it
        traceback.clear_frames(e.__traceback__)
        raise SetupInterrupted(signum, phase) from None
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


class StopRequested(BaseException):
    """Raised from a forward hook inside an evaluation or validation once a stop signal came
    (``train.evaluation.stoppable``): the pass ends at its next forward and the trainer checkpoints and
    stops. A BaseException, so no ``except Exception`` in the evaluation code swallows it."""


class StopSignals:
    """Context manager: while active, the first SIGTERM or SIGINT is recorded in ``signum``
    (the trainer stops after the current step); a later one raises :class:`TrainingInterrupted`
    at once, unless it comes within ``grace_s`` of the first. The previous handlers come back on
    exit. Outside the main thread (where Python allows no handlers) it does nothing.

    Args:
        grace_s: seconds after the first signal in which another counts as the same one.
        notify: write one line to stderr when the first signal arrives (the main process).
        at_once: called when the first signal arrives; True raises
            :class:`TrainingInterrupted` (``first=True``) at once instead of waiting for the
            step: no finished step would be lost (e.g. a step of minutes in progress right
            after a checkpoint).
    """

    def __init__(self, grace_s: float = 0.0, notify: bool = True,
                 at_once: Callable[[], bool] | None = None) -> None:
        self.grace_s = grace_s
        self.notify = notify
        self.at_once = at_once
        self.signum = 0
        self._first = 0.0
        self._old: dict = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first = signum, now
            if self.at_once is not None and self.at_once():
                raise TrainingInterrupted(signum, first=True)
            if self.notify:  # os.write: no buffered stream is re-entered from a handler
                os.write(2, f"\n{signal_name(signum)}: stopping after this optimizer step with a "
                            "checkpoint; send it again to stop at once\n".encode())
            return
        if now - self._first < self.grace_s:
            return
        raise TrainingInterrupted(signum)
