"""The stops of one training run: the SIGTERM / SIGINT it gets while ``Trainer.train`` runs,
the ranks' agreement on them, the checkpoint a stop writes and its one line
(:mod:`train.interrupt` holds the signal handler and the lines' wording).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from train import interrupt
from train.checkpoint import shell_quote
from train.evaluation import stoppable
from train.interrupt import StopSignals, TrainingInterrupted


class RunStops:
    """The stop control of a :class:`train.trainer.Trainer` (``Trainer.stops``).

    Args:
        tr: the trainer; read through its public calls: ``step``, ``saved_step``,
            ``last_ckpt``, ``save_checkpoint()``, ``resume_advice()``, ``runlog``, ``acc``,
            ``model``, ``is_main``.
        any_rank: the largest of an int over ranks (a host-side all-reduce; the int itself on
            one process), so every rank stops after the same step or forward.

    Attributes:
        signals: the :class:`train.interrupt.StopSignals` while :meth:`watching` is active,
            else None.
    """

    def __init__(self, tr, any_rank: Callable[[int], int]) -> None:
        self.tr = tr
        self.any_rank = any_rank
        self.signals: StopSignals | None = None

    @contextmanager
    def watching(self) -> Iterator[StopSignals]:
        """Handle SIGTERM / SIGINT inside (``Trainer.train``): the first one stops after the
        current optimizer step (at once on one process when no finished step is unsaved),
        a second one at once (:class:`train.interrupt.StopSignals`)."""
        at_once = self._nothing_unsaved if self.tr.acc.num_processes == 1 else None
        try:
            with StopSignals(grace_s=interrupt.launcher_grace_s(), notify=self.tr.is_main,
                             at_once=at_once) as sig:
                self.signals = sig
                yield sig
        finally:
            self.signals = None

    def _nothing_unsaved(self) -> bool:
        """Whether every finished step is in a checkpoint (or none has finished): a signal then
        stops at once, not after a step in progress that may take minutes (one process)."""
        saved = self.tr.saved_step
        return self.tr.step == (saved if saved is not None else 0)

    def stoppable(self, collective: bool):
        """:func:`train.evaluation.stoppable` of the trainer's model, these signals and ranks."""
        return stoppable(self.tr.acc.unwrap_model(self.tr.model), self.signals, self.any_rank,
                         collective)

    def stop_name(self) -> str:
        """The signal that stops this run, or a stop asked for by another rank."""
        return interrupt.stop_name(self.signals)

    def stop_if_signalled(self, bar=None) -> None:
        """If any rank got SIGTERM / SIGINT (all ranks agree): close the progress ``bar``,
        checkpoint the step it interrupted (unless just saved, or no step was trained), print
        and log one line, raise :class:`train.interrupt.TrainingInterrupted`."""
        tr = self.tr
        signum = self.any_rank(self.signals.signum if self.signals else 0)
        if not signum:
            return
        if bar is not None:
            bar.close()
        if tr.saved_step != tr.step and tr.step > 0:
            tr.save_checkpoint()
        line = interrupt.stopped_line(signum, tr.step, self._quoted_ckpt(), tr.resume_advice())
        tr.runlog.print(line)
        raise TrainingInterrupted(signum, line, reported=True)

    def interrupted(self, e: KeyboardInterrupt) -> int:
        """The exit code of a run that the interrupt ``e`` ended: 130 for SIGINT, 143 for
        SIGTERM. Prints and logs the interrupt's line (where to resume) unless
        :meth:`stop_if_signalled` did."""
        if not (isinstance(e, TrainingInterrupted) and e.reported):
            self.tr.runlog.warn(interrupt.interrupted_line(
                e, self.tr.step, self._quoted_ckpt() or "none", self.tr.resume_advice()))
        signum = e.signum if isinstance(e, TrainingInterrupted) else signal.SIGINT
        return interrupt.exit_code(signum)

    def _quoted_ckpt(self) -> str:
        """The newest checkpoint's path quoted for a shell ("" when none)."""
        return shell_quote(self.tr.last_ckpt) if self.tr.last_ckpt else ""
