"""``twell-train`` / ``python -m train``: compose the config, build the trainer, train.

    twell-train                                        # tiny model, offline corpus, CPU (< 5 min)
    twell-train model=tiny trainer.max_steps=20 sparsity.l1_coeff=2e-5 hydra.run.dir=DIR
    twell-train -m sparsity.l1_coeff=0,1e-5,2e-5       # sweep: one run directory per value
    accelerate launch -m train experiment=paper_0p5b   # the paper recipe on a GPU node

The run directory is Hydra's run dir (``hydra.run.dir``; default ``runs/<date>/<time>``).
Before Hydra composes the config, :func:`check_overrides` refuses a key the schema does not
have (one line with the valid keys and the closest spelling, exit code 2); a run that fails
before it trains removes the run dir made for it (``train.rundir``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from train.config import RENAMED_KEYS, ConfigError, TrainConfig, register_configs

register_configs()
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def run(cfg: DictConfig, run_dir: str | None = None) -> dict:
    """Train one run from a composed config; returns the summary dict."""
    if os.environ.get("RANK", "0") == "0":  # a first line before the slow imports
        print("twell-train: loading the trainer (transformers, accelerate) ...", flush=True)
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
    except KeyboardInterrupt as e:  # SIGINT / SIGTERM: 130 / 143, the line says how to resume
        raise SystemExit(trainer.interrupted(e)) from None
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


def _schemas() -> dict:
    """Top-level key -> its dataclass (model, optim, sparsity, data, trainer, logging, eval)."""
    import dataclasses

    return {f.name: f.default_factory().__class__ for f in dataclasses.fields(TrainConfig)}


def unknown_key_message(group: str | None, key: str, known) -> str:
    """One line for an unknown key: the valid keys of its group and the closest spelling
    (difflib), or the new name of a renamed key."""
    import difflib

    full = f"{group}.{key}" if group else key
    if full in RENAMED_KEYS:
        return f"{full} was renamed {RENAMED_KEYS[full]}; use the new key."
    near = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean {group + '.' if group else ''}{near[0]}?" if near else \
        "; remove it or fix its spelling."
    if group is None:
        return f"unknown top-level key {key}{hint}"
    return f"unknown key {full}; valid keys of {group}: {', '.join(sorted(known))}{hint}"


def check_overrides(args: list[str]) -> None:
    """Refuse command-line overrides of keys the schema does not have, before Hydra does.

    Hydra's own message for ``sparsity.l1_coef=1e-3`` suggests ``+sparsity.l1_coef=1e-3``,
    which only adds a key nothing reads. Checked: ``group.key=v`` (also ``+``/``++``) for the
    groups of :class:`TrainConfig`, and unknown top-level keys. Left to Hydra: group choices
    (``model=tiny``), ``hydra.*``, deletions, ``@package`` overrides, flags and syntax errors.

    Raises:
        ConfigError: unknown key (one line: the valid keys of its group, the closest spelling).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    candidates = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except OverrideParseException:
        return  # Hydra reports the syntax error itself
    schemas = _schemas()
    groups = {p.name for p in CONFIG_DIR.iterdir() if p.is_dir()}
    for o in overrides:
        key = o.key_or_group
        if o.is_delete() or o.package is not None or key.split(".")[0].split("/")[0] == "hydra":
            continue
        head, _, rest = key.partition(".")
        if not rest:
            if head not in groups and head not in schemas:
                raise ConfigError(unknown_key_message(None, head, set(schemas) | groups))
            continue
        if head not in schemas:
            raise ConfigError(unknown_key_message(None, head, set(schemas) | groups))
        import dataclasses

        known = {f.name for f in dataclasses.fields(schemas[head])}
        if rest.split(".")[0] not in known:
            raise ConfigError(unknown_key_message(head, rest.split(".")[0], known))


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
            raise ConfigError(unknown_key_message(group.name, unknown[0], known))
    extra = sorted(set(cfg.keys()) - set(TrainConfig.__dataclass_fields__))
    if extra:
        raise ConfigError(unknown_key_message(None, extra[0], TrainConfig.__dataclass_fields__))


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
