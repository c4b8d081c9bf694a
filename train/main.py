"""``twell-train`` / ``python -m train``: compose the config, build the trainer, train.

    twell-train                                        # tiny model, offline corpus, CPU (< 5 min)
    twell-train model=tiny trainer.max_steps=20 sparsity.l1_coeff=2e-5 hydra.run.dir=DIR
    twell-train -m sparsity.l1_coeff=0,1e-5,2e-5       # sweep: one run directory per value
    accelerate launch -m train experiment=paper_0p5b   # the paper recipe on a GPU node

The run directory is Hydra's run dir (``hydra.run.dir``; default ``runs/<date>/<time>``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from train.config import ConfigError, TrainConfig, register_configs

register_configs()
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def run(cfg: DictConfig, run_dir: str | None = None) -> dict:
    """Train one run from a composed config; returns the summary dict."""
    from train.trainer import Trainer

    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    _reject_unknown_keys(cfg)
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
        # printed after close() (wandb's own summary) so these lines come last
        print(f"checkpoint: {summary['paths']['checkpoint']}\n"
              f"metrics:    {summary['paths']['metrics']}\n"
              f"summary:    {Path(run_dir) / 'summary.json'}")
    return summary


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """Hydra lets ``+group.key=value`` add keys the schema does not have, and OmegaConf would
    drop them silently into the dataclasses: refuse them with one line naming the key."""
    import dataclasses

    for group in TrainConfig.__dataclass_fields__.values():
        node = cfg.get(group.name)
        schema = group.default_factory() if group.default_factory is not dataclasses.MISSING \
            else None
        if node is None or schema is None or not dataclasses.is_dataclass(schema):
            continue
        known = {f.name for f in dataclasses.fields(schema)}
        unknown = sorted(set(node.keys()) - known)
        if unknown:
            raise ConfigError(
                f"unknown key {group.name}.{unknown[0]} (valid keys of {group.name}: "
                f"{', '.join(sorted(known))}); remove it or fix its spelling.")
    extra = sorted(set(cfg.keys()) - set(TrainConfig.__dataclass_fields__))
    if extra:
        raise ConfigError(f"unknown top-level key {extra[0]}; remove it or fix its spelling.")


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _main(cfg: DictConfig) -> float | None:
    from offline.fetch import FetchError
    from train.data import DataError
    from train.trainer import NonFiniteLossError

    try:
        summary = run(cfg)
    except (ConfigError, NonFiniteLossError, DataError, FetchError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    return summary.get("val_loss")  # what a Hydra sweeper would minimise


def cli() -> None:
    """Console entry point ``twell-train`` (Hydra parses sys.argv)."""
    _main()


if __name__ == "__main__":
    cli()
