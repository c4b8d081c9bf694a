"""twell-train's end (train/main.py ``cli``): the process group is destroyed after the run's
trainer is freed, on a finished run and on a run stopped by SIGTERM (exit code 143), so that no
Gloo thread frees the trainer's tensors during the interpreter's shutdown
(pytorch/pytorch#190489: a rank's SIGABRT after a finished run)."""

import gc
import sys
import weakref

import pytest

from train import main, parallel


class _Trainer:
    """A stand-in in a reference cycle, as the real Trainer is (refcounts never free it)."""

    def __init__(self):
        self.me = self


def _stopped_run(seen):
    trainer = _Trainer()
    seen.append(weakref.ref(trainer))
    try:
        raise KeyboardInterrupt  # SIGTERM at a step, as train.interrupt raises it
    except KeyboardInterrupt:
        raise SystemExit(143) from None  # train/main.py run(): the stop's exit code


def _finished_run(seen):
    trainer = _Trainer()
    seen.append(weakref.ref(trainer))


@pytest.mark.parametrize("run, code", [(_stopped_run, 143), (_finished_run, None)])
def test_the_trainer_is_freed_before_the_group_is_destroyed(monkeypatch, run, code):
    seen, alive_at_end = [], []
    monkeypatch.setattr(sys, "argv", ["twell-train"])
    monkeypatch.setattr(main, "_main", lambda: run(seen))
    monkeypatch.setattr(parallel.torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.torch.distributed, "destroy_process_group",
                        lambda: alive_at_end.append(seen[0]() is not None))
    gc.disable()  # no automatic collection between the run and the end: only the end's own
    try:
        if code is None:
            main.cli()
        else:
            with pytest.raises(SystemExit) as err:
                main.cli()
            assert err.value.code == code
    finally:
        gc.enable()
    assert alive_at_end == [False]
