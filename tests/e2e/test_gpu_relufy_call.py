"""scripts/gpu_relufy_call.sh, the ReLUfication study's device call, run in a scratch copy of
the repository layout with stand-ins for the GPU environment and the study: what comes back is
one archive holding the study folder with its rows (a device call returns nothing more than two
folders below $OUT), started from the rows merged in docs/relufy/study, and the call's exit
code is the study's."""

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a stand-in for scripts/relufy_study.py: records its arguments, scores one more row in --out
STUDY = '''import json, sys
from pathlib import Path
a = sys.argv[1:]
out = Path(a[a.index("--out") + 1])
(out / "rows" / "new_row").mkdir(parents=True, exist_ok=True)
(out / "rows" / "new_row" / "score.json").write_text(json.dumps({"args": a}))
sys.exit(int(__import__("os").environ.get("STUDY_RC", "0")))
'''


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "gpu_relufy_call.sh", repo / "scripts")
    (repo / "scripts" / "gpu_env.sh").write_text("true\n")  # no cache, wheels or GGUF to set up
    (repo / "scripts" / "relufy_study.py").write_text(STUDY)
    merged = repo / "docs" / "relufy" / "study" / "rows" / "dense_relu"
    merged.mkdir(parents=True)
    (merged / "score.json").write_text("{}")
    (repo / "docs" / "relufy" / "study" / "study.json").write_text("{}")
    return repo


def _call(repo: Path, out: Path, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    out.mkdir(exist_ok=True)
    bindir = repo.parent / "bin"  # python3 -> this interpreter; no nvidia-smi, no git repo
    bindir.mkdir(exist_ok=True)
    (bindir / "python3").unlink(missing_ok=True)
    (bindir / "python3").symlink_to(shutil.which("python3") or shutil.which("python"))
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "OUT": str(out), "STUDY_RC": str(rc),
           "MAX_WALL": "60"}
    return subprocess.run(["bash", "scripts/gpu_relufy_call.sh", *args], check=False, cwd=repo,
                          env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("rc", [0, 3])
def test_the_study_comes_back_as_one_archive_with_its_rows(tmp_path, rc):
    repo = _repo(tmp_path)
    r = _call(repo, tmp_path / "out", "--rows", "dense_relu,new_row", rc=rc)
    assert r.returncode == rc, r.stderr
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert [p.name for p in files] == ["relufy_study.tar.gz"]
    with tarfile.open(files[0]) as tar:
        names = set(tar.getnames())
        args = tar.extractfile("study/rows/new_row/score.json").read().decode()
    # the rows merged before, the row this call scored, the logs
    assert {"study/study.json", "study/rows/dense_relu/score.json",
            "study/rows/new_row/score.json", "logs/commit.txt"} <= names
    assert any(n.startswith("logs/piece_") for n in names)
    for want in ('"--out", "outputs/relufy_out/study"', '"--work", "/tmp/relufy_work"',
                 '"--max-wall", "60"', '"--rows", "dense_relu,new_row"'):
        assert want in args


def test_a_warm_machine_keeps_its_own_study_folder(tmp_path):
    """A second call on the same machine continues from outputs/relufy_out/study (rows scored
    by the first call included), not from the merged copy again."""
    repo = _repo(tmp_path)
    assert _call(repo, tmp_path / "out1").returncode == 0
    shutil.rmtree(repo / "docs" / "relufy" / "study")
    assert _call(repo, tmp_path / "out2").returncode == 0
    with tarfile.open(tmp_path / "out2" / "relufy_study.tar.gz") as tar:
        assert "study/rows/dense_relu/score.json" in tar.getnames()


def test_without_out_it_stops_at_once(tmp_path):
    repo = _repo(tmp_path)
    r = subprocess.run(["bash", "scripts/gpu_relufy_call.sh"], check=False, cwd=repo,
                       capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert r.returncode != 0 and "set OUT" in r.stderr
    assert not (repo / "outputs").exists()
