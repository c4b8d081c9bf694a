"""The per-budget stages of one size: our trainer's rows (``ell``, ``dense``, ``auto``), the
plain-transformers row (``hf``) and the ``default`` row.

Per budget, in the order given, each stage builds its model (our four FFN paths share one
trainer, ``ffn.impl=auto``, whose plan is pinned per path), runs the search the first
time (every budget at once, the probes shared), and times the chosen configurations with the
card emulated (:func:`studies.bench.search.emulated`). So one budget's rows are complete before
the next budget starts, and a deadline cuts whole budgets last.

Timing (:func:`studies.bench.steps.time_steps`): the chosen configuration at accumulation 1 (one
micro-batch per optimizer step), ``warmup`` untimed steps first (the dense-backup capacities
are measured again after every change, and ``auto`` settles), then ``steps`` steps: CUDA events
around each (the median) and the host clock around all (the wall-clock mean; redone steps
included). Peak: ``max_memory_allocated`` over the timed steps. A configuration chosen for an
earlier budget is not timed again. The steps draw held-out sequences (the validation split).

The default row is the trainer of ``experiment=paper_*`` as it builds itself under the
emulated card: its memory planner probes and chooses at the experiment's global batch; the
choice is then timed at accumulation 1 like every row (the optimizer step's share is then the
same in all rows; ``notes`` gives the accumulation the user's run has), on the batches of the
searched rows of the same micro-batch, right after our rows (its gap to ``auto``'s row is then
the trainers', not the batches' or the run order's), with the user's ``--config`` as ours.
"""

from __future__ import annotations

import dataclasses
import traceback

import torch

from studies.bench.capacity_trace import trace_rows
from studies.bench.core import (
    SizeRun,
    add_row,
    measure_forward,
    new_row,
    reuse,
    search_ffn,
    skipped_row,
    timed_fields,
)
from studies.bench.recipe import (
    BASELINE_PATHS,
    HF_RECOMPUTE,
    OUR_RECOMPUTE,
    PATH_FFNS,
    PATH_OF_FFN,
    SPARSE_PATHS,
    default_overrides,
    ours_overrides,
)
from studies.bench.search import Budget, Choice, emulated, faster
from studies.bench.steps import (
    HFStep,
    batches_from,
    build_hf,
    build_ours,
    free_memory,
    is_oom,
    log,
    time_steps,
)
from train.memory import (
    Candidate,
    Plan,
    ProbeRunner,
    choose_initial_paths,
    pending_optimizer_gb,
    plan_memory,
    release_failed_step,
)

OUR_PATHS = ("ell", "dense", "auto")  # the timing order inside our trainer's stage


def bench_budgets(run: SizeRun) -> None:
    """The forward (:func:`forward_stage`), then per budget our rows, ``default``'s and the
    baselines' (module docstring). A stage that fails leaves rows naming the error for its
    paths and the next stage runs."""
    forward_stage(run)
    for i, b in enumerate(run.s.budgets):
        t0 = run.clock.elapsed()
        first = i == 0
        # default right after ours: its gap to auto's row is then not the card's or the
        # allocator's state after the baselines' stages
        stages = [(OUR_PATHS, lambda b=b, first=first: ours_rows(run, b, first)),
                  (("default",), lambda b=b: default_row(run, b))]
        stages += [((p,), lambda b=b, first=first, p=p: baseline_rows(run, b, first, p))
                   for p in BASELINE_PATHS]
        for paths, stage in stages:
            paths = [p for p in paths if p in run.s.paths]
            if paths:
                _guarded(run, stage, paths, b)
            free_memory(run.device)  # the stage's models (reference cycles) before the next
        run.clock.mark(f"{b.label} GB card", t0)


def forward_stage(run: SizeRun) -> None:
    """The forward of every inference impl (:func:`studies.bench.core.measure_forward`), then,
    with ``profile_forward``, its profile
    (:func:`studies.bench.forward_profile.profile_forward`), written into ``run.s.out`` as
    ``forward_profile_<size>.md`` / ``.csv``; on the CPU the profile is skipped with one log
    line (it times CUDA kernels) and nothing is written."""
    from studies.bench.forward_profile import profile_forward, write_forward_profile

    measure_forward(run)
    if not run.s.profile_forward:
        return
    if run.device.type != "cuda":
        log(f"{run.size}: --profile-forward skipped: torch.profiler's CUDA kernel times need "
            "a GPU")
        return
    profiles = profile_forward(run)
    if profiles:
        cfg = run.bm.model_cfg
        print(write_forward_profile(run.s.out, run.size, profiles, fwd_batch=run.s.fwd_batch,
                                    seq_len=run.seq_len, l0=run.checks["l0"],
                                    layers=cfg.num_layers), flush=True)


def _guarded(run: SizeRun, stage, paths: list[str], b: Budget) -> None:
    try:
        stage()
    except Exception as e:  # noqa: BLE001  (one stage's failure keeps the others' rows)
        traceback.print_exc()
        why = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        log(f"{run.size} {b.label} GB {', '.join(paths)}: {why}")
        run.meta.setdefault("errors", []).append(f"{b.label} GB {', '.join(paths)}: {why}")
        have = {r["path"] for r in run.rows if r["budget_gb"] == b.card_gb}
        for p in paths:
            if p not in have:
                add_row(run, skipped_row(run, p, b, why, path_choice(run, p, b)
                                         if p != "default" else None))


def path_choice(run: SizeRun, path: str, b: Budget) -> Choice | None:
    """The searched configuration of ``path`` at ``b`` (dense: the faster of its two)."""
    got = [run.choices.get((f, b)) for f in PATH_FFNS[path]]
    best = None
    for c in got:
        best = faster(best, c)
    return best


def timing_est(run: SizeRun, choice: Choice) -> float:
    if run.device.type != "cuda":
        return 0.0
    step_s = run.est_step_s(choice.micro_batch, choice.probe_tok_per_ms)
    return (run.s.warmup + run.s.steps) * step_s + 3.0


def _plan_for(choice: Choice, b: Budget, why: str = "benchmark") -> Plan:
    """A one-micro-batch-per-step :class:`train.memory.Plan` of ``choice``."""
    return Plan(choice.micro_batch, choice.recompute, 1, choice.step_peak_gb,
                choice.probe_tok_per_ms, b.planner_gb, why)


def _close(tr, device) -> None:
    tr.close()
    tr.acc.free_memory()
    free_memory(device)


# ---------------------------------------------------------------- our trainer


def build_our_trainer(run: SizeRun, extra: list[str] = ()):
    """Our trainer (:func:`studies.bench.recipe.ours_overrides`, then ``extra`` overrides) on the
    bench model's weights."""
    from train.config import compose
    from train.trainer import Trainer

    cfg = compose(ours_overrides(run.size, run.s.search_batch, [*run.s.config, *extra],
                                 run.smoke_tokens))
    model = build_ours(cfg.model, run.bm.weights, run.device, ffn=cfg.ffn)
    run.builds += 1
    return Trainer(cfg, run.work / f"{run.size}_ours{run.builds}", datamodule=run.data,
                   model=model)


def use_ffn(tr, ffn: str, plan_state: dict | None) -> None:
    """Make our trainer train on ``ffn``: every layer pinned to ``torch`` / ``dense`` / ``ell``;
    ``auto``: unpinned, from the trained plan state (all layers on ``dense`` without one, as a
    fresh ``auto``). Capacities are measured again."""
    if ffn == "auto":
        tr.plan.pin("dense")
        tr.plan.pin(None)
        if plan_state is not None:
            tr.plan.load_state_dict(plan_state)
    else:
        tr.plan.pin(ffn)
    tr.plan.reset_capacities()


def min_probe_tokens(tr) -> int:
    """The fused loss's chunk rows when the trainer uses it (the planner's slope rule)."""
    return tr.cfg.trainer.ce_chunk_rows if tr.fused_loss is not None else 0


def loss_check(run: SizeRun, tr, ffn: str) -> bool:
    """The training forward's loss on the check blocks (every backup measured, no statistics
    kept) within the tolerance of plain transformers' bf16 loss, and the logits check passed."""
    ids = run.pool_NT[:2].to(run.device)
    with tr.plan.profiling():
        tr.plan.set_collect_stats(False)
        loss = tr.model(input_ids=ids, labels=ids).loss.item()
    c = run.checks
    run.meta.setdefault("loss_checks", {})[ffn] = round(loss, 5)
    return bool(abs(loss - c["hf_loss_bf16"]) <= c["loss_tol"] and c["logits_rel_err"] < 1e-4)


def time_trainer(run: SizeRun, tr, plan: Plan, seed: int,
                 trace: dict | None = None) -> tuple:
    """``warmup`` + ``steps`` training steps of ``tr`` at ``plan`` (capacities measured again
    first); (window, the timed steps' metrics). ``trace``: the row's ``path`` and ``budget_gb``:
    the plan's capacity trace of these steps goes into ``run.capacity_trace`` (also what a
    failed row recorded before it failed)."""
    tr.memory.apply(plan)
    tr.plan.reset_capacities()
    tr.model.train()
    batches = batches_from(run.pool_NT, plan.micro_batch, seed)
    records = tr.plan.capacity_trace = [] if trace is not None else None
    timed_from = None
    try:
        warm = tr.new_interval()
        for _ in range(run.s.warmup):
            tr.train_step(batches, warm)
        interval = tr.new_interval()
        timed_from = len(records) if records is not None else None
        window = time_steps(lambda: tr.train_step(batches, interval), 0, run.s.steps,
                            run.device)
    finally:
        tr.plan.capacity_trace = None
        if records is not None:
            run.capacity_trace += trace_rows(records, timed_from, size=run.size,
                                             rule=tr.plan.options.capacity_rule, **trace)
    return window, tr.log_metrics(interval)


def _traced(path: str, ffn: str, b: Budget) -> dict | None:
    """``time_trainer``'s ``trace`` for a row of ``path`` whose FFN is ``ffn``: the sparse
    ones' (:data:`studies.bench.recipe.SPARSE_PATHS`: capacities to overflow), else None."""
    return {"path": path, "budget_gb": b.card_gb} if ffn in SPARSE_PATHS else None


def forward_reruns(m: dict) -> str:
    """``; forward reruns N`` for the notes of a row whose timed steps ran some micro-batch's
    forward again (``ffn.host_sync=micro_batch``; ``redos`` counts whole steps), else
    ``""``."""
    n = m.get("ffn_forward_redos", 0)
    return f"; forward reruns {n}" if n else ""


def time_our_path(run: SizeRun, tr, path: str, b: Budget) -> None:
    """One of our rows: the searched choice of ``path`` at ``b``, timed (or why not)."""
    choice = path_choice(run, path, b)
    if choice is None or not choice.fits:
        why = "not searched (deadline)" if choice is None else choice.why
        return add_row(run, skipped_row(run, path, b, why, choice))
    use_ffn(tr, choice.ffn, run.bm.plan_state)
    if choice.ffn == "auto":  # from the paths its search probed (_search_ours), not the state's
        choose_initial_paths(tr, ProbeRunner(tr).ids_BT, force=True)
    ok = loss_check(run, tr, choice.ffn)
    window = m = None
    try:
        window, m = time_trainer(run, tr, _plan_for(choice, b), seed=choice.micro_batch,
                                 trace=_traced(path, choice.ffn, b))
    except Exception as e:
        if not is_oom(e):
            raise
    if window is None:  # out of memory: released once the exception is gone (not in except)
        release_failed_step(run.device, optimizer=tr.optimizer, mlps=tr.mlps)
        return add_row(run, skipped_row(run, path, b, "out of memory while timing", choice,
                                        check_ok=ok))
    notes = f"timed L0 {m['l0_mean']:.1f}" + forward_reruns(m)
    if choice.ffn == "auto":
        paths = tr.plan.paths
        notes += f"; ell layers {paths.count('ell')}/{len(paths)}"
    row = new_row(run, path, b, ffn=choice.ffn, micro_batch=choice.micro_batch,
                  recompute=choice.recompute, predicted_peak_gb=choice.step_peak_gb,
                  probe_tok_per_ms=choice.probe_tok_per_ms, redos=m.get("ffn_backup_redos", 0),
                  check_ok=ok, notes=notes, **timed_fields(run, window, choice.micro_batch,
                                                           choice))
    run.timed[(path, *choice.key)] = row
    add_row(run, row)


def ours_rows(run: SizeRun, b: Budget, first: bool) -> None:
    """Our rows at ``b``: build the trainer (searching every budget the first time), time
    ``ell``, ``dense`` and ``auto``; a configuration timed for an earlier budget is reused."""
    paths = [p for p in OUR_PATHS if p in run.s.paths]
    todo = []
    for p in paths:
        c = path_choice(run, p, b)
        if not first and (c is None or not c.fits):
            add_row(run, skipped_row(run, p, b, "not searched (deadline)" if c is None
                                     else c.why, c))
            continue
        again = None if first else reuse(run, p, b, c)
        if again is not None:
            add_row(run, again)
        else:
            todo.append(p)
    if not todo:
        return
    scale = run.n_params / 1.5e9 if run.device.type == "cuda" else 0.0
    search_s = 12.0 * scale * len({f for p in paths for f in PATH_FFNS[p]}) if first else 0.0
    if not run.clock.fits(run.est_build_s() + search_s,
                          f"{run.size} our trainer at {b.label} GB"):
        for p in todo:
            add_row(run, skipped_row(run, p, b, "skipped (deadline)", path_choice(run, p, b)))
        return
    tr = build_our_trainer(run)
    try:
        if first:
            _search_ours(run, tr, paths)
        with emulated(b, run.device):
            for p in todo:
                c = path_choice(run, p, b)
                if c is not None and c.fits and not run.clock.fits(
                        timing_est(run, c), f"{run.size} {p} at {b.label} GB"):
                    add_row(run, skipped_row(run, p, b, "skipped (deadline)", c))
                    continue
                time_our_path(run, tr, p, b)
    finally:
        _close(tr, run.device)


def _search_ours(run: SizeRun, tr, paths: list[str]) -> None:
    pending = pending_optimizer_gb(tr.optimizer)  # before any timed step: every search alike
    runner = ProbeRunner(tr, timed_steps=run.s.probe_steps)
    for ffn in dict.fromkeys(f for p in paths for f in PATH_FFNS[p]):
        use_ffn(tr, ffn, run.bm.plan_state)
        if ffn == "auto":  # probe the paths auto takes on this model, as a run planning does
            line = choose_initial_paths(tr, runner.ids_BT, force=True)
            if line is not None:
                log(f"{run.size} search auto: {line}")
        search_ffn(run, ffn, runner, pending, OUR_RECOMPUTE, min_probe_tokens(tr))


# ---------------------------------------------------------------- plain transformers


def baseline_rows(run: SizeRun, b: Budget, first: bool, path: str = "hf") -> None:
    """The row of a stock-transformers baseline (``hf``, ``liger`` or ``compile``;
    :data:`studies.bench.recipe.BASELINE_PATHS`) at ``b`` (the search of every budget the first
    time)."""
    c = run.choices.get((path, b))
    if not first:
        again = None if c is None or not c.fits else reuse(run, path, b, c)
        if again is not None or c is None or not c.fits:
            return add_row(run, again or skipped_row(
                run, path, b, "not searched (deadline)" if c is None else c.why, c))
    scale = run.n_params / 1.5e9 if run.device.type == "cuda" else 0.0
    if not run.clock.fits(run.est_build_s() + (10.0 * scale if first else 0.0),
                          f"{run.size} {path} at {b.label} GB"):
        return add_row(run, skipped_row(run, path, b, "skipped (deadline)", c))
    step = HFStep(build_hf(run.bm.model_cfg, run.bm.weights, run.device, variant=path),
                  run.cfg1.optim, run.bf16)
    try:
        if first:
            probe = ProbeRunner(step, run.pool_NT, timed_steps=run.s.probe_steps)
            search_ffn(run, path, probe, pending_optimizer_gb(step.optimizer), HF_RECOMPUTE,
                       run.cfg1.trainer.ce_chunk_rows if path == "liger" else 0)
            c = run.choices[(path, b)]
        if not c.fits:
            return add_row(run, skipped_row(run, path, b, c.why, c))
        if not run.clock.fits(timing_est(run, c), f"{run.size} {path} at {b.label} GB"):
            return add_row(run, skipped_row(run, path, b, "skipped (deadline)", c))
        with emulated(b, run.device):
            row = time_baseline(run, step, c, b, path)
        run.timed[(path, *c.key)] = row
        add_row(run, row)
    finally:
        step = None
        free_memory(run.device)


def time_baseline(run: SizeRun, step: HFStep, c: Choice, b: Budget, path: str = "hf") -> dict:
    """Time ``step`` (a stock-transformers baseline of ``path``) at choice ``c``: ``warmup`` then
    ``steps`` steps (:func:`studies.bench.steps.time_steps`); its ``best_configs.csv`` row, or a
    row naming the out-of-memory error (other errors propagate)."""
    step.set_recompute(c.recompute)
    batches = batches_from(run.pool_NT, c.micro_batch, seed=c.micro_batch)
    window = None
    try:
        window = time_steps(lambda: step(batches), run.s.warmup, run.s.steps, run.device)
    except Exception as e:
        if not is_oom(e):
            raise
    if window is None:  # out of memory: released once the exception is gone (not in except)
        release_failed_step(run.device, optimizer=step.optimizer)
        return skipped_row(run, path, b, "out of memory while timing", c)
    return new_row(run, path, b, ffn=path, micro_batch=c.micro_batch, recompute=c.recompute,
                   predicted_peak_gb=c.step_peak_gb, probe_tok_per_ms=c.probe_tok_per_ms,
                   redos=0, check_ok=run.checks["logits_rel_err"] < 1e-4,
                   **timed_fields(run, window, c.micro_batch, c))


# ---------------------------------------------------------------- the default run


def baseline_costs_s(run: SizeRun, b: Budget) -> list[float]:
    """Seconds each stock-transformers baseline of ``run.s.paths`` still needs at ``b`` (build,
    the first budget's search, timing), for those left to time (none for one an earlier budget
    timed in the same configuration, one that does not fit, or on the CPU).
    :func:`default_row`, which runs before them, skips itself when it and these would not all
    fit the deadline but a baseline alone would: every ratio is taken against the best dense
    row, so a deadline drops the ``default`` row (a check of the planner) before a baseline."""
    if run.device.type != "cuda":
        return []
    scale = run.n_params / 1.5e9
    first = b == run.s.budgets[0]
    costs = []
    for p in BASELINE_PATHS:
        if p not in run.s.paths:
            continue
        c = run.choices.get((p, b))
        if not first and (c is None or not c.fits or (p, *c.key) in run.timed):
            continue  # not searched, does not fit, or reused: nothing to time
        proxy = c if c is not None and c.fits else path_choice(run, "dense", b)
        costs.append(run.est_build_s() + (30.0 * scale if first else 0.0) + (
            timing_est(run, proxy) if proxy is not None and proxy.fits else 60.0 * scale))
    return costs


def default_row(run: SizeRun, b: Budget) -> None:
    """The ``default`` row at ``b``: the experiment's trainer built under the emulated card (its
    planner probes and chooses), its choice timed; the same choice as an earlier budget's is
    not timed again. Also marks ``is_default`` on the searched row its choice equals."""
    d = run.meta["default"]
    scale = run.n_params / 1.5e9 if run.device.type == "cuda" else 0.0
    proxy = path_choice(run, "dense", b)
    est = run.est_build_s() + 30.0 * scale + (timing_est(run, proxy) if proxy and proxy.fits
                                              else 60.0 * scale)
    costs = baseline_costs_s(run, b)
    room = run.clock.left() - run.clock.reserve_s
    if est + sum(costs) > room and costs and min(costs) <= room:
        run.clock.fits(est + sum(costs), f"{run.size} default and the baselines at {b.label} GB "
                       "(the baselines first)")  # False: logs and records the skip
        return add_row(run, skipped_row(run, "default", b,
                                        "skipped (deadline: the dense baselines first)",
                                        ffn=d["ffn"]))
    if not run.clock.fits(est, f"{run.size} default at {b.label} GB"):
        return add_row(run, skipped_row(run, "default", b, "skipped (deadline)", ffn=d["ffn"]))
    with emulated(b, run.device):
        tr = build_default_trainer(run, b)
        try:
            plan = _default_plan(run, tr, b)
            key = (d["ffn"], plan.micro_batch, plan.recompute)
            row = run.default_rows.get(key)
            if row is not None:
                row = {**row, "budget_gb": b.card_gb, "predicted_peak_gb": plan.peak_gb,
                       "notes": f"{plan_note(run, tr, plan)}; the {row['budget_gb']:g} GB card's "
                                "choice: timed once"}
            else:
                row = time_default(run, tr, plan, b)
                run.default_rows[key] = row
        finally:
            _close(tr, run.device)
    add_row(run, row)
    mark_default(run, row, b)


def build_default_trainer(run: SizeRun, b: Budget, extra: list[str] = ()):
    """The ``default`` row's trainer at ``b`` (:func:`studies.bench.recipe.default_overrides`,
    then ``extra`` overrides: the profile's) on the bench model's weights; its planner runs as
    it is built."""
    from train.config import compose
    from train.trainer import Trainer

    fake = run.s.fake_memory is not None or not hasattr(torch.cuda,
                                                        "get_per_process_memory_fraction")
    over = default_overrides(run.size, run.smoke_tokens, b.planner_gb if fake else None)
    cfg = compose([*over, *run.s.config, *extra])  # the user's --config as ours get it
    model = build_ours(cfg.model, run.bm.weights, run.device, ffn=cfg.ffn)
    run.builds += 1
    return Trainer(cfg, run.work / f"{run.size}_default{run.builds}", datamodule=run.data,
                   model=model)


def _default_plan(run: SizeRun, tr, b: Budget) -> Plan:
    """The plan the trainer made for itself (without CUDA: the planner again, on the fake
    memory model's probes; the trainer's own plan, printed as it was built, measured nothing,
    and a line says that it is replaced)."""
    if run.s.fake_memory is None:
        return tr.memory.plan
    log(f"{run.size} {b.label} GB default: the trainer's plan above measured nothing (no CUDA); "
        "planning again on the fake memory model")
    probe = run.s.fake_memory.probe(run.meta["default"]["ffn"], ProbeRunner(tr, timed_steps=1))
    return plan_memory(tr, probe).plan


def plan_note(run: SizeRun, tr, plan: Plan) -> str:
    """The default row's note: the plan it ran (``planner on the fake memory model`` in the
    smoke run, whose trainer's own plan is replaced: :func:`_default_plan`)."""
    who = "planner" if run.s.fake_memory is None else "planner on the fake memory model"
    return (f"{who}: micro {plan.micro_batch} x {plan.recompute}, accumulation {plan.accum} "
            f"at global batch {tr.cfg.trainer.global_batch} ({plan.why})")


def time_default(run: SizeRun, tr, plan: Plan, b: Budget) -> dict:
    d = run.meta["default"]
    choice = Choice(d["ffn"], b, plan.micro_batch, plan.recompute, plan.peak_gb, plan.tok_per_ms,
                    plan.why)
    if run.s.fake_memory is not None:
        choice.step_peak_gb = run.s.fake_memory.peak_gb(
            d["ffn"], Candidate(plan.micro_batch, plan.recompute)) + pending_optimizer_gb(
            tr.optimizer)
    ok = loss_check(run, tr, "default")
    base = {"ffn": d["ffn"], "micro_batch": plan.micro_batch, "recompute": plan.recompute,
            "predicted_peak_gb": plan.peak_gb, "probe_tok_per_ms": plan.tok_per_ms,
            "check_ok": ok}
    window = m = None
    try:
        # the batches the searched row of the same micro-batch trains on (time_our_path)
        window, m = time_trainer(run, tr, dataclasses.replace(plan, accum=1),
                                 seed=plan.micro_batch, trace=_traced("default", d["ffn"], b))
    except Exception as e:
        if not is_oom(e):
            raise
    if window is None:  # out of memory: released once the exception is gone (not in except)
        release_failed_step(run.device, optimizer=tr.optimizer, mlps=tr.mlps)
        return new_row(run, "default", b, notes=f"{plan_note(run, tr, plan)}; out of memory while "
                                                "timing", **base)
    return new_row(run, "default", b, redos=m.get("ffn_backup_redos", 0),
                   notes=f"{plan_note(run, tr, plan)}; timed L0 {m['l0_mean']:.1f}"
                         + forward_reruns(m), **base,
                   **timed_fields(run, window, plan.micro_batch, choice))


def mark_default(run: SizeRun, row: dict, b: Budget) -> None:
    """``is_default`` on the searched row of the default's path whose ffn, micro-batch and
    recompute are the default's choice at ``b``."""
    for r in run.rows:
        if (r["budget_gb"] == b.card_gb and r["path"] == PATH_OF_FFN.get(row.get("ffn"))
                and (r.get("ffn"), r.get("micro_batch"), r.get("recompute"))
                == (row.get("ffn"), row.get("micro_batch"), row.get("recompute"))):
            r["is_default"] = True
    log(f"{run.size} {b.label} GB default: {row.get('notes')}")


__all__ = ["OUR_PATHS", "baseline_costs_s", "baseline_rows", "bench_budgets",
           "build_default_trainer", "build_our_trainer", "default_row", "forward_stage", "loss_check", "ours_rows",
           "path_choice",
           "time_trainer",
           "use_ffn"]
