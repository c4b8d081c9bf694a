"""train/rundir.py: the set-aside command that twell-train and twell-report print."""

import subprocess

from train.rundir import set_aside_command


def _sh(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], check=False, capture_output=True, text=True)


def test_the_set_aside_command_run_twice_moves_nothing_the_second_time(tmp_path):
    """The command renames a run's files and checkpoints to *.old; run again (pasted from the
    shell's history after the run it preceded was stopped: the trainer says "re-run the same
    command"), it must not rename the new run's files onto the set-aside ones (a file's
    *.old overwritten: the earlier run's record lost) nor move a checkpoint folder into its
    *.old folder (step4.old/step4): it stops, one line, nothing moved."""
    run = tmp_path / "my run"
    (run / "checkpoints" / "step4").mkdir(parents=True)
    (run / "checkpoints" / "step4" / "metadata.json").write_text("the diverged run's")
    (run / "config.yaml").write_text("the diverged run's config")
    (run / "metrics.jsonl").write_text("the diverged run's metrics")
    cmd = set_aside_command(run, ("config.yaml", "metrics.jsonl", "checkpoints/step4"))
    r = _sh(cmd)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoints", "config.yaml.old", "metrics.jsonl.old"]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step4.old"]

    # the run that followed wrote its own files and a checkpoint of the same step
    (run / "checkpoints" / "step4").mkdir()
    (run / "checkpoints" / "step4" / "metadata.json").write_text("the new run's")
    (run / "config.yaml").write_text("the new run's config")
    (run / "metrics.jsonl").write_text("the new run's metrics")
    before = {p.relative_to(run): p.read_text() for p in run.rglob("*") if p.is_file()}
    r = _sh(f"{cmd} && echo trained")
    assert r.returncode != 0 and "trained" not in r.stdout
    assert r.stderr.strip().splitlines() == [
        "config.yaml.old exists (set aside before?): nothing moved"], r.stderr
    assert {p.relative_to(run): p.read_text() for p in run.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step4", "step4.old"]


def test_the_set_aside_command_quotes_odd_names(tmp_path):
    """A run dir and an entry with a space or a quote: the command still moves them."""
    run = tmp_path / "it's a run"
    (run / "checkpoints" / "step 1").mkdir(parents=True)
    (run / "config.yaml").write_text("x")
    r = _sh(set_aside_command(run, ("config.yaml", "checkpoints/step 1")))
    assert r.returncode == 0, r.stderr
    assert (run / "config.yaml.old").read_text() == "x"
    assert (run / "checkpoints" / "step 1.old").is_dir()
