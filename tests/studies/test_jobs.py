"""studies.jobs: the subprocess runner of the study scripts (statuses, parallelism, deadline, SIGTERM)."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import pytest

from studies.jobs import (
    Job,
    check_train_overrides,
    job_env,
    last_train_record,
    run_finished,
    run_jobs,
    train_command,
)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_statuses_and_exit_codes(tmp_path):
    jobs = [Job("ok", _py("print('hi')"), log_path=tmp_path / "ok.log"),
            Job("bad", _py("import sys; sys.exit(3)"), log_path=tmp_path / "bad.log")]
    ended = []
    run_jobs(jobs, parallel=2, on_done=lambda j: ended.append(j.name), log=lambda s: None,
             poll_s=0.05)
    assert [j.status for j in jobs] == ["done", "failed (exit 3)"]
    assert [j.rc for j in jobs] == [0, 3]
    assert jobs[0].ok and not jobs[1].ok
    assert sorted(ended) == ["bad", "ok"]
    assert (tmp_path / "ok.log").read_text().strip() == "hi"


def test_env_values_set_and_none_removes(tmp_path, monkeypatch):
    monkeypatch.setenv("TWELL_JOBS_A", "from-parent")
    monkeypatch.setenv("TWELL_JOBS_B", "from-parent")
    code = ("import os; print(os.environ.get('TWELL_JOBS_A'), os.environ.get('TWELL_JOBS_B'), "
            "os.environ.get('TWELL_JOBS_C'))")
    jobs = [Job("rm", _py(code), log_path=tmp_path / "rm.log",
                env={"TWELL_JOBS_A": None, "TWELL_JOBS_C": "job"}),
            Job("keep", _py(code), log_path=tmp_path / "keep.log")]
    run_jobs(jobs, env={"TWELL_JOBS_B": None}, log=lambda s: None, poll_s=0.05)
    assert (tmp_path / "rm.log").read_text().split() == ["None", "None", "job"]
    assert (tmp_path / "keep.log").read_text().split() == ["from-parent", "None", "None"]
    assert "TWELL_JOBS_B" not in job_env(1, {"TWELL_JOBS_B": None})


def test_parallel_limit_runs_jobs_one_after_another(tmp_path):
    # each job appends its start and end time; with parallel=1 no two intervals overlap
    code = ("import time, sys; f = open(sys.argv[1], 'a'); t = time.time(); time.sleep(0.3); "
            "f.write(f'{t} {time.time()}\\n')")
    stamps = tmp_path / "stamps"
    jobs = [Job(f"j{i}", [*_py(code), str(stamps)], log_path=tmp_path / f"{i}.log")
            for i in range(3)]
    run_jobs(jobs, parallel=1, log=lambda s: None, poll_s=0.02)
    spans = sorted(tuple(map(float, ln.split())) for ln in stamps.read_text().splitlines())
    assert len(spans) == 3
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end


def test_deadline_sends_sigterm_and_marks_the_rest(tmp_path):
    # the child handles SIGTERM as the trainer does: it writes a marker and exits 143
    code = ("import signal, sys, time\n"
            "def h(*a):\n"
            "    open(sys.argv[1], 'w').write('term'); sys.exit(143)\n"
            "signal.signal(signal.SIGTERM, h)\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    marker = tmp_path / "marker"
    jobs = [Job("long", [*_py(code), str(marker)], log_path=tmp_path / "long.log"),
            Job("next", _py("pass"), log_path=tmp_path / "next.log")]
    t0 = time.monotonic()
    run_jobs(jobs, parallel=1, deadline=t0 + 1.5, log=lambda s: None, poll_s=0.05, grace_s=10)
    assert time.monotonic() - t0 < 15
    assert jobs[0].status == "stopped" and jobs[0].rc == 143
    assert marker.read_text() == "term"
    assert jobs[1].status == "not started" and jobs[1].rc is None


def test_sigkill_after_grace_when_sigterm_is_ignored(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    job = Job("stubborn", _py(code), log_path=tmp_path / "s.log")
    t0 = time.monotonic()
    run_jobs([job], deadline=t0 + 0.5, grace_s=0.5, log=lambda s: None, poll_s=0.05)
    assert job.status == "stopped" and job.rc == -9
    assert time.monotonic() - t0 < 20


def test_train_command_and_its_checks(tmp_path):
    cmd = train_command(["model=tiny", "+x.y=1", "~eval"], tmp_path / "r", python="py")
    assert cmd == ["py", "-m", "train", "model=tiny", "+x.y=1", "~eval",
                   f"hydra.run.dir={tmp_path / 'r'}"]
    with pytest.raises(ValueError, match="not key=value"):
        train_command(["model"], tmp_path)
    with pytest.raises(ValueError, match="hydra.run.dir"):
        train_command(["hydra.run.dir=/x"], tmp_path)
    with pytest.raises(ValueError, match="log_path or run_dir"):
        Job("x", ["true"])
    assert Job("x", ["true"], run_dir=tmp_path / "r").log_path == Path(f"{tmp_path / 'r'}.log")
    with pytest.raises(ValueError, match="parallel"):
        run_jobs([], parallel=0)


def test_progress_reads_metrics_and_summary(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert last_train_record(run) is None and not run_finished(run)
    rows = [{"kind": "train", "step": 1, "ce": 9.0}, {"kind": "val", "step": 1},
            {"kind": "train", "step": 2, "ce": 8.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": ')
    assert last_train_record(run)["step"] == 2  # the half-written last line is skipped
    (run / "summary.json").write_text(json.dumps({"step": 40}))
    assert run_finished(run) and run_finished(run, 40) and not run_finished(run, 80)
    (run / "summary.json").write_text("{")  # truncated: not finished
    assert not run_finished(run)


# two rows of the tiny model: a sparse one and a dense one (sparsity.l1_coeff=0)
ROWS = {"sparse": ["model=tiny", "sparsity.l1_coeff=1e-3"],
        "dense": ["model=tiny", "sparsity.l1_coeff=0"]}
TRAINER_KEYS = ("autocast_cache, ce_chunk_rows, checkpoint_ffn, compile, compile_scope, cpu, "
                "deterministic, fused_norm_cast, global_batch, grad_checkpointing, keep_last, "
                "liger, log_every, max_steps, memory, memory_budget_gb, micro_batch, "
                "norm_out_bf16, num_threads, peak_tflops, precision, progress, "
                "recast_attn_weights, recompute_norms, resume, resume_allow_changes, save_every, "
                "seed, val_every, val_sequences")


def _refusal(rows, extra) -> str:
    with pytest.raises(ValueError) as e:
        check_train_overrides(rows, extra)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_good_overrides_compose_with_every_row():
    check_train_overrides(ROWS, ["trainer.compile_scope=layers", "data.build_if_missing=false"])
    check_train_overrides(ROWS)  # the rows alone
    check_train_overrides({}, ["trainer.compile_scope=layers"])  # no row: the keys still checked


def test_a_bad_key_is_named_with_the_fix_before_any_row_is_composed():
    assert _refusal(ROWS, ["trainer.compile_scope=layers", "trainer.foo=1"]) == (
        "override 'trainer.foo=1' is refused by the training config: unknown key trainer.foo; "
        f"valid keys of trainer: {TRAINER_KEYS}; remove it or fix its spelling.")
    assert _refusal(ROWS, ["+trainer.max_step=5"]).endswith(
        "did you mean trainer.max_steps?")
    assert _refusal(ROWS, ["trainer.val_batches=4"]) == (
        "override 'trainer.val_batches=4' is refused by the training config: "
        "trainer.val_batches was renamed trainer.val_sequences (it counts held-out sequences "
        "over all ranks, not micro-batches per rank: trainer.val_batches=N is "
        "trainer.val_sequences=N x trainer.micro_batch x ranks); use the new key.")
    # Hydra's parse errors name the override themselves: said once
    assert _refusal(ROWS, ["trainer.compile_scope"]) == (
        "override 'trainer.compile_scope' has no '=': write trainer.compile_scope=<value>.")
    # no row needed for a key error: the rows are not what is wrong
    assert _refusal({}, ["+foo=1"]) == ("override '+foo=1' is refused by the training config: "
                                        "unknown top-level key foo; remove it or fix its "
                                        "spelling.")


def test_a_bad_value_names_the_override_and_the_first_row_that_refuses_it():
    assert _refusal(ROWS, ["data.build_if_missing=false", "trainer.compile_scope=blocks"]) == (
        "override 'trainer.compile_scope=blocks' is refused by row sparse's training config: "
        "trainer.compile_scope='blocks' is unknown; use one of model, layers.")
    assert _refusal(ROWS, ["model=nosuch"]) == (
        "override 'model=nosuch' is refused by row sparse's training config: model=nosuch: no "
        "such option of the config group model; its options: 0p5b, 1b, 1p5b, 2b, depth_w512, "
        "pretrained, small_l12, small_l2, small_l4, small_l8, tiny.")


def test_a_value_only_some_rows_refuse_is_found_in_that_row():
    """Steering the coefficient (target_l0) needs l1_coeff > 0: the sparse row composes, the
    dense one does not; no single override is to blame (each needs the other), so both are
    named with the row's reason; one that alone breaks the row is named alone."""
    steer = ["sparsity.schedule=target_l0", "sparsity.target_l0=20"]
    check_train_overrides({"sparse": ROWS["sparse"]}, steer)
    assert _refusal(ROWS, ["trainer.compile_scope=layers", *steer]) == (
        "the overrides trainer.compile_scope=layers sparsity.schedule=target_l0 "
        "sparsity.target_l0=20 are refused together by row dense's training config: "
        "sparsity.schedule=target_l0 steers the L1 coefficient from sparsity.l1_coeff, which "
        "is 0; set it > 0, e.g. 3e-4.")
    # the tiny model has 4 heads of 32 dimensions (hidden 128): 3 heads do not divide it
    rows = {**ROWS, "wide": ["model=tiny", "model.hidden_size=96", "model.intermediate_size=64"]}
    assert _refusal(rows, ["trainer.compile_scope=layers", "model.num_heads=3"]) == (
        "override 'model.num_heads=3' is refused by row sparse's training config: "
        "model.hidden_size=128 is not divisible by model.num_heads=3; pick num_heads dividing "
        "hidden_size (head dim = hidden/heads).")
    assert _refusal({"wide": rows["wide"], "sparse": ROWS["sparse"]},
                    ["model.num_heads=3"]).startswith(
        "override 'model.num_heads=3' is refused by row sparse's training config")


def test_a_row_whose_own_overrides_do_not_compose_is_named_as_the_row():
    rows = {"sparse": ROWS["sparse"], "bad": ["model=tiny", "ffn.impl=cuda"]}
    assert _refusal(rows, ["trainer.compile_scope=layers"]) == (
        "row bad's own overrides do not compose (a value of the study's flags?): "
        "ffn.impl='cuda' is unknown; use one of torch, twell, auto.")
    assert _refusal(rows, []) == _refusal(rows, ["trainer.compile_scope=layers"])
