"""train/requeue.py: the key of an override, as recorded by Hydra or quoted for the shell."""

import pytest

from train.requeue import job_alone_command, override_arg, override_key


@pytest.mark.parametrize("override", [
    "trainer.resume=/x/step5", "'trainer.resume=/x/step5'", '"trainer.resume=/x/step5"',
    "$'trainer.resume=/x\\nb/step5'", "+trainer.resume=/x", "++trainer.resume=/x",
    "'+trainer.resume=/x y'", "'++trainer.resume=/x y'", "~trainer.resume", "'~trainer.resume'",
    "trainer.resume='/a=b'"])
def test_a_quoted_or_prefixed_override_has_its_plain_key(override):
    assert override_key(override) == "trainer.resume"


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



def test_a_jobs_removed_or_renamed_keys_are_written_as_the_cli_takes_them(tmp_path):
    """A job recorded before a key was removed or renamed (train.config's tables): its command
    alone leaves the removed key out (the CLI refuses it: "was removed"), a renamed-then-
    removed one too, and writes a renamed key at its new place, so the printed command runs."""
    from train.config import REMOVED_KEYS, RENAMED_KEYS, unknown_key_message

    job = tmp_path / "sweep" / "0"
    recorded = ["ffn.policy.infer_split_long=0", "+model.ffn_policy.infer_split_parts=8",
                "model.ffn_impl=torch", "+model.ffn_policy.ell_capacity=64",
                "~trainer.dense_ffn_fused", "sparsity.l1_coeff=0.5"]
    cmd = job_alone_command(job, recorded, "trainer.resume_allow_changes=true")
    assert cmd == (f"twell-train hydra.run.dir={job} ffn.impl=torch "
                   "+ffn.policy.ell_capacity=64 '~ffn.dense_fused' sparsity.l1_coeff=0.5 "
                   "trainer.resume_allow_changes=true")
    assert "infer_split" not in cmd and "model.ffn" not in cmd  # the CLI would refuse them
    assert "ffn.policy.infer_split_long" in REMOVED_KEYS and "model.ffn_impl" in RENAMED_KEYS
    assert "was removed" in unknown_key_message("ffn.policy", "infer_split_long", ())
    # a key the extra arguments set replaces the recorded one under its old name too
    assert job_alone_command(job, ["model.ffn_impl=torch"], "ffn.impl=twell") == (
        f"twell-train hydra.run.dir={job} ffn.impl=twell")

def _sweep_record(sweep, config: dict, task: list[str]) -> None:
    """A sweep folder as twell-train leaves it: ``multirun.yaml`` (the composed config and the
    command's overrides) and job 0 with a checkpoint and no summary (unfinished)."""
    from omegaconf import OmegaConf

    sweep.mkdir(parents=True)
    OmegaConf.save({**config, "hydra": {"overrides": {"task": task}}}, sweep / "multirun.yaml")
    (sweep / "0" / "checkpoints" / "step2").mkdir(parents=True)
    (sweep / "0" / "checkpoints" / "step2" / "metadata.json").write_text("{}")


def test_a_sweep_saved_with_removed_keys_is_the_same_sweep(tmp_path):
    """A sweep recorded before ffn.policy.infer_split_long / infer_split_parts were removed
    holds them in its multirun.yaml (every composed config had them): the same -m command
    after the removal is that sweep (not "another sweep" refused in its named folder), and a
    timestamped one finds it unfinished, as a single run's .hydra/config.yaml is read."""
    from train.requeue import find_unfinished_sweep, other_sweep_in, train_on_commands

    now = {"ffn": {"impl": "torch", "policy": {"infer_min_rows": 8192}},
           "optim": {"lr": 5e-4}, "sparsity": {"l1_coeff": 0.0}}
    old = {**now, "ffn": {"impl": "torch", "policy": {
        "infer_min_rows": 8192, "infer_split_long": 0, "infer_split_parts": 8}}}
    task = ["sparsity.l1_coeff=0.5,0.25"]
    sweep = tmp_path / "multirun" / "2026-12-05" / "10-00-00"
    _sweep_record(sweep, old, task)
    assert other_sweep_in(sweep, now, task) is None
    assert find_unfinished_sweep(now, task, tmp_path / "multirun", 2) == sweep
    # the same with more steps: the commands that train its jobs on, not a refusal
    (sweep / "1" / "checkpoints" / "step2").mkdir(parents=True)
    (sweep / "1" / "checkpoints" / "step2" / "metadata.json").write_text("{}")
    longer = {**now, "trainer": {"max_steps": 80}}
    assert other_sweep_in(sweep, longer, task) == "its config differs in trainer.max_steps"
    assert train_on_commands(sweep, longer, task).count("twell-train ") == 2
    # another value of a kept key is still another sweep
    assert other_sweep_in(sweep, {**now, "model": {"num_layers": 3}}, task) == (
        "its config differs in model.num_layers")


def _recorded_job(job, micro_batch=4, world_size=None):
    """A sweep job's folder as an old twell-train left it: Hydra's composed config (its
    micro-batch) and, with ``world_size``, a checkpoint written by that many ranks."""
    import json

    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(
        f"trainer:\n  micro_batch: {micro_batch}\n  val_batches: 3\n")
    if world_size is not None:
        (job / "checkpoints" / "step2").mkdir(parents=True)
        (job / "checkpoints" / "step2" / "metadata.json").write_text(
            json.dumps({"format_version": 1, "step": 2, "world_size": world_size}))


def test_a_jobs_val_batches_becomes_the_val_sequences_it_validated_on(tmp_path):
    """trainer.val_batches=N counted micro-batches per rank; the CLI refuses it (renamed
    trainer.val_sequences, sequences over all ranks). A job recorded with it gets, in its
    command alone, the sequences it validated on: N x its micro-batch x its checkpoint's ranks
    (no checkpoint: 1 rank, what the printed twell-train runs), so the command runs."""
    from train.config import ConfigError, check_overrides

    two_ranks, no_ckpt, unknown = tmp_path / "sweep" / "0", tmp_path / "sweep" / "1", \
        tmp_path / "sweep" / "2"
    _recorded_job(two_ranks, micro_batch=4, world_size=2)
    _recorded_job(no_ckpt, micro_batch=4)
    recorded = ["trainer.val_batches=3", "sparsity.l1_coeff=0.5"]
    cmd = job_alone_command(two_ranks, recorded, "trainer.resume_allow_changes=true")
    assert cmd == (f"twell-train hydra.run.dir={two_ranks} trainer.val_sequences=24 "
                   "sparsity.l1_coeff=0.5 trainer.resume_allow_changes=true")  # 3 x 4 x 2
    check_overrides(cmd.split()[1:])  # the CLI's check takes every argument
    assert job_alone_command(no_ckpt, ["++trainer.val_batches=3"]) == (
        f"twell-train hydra.run.dir={no_ckpt} trainer.val_sequences=12")  # 3 x 4 x 1
    # a value set by the command replaces the recorded one under its old name too
    assert job_alone_command(two_ranks, recorded, "trainer.val_sequences=64") == (
        f"twell-train hydra.run.dir={two_ranks} sparsity.l1_coeff=0.5 trainer.val_sequences=64")
    # no record of the micro-batch: kept as recorded, and the CLI's line names the conversion
    unknown.mkdir(parents=True)
    assert job_alone_command(unknown, recorded) == (
        f"twell-train hydra.run.dir={unknown} trainer.val_batches=3 sparsity.l1_coeff=0.5")
    with pytest.raises(ConfigError) as e:
        check_overrides(["trainer.val_batches=3"])
    assert str(e.value) == (
        "trainer.val_batches was renamed trainer.val_sequences (it counts held-out sequences "
        "over all ranks, not micro-batches per rank: trainer.val_batches=N is "
        "trainer.val_sequences=N x trainer.micro_batch x ranks); use the new key.")


def test_val_sequences_of_reads_the_jobs_micro_batch_and_ranks(tmp_path):
    from train.requeue import upgrade_job_override, val_sequences_of

    job = tmp_path / "0"
    _recorded_job(job, micro_batch=8, world_size=4)
    assert val_sequences_of(job, 2) == 64  # 2 x 8 x 4
    assert upgrade_job_override("trainer.val_batches=2", job) == "trainer.val_sequences=64"
    assert upgrade_job_override("model.ffn_impl=torch", job) == "ffn.impl=torch"  # as before
    assert upgrade_job_override("trainer.val_batches=${x}", job) == "trainer.val_batches=${x}"
    (job / "checkpoints" / "step2" / "metadata.json").write_text("not json")  # damaged: 1 rank
    assert val_sequences_of(job, 2) == 16
    (job / ".hydra" / "config.yaml").write_text("trainer:\n  micro_batch: null\n")
    assert val_sequences_of(job, 2) is None  # the planner's pick: not recorded there
    assert upgrade_job_override("trainer.val_batches=2", job) == "trainer.val_batches=2"
