"""studies.bench.determinism and scripts/check_determinism.py: the weights digest sees one bit,
the comparison names the first differing step, and the smoke shape's deterministic stage 1 runs
twice to the same bits (exit 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from studies.bench.determinism import RunPrint, first_difference, weights_digest

ROOT = Path(__file__).resolve().parents[2]


def test_weights_digest_changes_with_one_bit_and_not_with_a_copy():
    w = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(4)}
    same = {k: v.clone() for k, v in reversed(list(w.items()))}  # other insertion order
    assert weights_digest(w) == weights_digest(same)
    flipped = {k: v.clone() for k, v in w.items()}
    flipped["b"].view(torch.int32)[1, 2] ^= 1  # the lowest mantissa bit of one weight
    assert weights_digest(flipped) != weights_digest(w)
    reshaped = {"a": w["a"], "b": w["b"].reshape(3, 2)}  # same bytes, another shape
    assert weights_digest(reshaped) != weights_digest(w)


def test_first_difference_names_the_first_step_and_treats_nan_as_equal():
    nan = float("nan")
    a = RunPrint((30.5, nan, 12.25), "d")
    assert first_difference(a, RunPrint((30.5, nan, 12.25), "d")) is None
    assert first_difference(a, RunPrint((30.5, nan, 12.250000000000002), "d")) == (
        "training L0 differs first at step 3: 12.25 vs 12.250000000000002")
    assert first_difference(a, RunPrint((30.5, nan), "d")) == "the runs logged 3 and 2 steps"
    assert "final weights differ" in first_difference(a, RunPrint(a.l0, "e"))


def test_smoke_stage1_twice_is_bitwise_the_same():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's packages
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_determinism.py"),
                          "--smoke", "--steps", "3"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=False, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("trainer.deterministic=true")]
    assert lines[-1] == "trainer.deterministic=true: bitwise the same"
    digests = {x.rsplit(" ", 1)[1] for x in lines[:2]}
    assert len(lines) == 3 and len(digests) == 1


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bad_input_is_one_line_and_exit_2_before_any_training(capsys):
    """A typo in --config, an unknown size or a key the check sets itself: one line naming it
    and the fix, exit status 2 (not 1, which means "the runs differ"), nothing trained."""
    main = _script("check_determinism").main
    cases = [(["--smoke", "--config", "trainer.micro_bach=2"], "did you mean trainer.micro_batch"),
             (["--size", "bogus"], "no configs/model/bogus.yaml; the sizes: "),
             (["--smoke", "--config", "trainer.deterministic=false"], "use --steps / --control"),
             (["--smoke", "--config", "nonsense"], "is not KEY=VALUE")]
    for argv, want in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0] and err[0].startswith("check_determinism: ")


def test_a_paper_size_without_cuda_is_refused_in_one_line(capsys, monkeypatch):
    """Without a GPU a paper size would be built in fp32 on the CPU and killed for memory: it is
    refused before anything is built, pointing at --smoke."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main = _script("check_determinism").main
    assert main(["--size", "1p5b", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has none; on a CPU pass --smoke" in err[0]


def test_size_with_smoke_is_refused(capsys):
    # the smoke run has one tiny shape of its own: a --size beside it would be ignored
    assert _script("check_determinism").main(["--smoke", "--size", "2b"]) == 2
    assert capsys.readouterr().err.strip() == (
        "check_determinism: --size 2b with --smoke: the smoke run trains its own tiny shape; "
        "drop --size")


def test_bench_model_config_typo_is_one_line_and_exit_2(capsys):
    main = _script("bench_model").main
    assert main(["--smoke", "--config", "trainer.micro_bach=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean trainer.micro_batch" in err[0]
