"""studies.jobs: the subprocess runner of the study scripts (statuses, parallelism, deadline, SIGTERM)."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import pytest

from studies.jobs import Job, job_env, last_train_record, run_finished, run_jobs, train_command


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
