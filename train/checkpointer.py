"""The trainer's checkpointer: which checkpoint a run resumes, saving one, restoring one.

``train.checkpoint`` is the folder format (atomic writes, state files, verification, rotation);
this module is what a training run does with it: find and check the checkpoint a run continues
(``trainer.resume``, the resume rules of ``train.rundir``), save ``checkpoints/step{N}/`` with
every rank agreeing on each stage, restore weights, optimizer, scheduler, trainer, data and RNG
state from one, continue or branch its lineage, and say how to resume a stopped run.

The :class:`Checkpointer` owns the checkpoint side of a run (the last checkpoint, the step it
holds, the lineage); what it saves and restores belongs to the trainer and is reached only
through the :class:`Checkpointed` members.

    ckpt = Checkpointer(cfg, run_dir, acc, any_rank=..., print_=print, warn=print)
    found = ckpt.find_resume()           # before the model is built
    ckpt.check_resume_config(found, config_dict)
    ...
    ckpt.resume(trainer, found)          # or, between steps:
    ckpt.save(trainer)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from accelerate.utils import set_seed
from omegaconf import OmegaConf

from train import checkpoint as ckpt_io
from train import parallel, rundir
from train.config import (
    ConfigError,
    TrainConfig,
    check_ffn_fits_model,
    check_target_fits_model,
    upgrade_saved,
)
from train.requeue import override_arg

shell_quote = ckpt_io.shell_quote


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stops before applying that step.

    Args:
        line: the one-line message.
        step: the step that diverged (None: not a training step, e.g. an eval's logits).
        reason: what was non-finite, short ("non-finite loss or gradient").
        last_ckpt: the last good checkpoint (None: none saved yet); read only with ``step``.
    """

    def __init__(self, line: str, *, step: int | None = None, reason: str = "",
                 last_ckpt: Path | None = None):
        super().__init__(line)
        self.step, self.reason, self.last_ckpt = step, reason, last_ckpt

    def facts(self, run_dir: str | Path) -> dict | None:
        """What ``twell-train`` writes to :data:`train.errors.ERROR_FACTS` beside the error
        line: ``{"error", "step", "reason", "last_good_checkpoint"}``, the checkpoint relative
        to ``run_dir`` when inside it (absolute otherwise; None: none). None when the error
        is not of a training step (no step to name)."""
        if self.step is None:
            return None
        ckpt = None
        if self.last_ckpt is not None:
            path, root = Path(self.last_ckpt).resolve(), Path(run_dir).resolve()
            ckpt = str(path.relative_to(root) if path.is_relative_to(root) else path)
        return {"error": type(self).__name__, "step": self.step, "reason": self.reason,
                "last_good_checkpoint": ckpt}


def config_to_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain containers (what ``config.yaml`` and checkpoints store)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_SCHEMA_DEFAULTS: dict | None = None


def _schema_default(key: str):
    """The schema's default of a dotted key (``TrainConfig()``), None if it has none."""
    global _SCHEMA_DEFAULTS
    if _SCHEMA_DEFAULTS is None:
        _SCHEMA_DEFAULTS = _flatten(config_to_dict(TrainConfig()))
    return _SCHEMA_DEFAULTS.get(key)


def config_diff(a: dict, b: dict, ignore: tuple[str, ...] = ("trainer.resume",)) -> list[str]:
    """Keys (dotted) whose values differ between two config dicts, as 'key: a -> b'. A key that
    one of them lacks (a config saved before the key existed) counts as the schema's default,
    the behaviour that run had."""
    fa, fb = _flatten(a), _flatten(b)
    keys = sorted((set(fa) | set(fb)) - set(ignore))

    def get(f: dict, k: str):
        return f[k] if k in f else _schema_default(k)

    return [f"{k}: {get(fa, k)!r} -> {get(fb, k)!r}" for k in keys if get(fa, k) != get(fb, k)]


def _ckpt_step(path: Path) -> int:
    return int(ckpt_io.read_metadata(path)["step"])


class Checkpointed(Protocol):
    """What a :class:`Checkpointer` saves and restores: the trainer's members it reads (and, on
    resume, sets: ``load_state_dict`` and the objects' own ``load_state_dict``)."""

    model: Any  # the prepared model (accelerate / FSDP2 wrapped)
    optimizer: Any  # accelerate's optimizer wrapper (``.optimizer``: the torch optimizer)
    scheduler: Any  # the lr scheduler
    data: Any  # the data module (``state_dict`` / ``load_state_dict``, maybe ``tokenizer``)
    plan: Any  # the FFN plan (rows per call and capacities follow the micro-batch)
    step: int  # optimizer steps done
    tokens_seen: int
    config_dict: dict  # the resolved config (train_config.yaml)

    def state_dict(self) -> dict: ...

    def load_state_dict(self, d: dict) -> None: ...


class Checkpointer:
    """Find, check, save and restore the checkpoints of one run (all ranks construct one).

    Args:
        cfg: the run's :class:`train.config.TrainConfig` (``inspect_init_from`` fills its model
            shape).
        run_dir: the run directory; checkpoints go to ``run_dir/checkpoints/step{N}/``.
        acc: the run's ``accelerate.Accelerator`` (ranks, the main process, unwrapping).
        any_rank: ``flag -> the largest flag over ranks`` (a host-side all-reduce; ``flag`` on
            one process): every save stage ends with the ranks agreeing.
        print_: prints a line to the run's output (and train.log).
        warn: prints a warning line.

    Attributes:
        last_ckpt: the newest checkpoint this run wrote or resumed from (None: none yet).
        saved_step: the step ``last_ckpt`` holds (a stop does not save it twice).
        lineage: the line of training the next save records (``ckpt_io.new_lineage``).
        rerun_arg: the override that re-runs this job in its folder (a ``-m`` sweep's
            ``hydra.sweep.dir``; twell-train sets it), None: ``hydra.run.dir`` of the run dir.
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, acc, *, any_rank: Callable[[int], int],
                 print_: Callable[[str], None], warn: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.acc = acc
        self.is_main = acc.is_main_process
        self._any_rank, self._print, self._warn = any_rank, print_, warn
        self.last_ckpt: Path | None = None
        self.saved_step: int | None = None
        self.lineage = ckpt_io.new_lineage()  # a resume continues or branches the checkpoint's
        self.rerun_arg: str | None = None

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    # ---------------------------------------------------------------- before the model exists

    def find_resume(self) -> Path | None:
        """The verified checkpoint this run continues, or None (``rundir.find_resume_checkpoint``:
        the resume, lineage and verification rules). The main process decides (it reads and
        hashes the files) and tells the other ranks; a refusal is raised on every rank.

        Raises:
            ConfigError: a resume the run dir does not allow (one line).
            train.checkpoint.CheckpointError: the named checkpoint is damaged.
        """
        found, error = None, None
        if self.is_main:
            try:
                found = rundir.find_resume_checkpoint(self.run_dir, self.cfg.trainer.resume,
                                                      warn=self._warn)
            except ConfigError as e:
                error = e
        if self.acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            box = [None if found is None else str(found), None if error is None else str(error),
                   isinstance(error, ckpt_io.CheckpointError)]
            broadcast_object_list(box, from_process=0)
            found = None if box[0] is None else Path(box[0])
            if box[1] is not None and error is None:
                error = (ckpt_io.CheckpointError if box[2] else ConfigError)(box[1])
        if error is not None:
            raise error
        return found

    def inspect_init_from(self, resume_from: Path | None):
        """``model.init_from``: read the source's config and fill the model shape from it
        (``cfg.model`` is replaced); returns the inspected source
        (``train.pretrained.inspect_checkpoint``). A resumed run reads neither: its checkpoint
        holds the model (config.json, the resolved model config), so the source may have moved
        or been deleted since; the source returned is then the checkpoint itself."""
        from train import pretrained

        cfg = self.cfg
        if resume_from is None:
            init_src = pretrained.inspect_checkpoint(cfg.model.init_from)
            cfg.model = pretrained.fill_model_config(cfg.model, init_src)
            try:  # the filled shape against ffn.impl, ffn.dense_fused and sparsity.target_l0
                check_ffn_fits_model(cfg.ffn, cfg.model)
                check_target_fits_model(cfg.sparsity, cfg.model)
            except ConfigError as e:
                raise ConfigError(f"{e} (shape from model.init_from={init_src.spec!r})") from None
            return init_src
        saved = ckpt_io.load_yaml(resume_from / "train_config.yaml")["model"]
        fill = {f.name: saved[f.name] for f in dataclasses.fields(cfg.model)
                if getattr(cfg.model, f.name) is None and f.name in saved}
        cfg.model = dataclasses.replace(cfg.model, **fill)
        return pretrained.inspect_checkpoint(str(resume_from))

    def check_resume_config(self, found: Path | None, config_dict: dict) -> None:
        """Refuse a checkpoint of another model shape, changes a resume does not allow, and a
        run dir that holds a different run's config but no checkpoint, and
        ``trainer.resume=never`` in a run dir with checkpoints (``train.rundir``: the resume
        rules).

        Args:
            found: the checkpoint :meth:`find_resume` returned (None: a new run).
            config_dict: this run's resolved config (``config_to_dict``).

        Raises:
            ConfigError: one line naming the keys and the fix.
        """
        explicit = self.cfg.trainer.resume not in ("auto", "never")
        if found is not None:
            # a config saved before the ffn group existed reads as one saved after (upgrade_saved)
            saved = upgrade_saved(ckpt_io.load_yaml(found / "train_config.yaml"))
            # the shape: model.* but its name, and ffn.policy.* but the inference knobs
            # (rundir.RESUME_SAFE_POLICY_KEYS)
            diff = [d for d in config_diff(saved, config_dict)
                    if d.startswith(("model.", "ffn.policy."))
                    and not rundir.resume_safe(d.split(":", 1)[0])]
            if diff:
                other = ("another trainer.resume" if explicit  # the run dir is not the cause
                         else "a new hydra.run.dir")
                raise ConfigError(f"checkpoint {found} has another model shape ({'; '.join(diff[:3])})"
                                  f"; use the same model config or {other}.")
            self._check_resume_changes(found, saved, config_dict, explicit)
            return
        old = self.run_dir / "config.yaml"
        if old.is_file():
            diff = config_diff(upgrade_saved(ckpt_io.load_yaml(old)), config_dict)
            if diff:
                raise ConfigError(
                    f"{self.run_dir} holds a different run's config ({'; '.join(diff[:3])}) and "
                    "no checkpoint to resume; use a new hydra.run.dir, or set that run's files "
                    "aside (its log stays) and run again: "
                    f"{rundir.set_aside_command(self.run_dir)}")
        if self.cfg.trainer.resume == "never":
            rundir.check_new_line(self.run_dir)

    def _check_resume_changes(self, found: Path, saved: dict, config_dict: dict,
                              explicit: bool) -> None:
        """``trainer.resume=auto`` continues only the same run (config equal up to
        ``rundir.RESUME_SAFE_KEYS``); an explicit path may change other keys, but the optimizer
        and its schedule only with ``trainer.resume_allow_changes=true``."""
        optim, other = rundir.split_changes(config_diff(saved, config_dict))
        flag = "trainer.resume_allow_changes=true"
        if not explicit and (optim or other):
            run = found.parent.parent
            raise ConfigError(
                f"{self.run_dir} holds a run with another config (checkpoint {found.name}: "
                f"{'; '.join((other + optim)[:4])}{'; ...' if len(other + optim) > 4 else ''}); to "
                f"continue it with these values pass trainer.resume={shell_quote(run)}"
                + (f" {flag}" if optim else "") + ", or use a new hydra.run.dir.")
        if optim and not self.cfg.trainer.resume_allow_changes:
            raise ConfigError(
                f"resuming {found} would change the optimizer or its schedule ({'; '.join(optim)})"
                f"; add {flag} to apply the new values from step {_ckpt_step(found) + 1}, "
                "or drop these overrides.")

    # ---------------------------------------------------------------- save

    def save(self, target: Checkpointed) -> Path:
        """Write ``checkpoints/step{N}/`` of ``target`` atomically (all ranks call this); returns
        the folder.

        Model and optimizer state are full tensors in the unsharded formats (an FSDP model's are
        gathered on rank 0), so the checkpoint resumes on any number of ranks, sharded or not.
        Every stage (temp folder, files, metadata and rename) ends with the ranks agreeing that
        it worked; if it failed anywhere, the temp folder is removed and every rank raises (a
        full disk: one-line :class:`train.checkpoint.CheckpointError`).

        Raises:
            NonFiniteLossError: the weights hold NaN or inf (nothing is saved).
            train.checkpoint.CheckpointError: a stage failed on some rank (``save_failure``:
                one line with the previous checkpoint and :meth:`resume_advice`).
        """
        model = self.acc.unwrap_model(target.model)
        sharded = parallel.is_sharded(model)
        model_sd = optim_sd = None
        if sharded:  # gather on rank 0 (collectives: every rank takes part)
            model_sd = parallel.model_state_dict(model)
            optim_sd = parallel.optimizer_state_dict(model, target.optimizer.optimizer)
        step = target.step
        final = ckpt_io.checkpoint_root(self.run_dir) / f"step{step}"
        tmp = ckpt_io.tmp_path(final)
        stages = [lambda: self.is_main and (self._check_finite_weights(model, model_sd, step),
                                            ckpt_io.begin(self.run_dir, step)),
                  lambda: self._write_checkpoint_files(target, tmp, model, model_sd, optim_sd),
                  lambda: self.is_main and ckpt_io.finish(
                      tmp, final, step=step, world_size=self.acc.num_processes,
                      keep_last=self.cfg.trainer.keep_last, lineage=self.lineage,
                      extra={"tokens_seen": target.tokens_seen})]
        for stage in stages:
            error = None
            try:
                stage()
            except Exception as e:  # noqa: BLE001  (cleaned up and raised below, on every rank)
                error = e
            if self._any_rank(error is not None):
                if error is None:
                    error = ckpt_io.CheckpointError(
                        f"checkpoint {final}: another rank failed to write its part (its error is "
                        f"in its output); the partial {tmp} was removed")
                raise ckpt_io.save_failure(error, tmp, final, previous=self.last_ckpt,
                                           advice=self.resume_advice()) from None
        self.last_ckpt, self.saved_step = final, step
        return final

    def _check_finite_weights(self, model, model_sd, step: int) -> None:
        """Main process, before a save: weights that became NaN / inf in a step whose loss and
        gradient were finite (an update too large) are never saved, so the last checkpoint is
        always a good one to name and resume (``model_sd``: the gathered state of a sharded
        model).

        Raises:
            NonFiniteLossError: one line naming the tensors and the last good checkpoint.
        """
        from twell.hf import CheckpointError, check_finite

        tensors = model_sd.items() if model_sd is not None else model.named_parameters()
        try:
            check_finite(tensors, f"step {step}")
        except CheckpointError as e:
            first = str(e).split(": tensor ", 1)[-1].split(" holds ")[0]
            raise NonFiniteLossError(
                f"weights hold NaN or inf after step {step} ({first}) though its loss and "
                "gradient were finite (an update too large: lower optim.lr); not saved; last "
                f"good checkpoint: {shell_quote(self.last_ckpt) if self.last_ckpt else 'none'}",
                step=step, reason="non-finite weights", last_ckpt=self.last_ckpt) from None

    def _write_checkpoint_files(self, target: Checkpointed, tmp: Path, model, model_sd,
                                optim_sd) -> None:
        """Every rank: its RNG and data state; the main process: model, tokenizer, optimizer,
        scheduler and trainer state, config (no pickle anywhere: ``ckpt_io.save_state``)."""
        ckpt_io.save_state(tmp, f"rank{self.acc.process_index}",
                           {"rng": ckpt_io.rng_state(), "data": target.data.state_dict()})
        if not self.is_main:
            return
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Writing model shards" bar inside ours
        model.save_pretrained(tmp, **({"state_dict": model_sd} if model_sd is not None else {}))
        if getattr(target.data, "tokenizer", None) is not None:
            target.data.tokenizer.save_pretrained(tmp)
        ckpt_io.save_state(tmp, "optimizer",
                           optim_sd if optim_sd is not None else target.optimizer.state_dict())
        ckpt_io.save_state(tmp, "scheduler", target.scheduler.state_dict())
        ckpt_io.save_state(tmp, "trainer", target.state_dict())
        (tmp / "train_config.yaml").write_text(OmegaConf.to_yaml(target.config_dict))

    # ---------------------------------------------------------------- resume

    def _load_weights(self, target: Checkpointed, path: Path) -> None:
        from safetensors.torch import load_file

        f = path / "model.safetensors"
        try:
            state = load_file(str(f))  # to CPU; copied into place
        except Exception as e:  # noqa: BLE001  (SafetensorError, OSError: one line)
            raise ckpt_io.CheckpointError(
                f"{f} is damaged ({e}); {rundir.ways_out(path, ['model.safetensors'])}") from None
        model = self.acc.unwrap_model(target.model)
        ckpt_io.check_weights(state, model.state_dict(), f,
                              rundir.ways_out(path, ["model.safetensors"]))
        missing, unexpected = parallel.load_model_state_dict(model, state)
        if [k for k in missing if k != "lm_head.weight"] or unexpected:
            raise ckpt_io.CheckpointError(f"{f}: the weights do not match the model (missing "
                                          f"{missing[:3]}, unexpected {unexpected[:3]})")

    def resume(self, target: Checkpointed, path: Path) -> dict[str, dict]:
        """Restore ``target`` from a checkpoint folder: weights, optimizer, scheduler, trainer and
        sparsity state, the data position and RNG states, on any number of ranks; continue the
        checkpoint's lineage (a checkpoint of this run dir) or branch it (one of another run
        dir); on the main process rewrite config.yaml and drop the metrics logged after the
        checkpoint (they will be redone). Nothing in it can run code (``ckpt_io.load_state``:
        safetensors and JSON).

        The global batch must be the one of the checkpoint (the data position and the schedules
        count its steps); the world size, micro-batch and accumulation may change, and 1 process,
        DDP and FSDP load each other's checkpoints. What continues exactly: the blocks of every
        step (a global data position), the lr / L1 schedules, the optimizer state, the dead-unit
        windows, auto's paths. The per-rank RNG states are restored only on the same world size
        (elsewhere every rank is re-seeded from trainer.seed, the step and its rank): after
        initialisation training draws no random numbers from them (no dropout; dead-unit
        re-init has its own generator seeded by the step). The no-sync dense-backup capacities
        count rows per FFN call, so a different micro-batch measures them again. A checkpoint of
        this run dir continues its lineage; one of another run dir starts a branch of it.

        Args:
            target: the trainer being restored (its optimizer and scheduler built, its state
                at the start of a run).
            path: the checkpoint folder (verified: :meth:`find_resume`).

        Returns:
            The latest metrics record kept of each kind (``"train"``, ``"val"``, ``"eval"``;
            a kind never logged is absent): the main process's, empty on the others.

        Raises:
            ConfigError: another global batch, or a data position of other data.
            train.checkpoint.CheckpointError: a state file is missing, damaged or holds a pickle
                that is not plain data (one line naming the file).
        """
        meta = ckpt_io.read_metadata(path)
        t = self.cfg.trainer
        saved_t = ckpt_io.load_yaml(path / "train_config.yaml")["trainer"]
        if saved_t["global_batch"] != t.global_batch:
            raise ConfigError(f"checkpoint {path} was trained with trainer.global_batch="
                              f"{saved_t['global_batch']}, this run has {t.global_batch}; resume "
                              "with the same global batch (any world size and micro-batch).")
        self._load_weights(target, path)
        step = self._load_states(target, path, meta)
        self._fit_plan(target.plan, saved_t)
        self._restore_position(target, path, meta, step)
        self.last_ckpt, self.saved_step = path, step
        here = path.resolve().parent.parent == self.run_dir.resolve()
        self.lineage = (meta["lineage"] if here and meta.get("lineage")
                        else ckpt_io.new_lineage(None if here else path))
        if self.is_main:
            return self._resume_run_files(path, step, target.config_dict)
        return {}

    def _load_states(self, target: Checkpointed, path: Path, meta: dict) -> int:
        """The optimizer, scheduler and trainer state of ``path`` into ``target``; the step.

        Raises:
            train.checkpoint.CheckpointError: a state that does not fit this run, or a step
                other than the metadata's (one line).
        """
        ways = rundir.ways_out(path, ["optimizer"])
        optim_sd = ckpt_io.load_state(path, "optimizer")
        params = [q for g in target.optimizer.optimizer.param_groups for q in g["params"]]
        ckpt_io.check_optimizer_state(optim_sd, params, path / "optimizer.safetensors", ways)
        try:  # a damaged state that passed its checks still fails in one line
            parallel.load_optimizer_state_dict(self.acc.unwrap_model(target.model),
                                               target.optimizer.optimizer, optim_sd)
            target.scheduler.load_state_dict(ckpt_io.load_state(path, "scheduler"))
            target.load_state_dict(ckpt_io.load_state(path, "trainer"))
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ckpt_io.CheckpointError(
                f"checkpoint {path}: its optimizer, scheduler or trainer state does not fit this "
                f"run ({type(e).__name__}: {' '.join(str(e).split())[:160]}); {ways}") from None
        step = target.step
        if step != meta.get("step"):  # the folder's records, never its name, give the step
            raise ckpt_io.CheckpointError(
                f"checkpoint {path}: its trainer state is at step {step} but metadata.json "
                f"records step {meta.get('step')}: it was altered; {ways}")
        return step

    def _fit_plan(self, plan, saved_t: dict) -> None:
        """The restored FFN plan's capacities and timings count rows per FFN call: scaled to
        this run's micro-batch, or measured again when the state lacks its rows."""
        t = self.cfg.trainer
        if t.micro_batch is not None and plan.rows_per_call is not None:
            # capacities and timings count rows per FFN call: scaled to the new micro-batch
            plan.set_rows_per_call(t.micro_batch * self.cfg.model.seq_len, t.micro_batch)
        elif saved_t["micro_batch"] != t.micro_batch:  # a state without its rows: measured again
            plan.reset_capacities()

    def _restore_position(self, target: Checkpointed, path: Path, meta: dict, step: int) -> None:
        """The data position and (on the same world size) the RNG states of ``path``; on
        another world size every rank is re-seeded from the seed, the step and its rank.

        Raises:
            ConfigError: a data position of other data.
            ValueError: a position that is not ``step`` x the global batch.
        """
        t = self.cfg.trainer
        same_world = meta["world_size"] == self.acc.num_processes
        # the data position is global (the same in every rank's file); a streamed source keeps
        # per-rank state and refuses another world size
        rank = ckpt_io.load_state(path, f"rank{self.acc.process_index if same_world else 0}")
        try:
            target.data.load_state_dict(rank["data"])
        except ValueError as e:  # another data set, seq_len or seed: the position means nothing
            raise ConfigError(f"trainer.resume={path}: the checkpoint's data position does not "
                              f"fit this run's data ({e}); resume with the checkpoint's data "
                              "config or start a new run (a new hydra.run.dir).") from None
        position = getattr(target.data, "position", None)
        if position is not None and position != step * t.global_batch:
            raise ValueError(f"{path}: data position {position} blocks is not step {step} x "
                             f"global batch {t.global_batch}: the checkpoint is inconsistent")
        if same_world:
            ckpt_io.set_rng_state(rank["rng"])
        else:
            set_seed(t.seed + step, device_specific=True)  # + rank
            self._print(f"resuming a {meta['world_size']}-rank checkpoint on "
                        f"{self.acc.num_processes} ranks (same global batch {t.global_batch})")

    def _resume_run_files(self, path: Path, step: int, config_dict: dict) -> dict[str, dict]:
        """Main process: rewrite config.yaml, drop metrics logged after the checkpoint (they will
        be redone); returns the latest logged record of each kind (summary.json of an already
        finished run takes its numbers from them)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt_io.write_atomic(self.run_dir / "config.yaml", OmegaConf.to_yaml(config_dict))
        kept, bad = [], 0
        if self.metrics_path.is_file():
            for ln in self.metrics_path.read_text(errors="replace").splitlines():
                try:  # a line cut short by a crash or a full disk is dropped, not a traceback
                    r = json.loads(ln) if ln.strip() else None
                except ValueError:
                    r = None
                bad += ln.strip() != "" and not isinstance(r, dict)
                if isinstance(r, dict) and isinstance(r.get("step", 0), int) \
                        and r.get("step", 0) <= step:
                    kept.append(r)
            if bad:
                self._warn(f"warning: {self.metrics_path}: dropped {bad} damaged line(s) (a write "
                           "cut short?)")
        ckpt_io.write_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        latest: dict[str, dict] = {}
        for r in kept:
            kind = r.pop("kind", "train")
            if kind in ("train", "val", "eval"):
                latest[kind] = r
        saved = upgrade_saved(ckpt_io.load_yaml(path / "train_config.yaml"))
        changed = config_diff(saved, config_dict)
        self._print(f"resumed from {path} at step {step}"
                    + (f" (config changed: {'; '.join(changed)})" if changed else ""))
        return latest

    def resume_advice(self) -> str:
        """How to continue this run after it stopped: the exact ``hydra.run.dir`` (a default,
        timestamped run dir is another folder each time) and ``trainer.resume`` that resume
        from its newest checkpoint (not the folder it was started from, whose resume would
        drop the metrics logged since)."""
        last, resume = self.last_ckpt, self.cfg.trainer.resume
        if last is None:
            return "no checkpoint was written; re-running the same command starts over"
        shown = shell_quote(last)  # a path with a space or a newline, pasted as one argument
        # a -m sweep's job: the sweep's folder (twell-train sets rerun_arg), else the run dir
        here = self.rerun_arg or override_arg("hydra.run.dir", self.run_dir)
        if Path(last).resolve().parent.parent != self.run_dir.resolve() or resume == "auto":
            return f"re-run the same command with {here} to resume from {shown}"
        return (f"re-run the same command with {here} trainer.resume=auto (instead of "
                f"trainer.resume={shell_quote(resume)}) to resume from {shown}")
