"""``twell-train`` / ``python -m train``: compose the config, build the trainer, train.

    twell-train                                        # tiny model, offline corpus, CPU (< 5 min)
    twell-train model=tiny trainer.max_steps=20 sparsity.l1_coeff=2e-5 hydra.run.dir=DIR
    twell-train -m sparsity.l1_coeff=0,1e-5,2e-5       # sweep: one run directory per value
    accelerate launch -m train experiment=paper_0p5b   # the paper recipe on a GPU node

The run directory is Hydra's run dir (``hydra.run.dir``; default ``runs/<date>/<time>``).
Before Hydra composes the config, :func:`train.config.check_overrides` refuses a key the schema
does not have (one line with the valid keys and the closest spelling, exit code 2); a run that
fails before it trains removes the run dir made for it (``train.rundir``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from train.config import (
    CONFIG_DIR,
    ConfigError,
    TrainConfig,
    check_overrides,
    register_configs,
    reject_unknown_keys,
)

register_configs()


def run(cfg: DictConfig, run_dir: str | None = None) -> dict:
    """Train one run from a composed config; returns the summary dict."""
    from train.trainer import Trainer

    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    reject_unknown_keys(cfg)
    try:
        tcfg: TrainConfig = OmegaConf.to_object(cfg)  # runs every __post_init__ check
    except ValueError as e:  # ConfigError and the data config's checks: one line, no traceback
        raise ConfigError(str(e)) from None
    trainer = Trainer(tcfg, run_dir)
    try:
        summary = trainer.train()
    except KeyboardInterrupt:
        last = trainer.last_ckpt
        print(f"interrupted at step {trainer.step}; last complete checkpoint: "
              f"{last or 'none'}. Re-run the same command to resume.", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        trainer.close()
    if trainer.is_main and "paths" in summary and (Path(run_dir) / "summary.json").is_file():
        from train.trainer import summary_line

        # printed after close() (wandb's own output) so these lines come last
        trainer.report([f"checkpoint: {summary['paths']['checkpoint']}",
                        f"metrics:    {summary['paths']['metrics']}",
                        f"summary:    {Path(run_dir) / 'summary.json'}",
                        summary_line(summary)])
    return summary


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _main(cfg: DictConfig) -> float | None:
    from offline.fetch import FetchError
    from train.data import DataError
    from train.trainer import NonFiniteLossError

    try:
        summary = run(cfg)
    except (ConfigError, NonFiniteLossError, DataError, FetchError) as e:
        line = f"{type(e).__name__}: {e}"
        print(line, file=sys.stderr)
        _after_failure(line)
        sys.exit(2)
    return summary.get("val_loss")  # what a Hydra sweeper would minimise


def _after_failure(line: str) -> None:
    """A run that failed before it trained leaves no run dir behind (only one this invocation
    made and that holds nothing but Hydra's files, the lock and the log); a run dir that stays
    gets the error in its train.log. Rank 0 only."""
    import os
    import time

    from hydra.core.hydra_config import HydraConfig

    from train.rundir import remove_failed_run_dir

    if int(os.environ.get("RANK", "0")) != 0:
        return
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if not remove_failed_run_dir(run_dir) and (run_dir / "train.log").is_file():
        with (run_dir / "train.log").open("a") as f:
            f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")


def cli() -> None:
    """Console entry point ``twell-train`` (Hydra parses sys.argv)."""
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    _main()


if __name__ == "__main__":
    cli()
