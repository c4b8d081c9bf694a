"""train/requeue.py: the key of an override, as recorded by Hydra or quoted for the shell."""

import pytest

from train.requeue import _key, job_alone_command, override_arg


@pytest.mark.parametrize("override", [
    "trainer.resume=/x/step5", "'trainer.resume=/x/step5'", '"trainer.resume=/x/step5"',
    "$'trainer.resume=/x\\nb/step5'", "+trainer.resume=/x", "++trainer.resume=/x",
    "'+trainer.resume=/x y'", "'++trainer.resume=/x y'", "~trainer.resume", "'~trainer.resume'",
    "trainer.resume='/a=b'"])
def test_a_quoted_or_prefixed_override_has_its_plain_key(override):
    assert _key(override) == "trainer.resume"


def test_a_quoted_resume_replaces_the_jobs_recorded_one(tmp_path):
    """A job whose recorded overrides set trainer.resume and optim.lr, run alone with a
    checkpoint whose path the shell must read quoted: each key appears once, with the new
    value (the quoted argument's key was read as "'trainer.resume", the recorded one kept)."""
    job = tmp_path / "my sweep" / "1"
    resume = override_arg("trainer.resume", job / "checkpoints" / "step5")
    assert resume.startswith("'trainer.resume=")  # quoted for the shell: the case at hand
    cmd = job_alone_command(job, ["hydra.job.chdir=false", "trainer.resume=auto",
                                  "+optim.lr=1e30", "data=tokens"], resume, "'++optim.lr=1e-4'")
    assert cmd == (f"twell-train {override_arg('hydra.run.dir', job)} data=tokens {resume} "
                   "'++optim.lr=1e-4'")
