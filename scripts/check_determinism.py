#!/usr/bin/env python
"""Is the bench model's stage 1 bitwise reproducible here? Trains it twice with
trainer.deterministic=true (and, with --control, twice without) and compares the training
L0 of every step and the final weights. A thin driver over studies.bench.determinism.

    # one H200: the 1.5B recipe, 20 steps a run, with the control pair (~2.5 min)
    python scripts/check_determinism.py --size 1p5b --steps 20 --control \\
        --config data.build_if_missing=false
    # CPU: the benchmark's tiny smoke shape (tests/e2e/test_check_determinism.py)
    python scripts/check_determinism.py --smoke --steps 3

Exit status 0 when the deterministic pair is the same bit for bit, 1 when it differs, 2 for bad
input. The control pair's outcome is printed, not judged: two ordinary runs may agree by chance.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from studies.bench.determinism import first_difference, train_once
from studies.bench.recipe import (
    CONTROLLED,
    Recipe,
    check_config,
    check_overrides,
    write_smoke_tokens,
)
from studies.sizes import check_sizes


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=None,
                   help="configs/model/<size>.yaml (1p5b; not with --smoke, its own tiny shape)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps a run (20)")
    p.add_argument("--control", action="store_true",
                   help="also two runs without trainer.deterministic (printed, not judged)")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="Hydra overrides for the runs (e.g. data.cache_dir=...)")
    p.add_argument("--smoke", action="store_true", help="the tiny CPU shape of bench_model")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps must be >= 1; got {a.steps}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:  # the check sets the benchmark's keys and trainer.deterministic itself
        if a.smoke and a.size is not None:
            raise ValueError(f"--size {a.size} with --smoke: the smoke run trains its own tiny "
                             "shape; drop --size")
        a.size = a.size or "1p5b"
        check_config(a.config, (*CONTROLLED, "trainer.deterministic"),
                     instead="--steps / --control")
        if not a.smoke:
            check_sizes([a.size], "--size")
        check_overrides([a.size], Recipe(steps=a.steps), a.config, smoke=a.smoke)
        if not a.smoke and not torch.cuda.is_available():  # fp32 1.5B twice: out of memory
            raise ValueError(f"--size {a.size} trains the model twice on a CUDA GPU and this "
                             "machine has none; on a CPU pass --smoke (the tiny shape)")
    except ValueError as e:  # one line, exit code 2 (bad input)
        print(f"check_determinism: {e}", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    with tempfile.TemporaryDirectory(prefix="twell_determinism_tokens_") as tmp:
        tokens = write_smoke_tokens(Path(tmp) / "tokens.bin") if a.smoke else None
        size = "smoke" if a.smoke else a.size
        verdict = {}
        for deterministic in (True, False) if a.control else (True,):
            recipe = Recipe(steps=a.steps, deterministic=deterministic)
            runs = [train_once(size, recipe, a.config, dev, tokens) for _ in range(2)]
            diff = first_difference(*runs)
            name = "trainer.deterministic=" + ("true" if deterministic else "false")
            for i, r in enumerate(runs):
                print(f"{name} run {i + 1}: L0 at step {a.steps} {r.l0[-1]!r}, weights sha256 "
                      f"{r.digest[:16]}", flush=True)
            print(f"{name}: " + ("bitwise the same" if diff is None else f"DIFFERENT: {diff}"),
                  flush=True)
            verdict[deterministic] = diff
    return 0 if verdict[True] is None else 1


if __name__ == "__main__":
    sys.exit(main())
