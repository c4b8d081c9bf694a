"""Does training through the TwELL kernels (``ffn.impl=twell``) follow the dense PyTorch
path (``torch``)? Three training runs from the same seed on the same data, one verdict
(``scripts/compare_ffn_paths.py`` is its command line).

Requirement checked: "a small model trained 300 steps on the real corpus with ffn_impl=twell and
with ffn_impl=torch from the same seed: loss curves agree within bf16 noise (report the max
difference), final L0 within 5 %, dead-neuron counts equal within 1 %."

The runs (:func:`plan`; every user override goes to all three, in the same position):

    A  ffn.impl=torch                              the reference
    B  ffn.impl=torch, trainer.micro_batch halved  the same math with twice the gradient
                                                         accumulation: another reduction order
                                                         and bf16 rounding -- the noise baseline
    C  ffn.impl=twell                              the sparse training kernels (``ell``)

Criteria (:func:`compare_runs`; the numbers come from the runs' ``metrics.jsonl``):

* loss within bf16 noise: ``max_t |loss_A(t) - loss_C(t)| <= 2 x max_t |loss_A(t) - loss_B(t)|``
  over every logged step t (loss = CE + l1_coeff x L1, the logged training loss of the step).
* final L0 within 5 %: ``|L0_C - L0_A| / L0_A <= 0.05``, L0 = the mean over the last 50 logged
  steps of ``l0_mean`` (mean over layers of the active FFN units per token). One step's L0 is a
  one-batch estimate: on one H200 (small_l4, L1 3e-4, 300 steps) two torch runs from the same
  seed (A and B) differed by up to 10.5 % at single steps of the last 100 but by 2.0 % in their
  last-50-step means.
* dead neurons within 1 %: ``|dead_C - dead_A| <= 0.01 x num_layers x intermediate_size``,
  dead = units inactive on every token of the last closed window (the last step's
  ``dead_layers`` fractions x intermediate_size, summed over layers).

    from studies.ffn_compare import check_plan, compare_runs, load_run_data, plan
    cfg, specs, accum = check_plan(user_overrides, steps=300)   # ConfigError before any run
    ... run each spec's ``python -m train`` (studies.jobs) ...
    result = compare_runs(*(load_run_data(s, runs_dir, accum[s.name]) for s in specs))
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

NOISE_FACTOR = 2.0  # loss: max|A-C| <= NOISE_FACTOR x max|A-B|
L0_REL_TOL = 0.05  # final L0: |C - A| / A <= 5 %
DEAD_UNITS_TOL = 0.01  # dead neurons: |C - A| <= 1 % of num_layers x intermediate_size
LAST_STEPS = 50  # the "last steps" window of the curve differences

# Keys set for every run (a user override of them is refused; trainer.max_steps is taken as
# the step count when it agrees, :func:`split_steps`).
CONTROLLED = ("ffn.impl", "trainer.log_every", "trainer.resume", "hydra.run.dir",
              "hydra.sweep.dir")
# set before the user's overrides (which may change them): no evaluation, no wandb, quiet, and
# validation at the end only
DEFAULTS = ["eval=disabled", "logging.wandb_mode=disabled", "trainer.progress=false",
            "trainer.val_every=0"]
# the CPU smoke test: a 2-layer model of width 32 (FFN 64) on a generated token file (vocab 64)
SMOKE_OVERRIDES = [
    "data=tokens", "data.vocab_size=64", "model.name=smoke", "model.vocab_size=64", "model.hidden_size=32",
    "model.intermediate_size=64", "model.num_heads=2", "model.num_layers=2", "model.seq_len=32",
    "trainer=cpu", "trainer.cpu=true", "trainer.num_threads=1", "trainer.global_batch=8",
    "trainer.micro_batch=8", "trainer.val_sequences=8", "trainer.save_every=0",
    "trainer.keep_last=1", "optim.warmup_steps=2", "sparsity.l1_coeff=0.05",
]


# ---------------------------------------------------------------- comparison (pure functions)


@dataclass(frozen=True)
class CurveDiff:
    """Largest per-step |a - b| of two curves, over all steps and over the last ``last_n`` steps.

    Attributes:
        max_abs: max over the steps of |a(t) - b(t)| (loss units, nats); NaN if a value is NaN.
        at_step: the step where it occurs.
        steps: number of steps compared.
        last_n: the window of the ``last_*`` fields (steps > last step - last_n).
        last_max_abs, last_at_step: the same over that window.
    """

    max_abs: float
    at_step: int
    steps: int
    last_n: int
    last_max_abs: float
    last_at_step: int


@dataclass(frozen=True)
class Criterion:
    """One PASS/FAIL check: ``passed = value <= limit`` (NaN never passes)."""

    name: str
    passed: bool
    value: float
    limit: float
    detail: str

    @property
    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"


@dataclass
class RunData:
    """What the comparison needs of one run (no I/O): its train rows as the trainer logs them.

    Attributes:
        name: label (A_torch, B_torch_half_micro, C_twell).
        ffn_impl, micro_batch, accum: the run's FFN path, micro-batch and accumulation steps.
        num_layers, intermediate_size: L and H of the model (L x H hidden units in all).
        rows: the ``kind=train`` lines of metrics.jsonl, one per logged step, in order.
        summary: summary.json (optional: val loss, tokens/s).
        wall_s: wall-clock seconds of the run's process (optional).
    """

    name: str
    ffn_impl: str
    micro_batch: int
    accum: int
    num_layers: int
    intermediate_size: int
    rows: list[dict]
    summary: dict = field(default_factory=dict)
    wall_s: float | None = None


def curve(rows: list[dict], key: str = "loss") -> dict[int, float]:
    """``{step: rows[i][key]}`` of the train rows; ValueError on a repeated step."""
    out: dict[int, float] = {}
    for r in rows:
        if r["step"] in out:
            raise ValueError(f"step {r['step']} is logged twice")
        out[int(r["step"])] = float(r[key])
    return out


def curve_diff(a: dict[int, float], b: dict[int, float], last_n: int = LAST_STEPS) -> CurveDiff:
    """Max |a(t) - b(t)| over all steps and over the last ``last_n`` of them.

    Raises:
        ValueError: the curves are empty or do not have the same steps (the runs were not
            logged at the same steps: compare only complete runs with log_every=1).
    """
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        raise ValueError(f"the curves have different steps (e.g. {only[:5]}); both runs must log "
                         "the same steps")
    if not a:
        raise ValueError("empty curves: no logged steps")
    steps = sorted(a)

    def worst(sel: list[int]) -> tuple[float, int]:
        d = [(abs(a[s] - b[s]), s) for s in sel]
        nan = [s for v, s in d if math.isnan(v)]
        return (math.nan, nan[0]) if nan else max(d)

    mx, at = worst(steps)
    window = [s for s in steps if s > steps[-1] - last_n]
    lmx, lat = worst(window)
    return CurveDiff(mx, at, len(steps), last_n, lmx, lat)


def dead_units(row: dict, intermediate_size: int) -> int | None:
    """Dead FFN units of a logged step: sum over layers of round(dead fraction x H) (None before
    the first dead-neuron window closed)."""
    layers = row.get("dead_layers")
    if layers is None:
        return None
    return sum(round(f * intermediate_size) for f in layers)


def rel_diff(ref: float, other: float) -> float:
    """|other - ref| / |ref| (0 if both are 0, inf if only ref is)."""
    if ref == 0:
        return 0.0 if other == 0 else math.inf
    return abs(other - ref) / abs(ref)


def _le(value: float, limit: float) -> bool:
    return not (math.isnan(value) or math.isnan(limit)) and value <= limit


def loss_criterion(noise: CurveDiff, diff: CurveDiff, factor: float = NOISE_FACTOR) -> Criterion:
    """Loss curves agree within bf16 noise: ``max|A-C| <= factor x max|A-B|``."""
    limit = factor * noise.max_abs
    return Criterion(
        "loss within bf16 noise", _le(diff.max_abs, limit), diff.max_abs, limit,
        f"max|A-C| {diff.max_abs:.3g} (step {diff.at_step}) <= {factor:g} x max|A-B| "
        f"{noise.max_abs:.3g} (step {noise.at_step}) = {limit:.3g}")


def final_l0(rows: list[dict], last_n: int = LAST_STEPS) -> float:
    """Mean of ``l0_mean`` over the last ``last_n`` train rows (all of them if fewer)."""
    vals = [r["l0_mean"] for r in rows[-last_n:]]
    return sum(vals) / len(vals)


def l0_criterion(l0_a: float, l0_c: float, tol: float = L0_REL_TOL) -> Criterion:
    """Final L0 within ``tol``: ``|L0_C - L0_A| / L0_A <= tol``."""
    r = rel_diff(l0_a, l0_c)
    return Criterion(f"final L0 within {100 * tol:g} %", _le(r, tol), r, tol,
                     f"A {l0_a:.4g}, C {l0_c:.4g} active units per token: "
                     f"|C-A|/A {100 * r:.3g} % <= {100 * tol:g} %")


def dead_criterion(dead_a: int | None, dead_c: int | None, units: int,
                   tol: float = DEAD_UNITS_TOL) -> Criterion:
    """Dead-neuron counts within ``tol`` of all hidden units: ``|C - A| / units <= tol``."""
    if dead_a is None or dead_c is None:
        return Criterion(f"dead neurons within {100 * tol:g} % of units", False, math.nan, tol,
                         "no dead-neuron window closed in a run (dead_layers missing)")
    frac = abs(dead_c - dead_a) / units
    return Criterion(f"dead neurons within {100 * tol:g} % of units", _le(frac, tol), frac, tol,
                     f"A {dead_a}, C {dead_c} of {units} units: |C-A| {abs(dead_c - dead_a)} = "
                     f"{100 * frac:.3g} % <= {100 * tol:g} %")


def compare_runs(a: RunData, b: RunData, c: RunData, *, last_n: int = LAST_STEPS) -> dict:
    """The whole comparison of A (torch), B (torch, half micro-batch) and C (twell).

    Returns a JSON-ready dict: ``loss`` (``noise_AB`` and ``twell_AC`` as :class:`CurveDiff`
    dicts, ``ratio`` = max|A-C| / max|A-B|), ``l0`` (final L0 of each run: mean of the last
    ``last_n`` steps; ``rel_diff_AC``, ``rel_diff_AB``, and ``l0_last`` for the last step alone),
    ``dead`` (dead units of each run, ``units`` = L x H, ``diff_frac_AC``), ``criteria`` (name,
    passed, value, limit, detail, line) and ``passed`` (all criteria).

    Raises:
        ValueError: the runs have different model shapes or logged steps, or no rows.
    """
    shapes = {(r.num_layers, r.intermediate_size) for r in (a, b, c)}
    if len(shapes) != 1:
        raise ValueError(f"the runs have different (num_layers, intermediate_size): {shapes}")
    for r in (a, b, c):
        if not r.rows:
            raise ValueError(f"run {r.name} logged no train steps")
    units = a.num_layers * a.intermediate_size
    loss = {r.name: curve(r.rows) for r in (a, b, c)}
    noise = curve_diff(loss[a.name], loss[b.name], last_n)
    diff = curve_diff(loss[a.name], loss[c.name], last_n)
    if noise.max_abs > 0:
        ratio = diff.max_abs / noise.max_abs
    else:
        ratio = 0.0 if diff.max_abs == 0 else math.inf
    l0 = {k: final_l0(r.rows, last_n) for k, r in zip("ABC", (a, b, c))}
    l0_last = {k: r.rows[-1]["l0_mean"] for k, r in zip("ABC", (a, b, c))}
    dead = {k: dead_units(r.rows[-1], r.intermediate_size) for k, r in zip("ABC", (a, b, c))}
    criteria = [loss_criterion(noise, diff), l0_criterion(l0["A"], l0["C"]),
                dead_criterion(dead["A"], dead["C"], units)]
    return {
        "loss": {"noise_AB": asdict(noise), "twell_AC": asdict(diff), "ratio": ratio},
        "l0": {**l0, "rel_diff_AC": rel_diff(l0["A"], l0["C"]),
               "rel_diff_AB": rel_diff(l0["A"], l0["B"]), "window": last_n,
               "l0_last": {**l0_last, "rel_diff_AC": rel_diff(l0_last["A"], l0_last["C"])}},
        "dead": {**dead, "units": units, "num_layers": a.num_layers,
                 "intermediate_size": a.intermediate_size,
                 "diff_frac_AC": (None if dead["A"] is None or dead["C"] is None
                                  else abs(dead["C"] - dead["A"]) / units)},
        "criteria": [{**asdict(k), "line": k.line} for k in criteria],
        "passed": all(k.passed for k in criteria),
    }


def _fmt(v, spec: str = ".4g") -> str:
    return "n/a" if v is None else format(v, spec)


def summary_rows(runs: list[RunData]) -> list[dict]:
    """One table row per run (final loss, L0, dead units, val loss, tokens/s, wall s).

    val loss is the trainer's end-of-run validation on ``trainer.val_sequences`` held-out
    sequences (the same ones for A, B and C): information, not a criterion.
    """
    rows = []
    for r in runs:
        last = r.rows[-1] if r.rows else {}
        rows.append({
            "run": r.name, "ffn_impl": r.ffn_impl, "precision": r.summary.get("precision", "n/a"),
            "micro": r.micro_batch, "accum": r.accum,
            "steps": last.get("step"), "final loss": _fmt(last.get("loss")),
            "final L0": _fmt(last.get("l0_mean")),
            "dead units": _fmt(dead_units(last, r.intermediate_size) if last else None, "d"),
            "val loss": _fmt(r.summary.get("val_loss")),
            "tokens/s": _fmt(r.summary.get("tokens_per_s"), ".0f"),
            "wall s": _fmt(r.wall_s, ".1f"),
        })
    return rows


def text_table(rows: list[dict]) -> str:
    """Fixed-width text table of ``rows`` (all with the same keys)."""
    if not rows:
        return ""
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def diff_lines(result: dict) -> list[str]:
    """The loss-difference lines (all steps, last steps, ratio) of a :func:`compare_runs` dict."""
    n, d = result["loss"]["noise_AB"], result["loss"]["twell_AC"]
    ratio = result["loss"]["ratio"]
    return [
        (f"loss noise (A vs B): max|A-B| {n['max_abs']:.3g} at step {n['at_step']} of "
        f"{n['steps']}; last {n['last_n']} steps: {n['last_max_abs']:.3g} at step "
        f"{n['last_at_step']}"),
        (f"loss twell (A vs C): max|A-C| {d['max_abs']:.3g} at step {d['at_step']} of "
        f"{d['steps']}; last {d['last_n']} steps: {d['last_max_abs']:.3g} at step "
        f"{d['last_at_step']}"),
        f"ratio max|A-C| / max|A-B| = {ratio:.3g} (rule: PASS if <= {NOISE_FACTOR:g})",
        (f"L0 (mean of the last {result['l0']['window']} steps): A {result['l0']['A']:.4g}, "
         f"B {result['l0']['B']:.4g}, C {result['l0']['C']:.4g}; |B-A|/A "
         f"{100 * result['l0']['rel_diff_AB']:.3g} % (noise), |C-A|/A "
         f"{100 * result['l0']['rel_diff_AC']:.3g} %; last step only: |C-A|/A "
         f"{100 * result['l0']['l0_last']['rel_diff_AC']:.3g} %"),
    ]


def markdown(result: dict, runs: list[RunData], meta: dict) -> str:
    """compare_ffn.md: the rule, the runs table, the differences and the verdicts."""
    rows = summary_rows(runs)
    cols = list(rows[0])
    out = [
        "# twell vs torch FFN training paths", "",
        (f"Generated by `scripts/compare_ffn_paths.py` ({meta['started']}). Three runs from the "
        f"same seed on the same data, {meta['steps']} steps each: A `ffn.impl=torch`; B "
        "torch with the micro-batch halved (twice the gradient accumulation: the same math in "
        "another reduction order, the noise baseline); C `ffn.impl=twell`."), "",
        ("Rules: loss within bf16 noise = max over steps of |loss_A - loss_C| <= "
        f"{NOISE_FACTOR:g} x max over steps of |loss_A - loss_B|; final L0 (mean active FFN units "
        f"per token, last step) within {100 * L0_REL_TOL:g} % of A; dead-neuron counts differ by "
        f"at most {100 * DEAD_UNITS_TOL:g} % of all hidden units (layers x FFN width)."), "",
        "Overrides of every run (then `trainer.max_steps`, `trainer.log_every=1`, "
        "`trainer.resume=never`, `ffn.impl`, B's `trainer.micro_batch`, `hydra.run.dir`; "
        "full commands in compare_ffn.json): `" + " ".join([*DEFAULTS, *meta["overrides"]]) + "`",
        "",
        "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows), "",
        ("val loss: end-of-run validation on the same trainer.val_sequences held-out sequences "
         "for every run; information only."), "",
        *(f"- {line}" for line in diff_lines(result)), "",
        *(f"- **{k['line'].split()[0]}** {k['line'][6:]}" for k in result["criteria"]), "",
        f"Verdict: **{'PASS' if result['passed'] else 'FAIL'}**", "",
    ]
    return "\n".join(out)


def json_safe(x):
    """``x`` with every non-finite float made JSON-safe: NaN -> None, +-inf -> "inf" / "-inf"
    (in nested dicts, lists and tuples)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


# ---------------------------------------------------------------- planning the runs


@dataclass
class RunSpec:
    """One planned run: name (its directory under the runs folder), FFN impl, micro-batch and
    the Hydra overrides of ``python -m train`` (without ``hydra.run.dir``)."""

    name: str
    ffn_impl: str
    micro_batch: int
    overrides: list[str]


def override_key(override: str) -> str:
    """The key of a Hydra override (``+a.b=1`` -> ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


def split_steps(overrides: list[str], steps: int | None, *, smoke: bool = False
                ) -> tuple[list[str], int]:
    """The user's overrides without ``trainer.max_steps``, and the step count of every run:
    ``steps`` if given, else the ``trainer.max_steps`` override, else 300 (8 with ``smoke``).

    Raises:
        ValueError: an argument that is not ``key=value``, a key this module sets for each run
            (:data:`CONTROLLED`), a non-integer ``trainer.max_steps``, ``steps`` and
            ``trainer.max_steps`` that disagree, or fewer than 1 step.
    """
    steps_over = None
    for o in overrides:
        if "=" not in o or o.startswith("-"):
            raise ValueError(f"extra argument {o!r} is not a Hydra override key=value")
        if override_key(o) in CONTROLLED:
            raise ValueError(f"{override_key(o)} is set for each run of the comparison; remove {o!r}")
        if override_key(o) == "trainer.max_steps":
            raw = o.split("=", 1)[1]
            try:
                steps_over = int(raw)
            except ValueError:
                raise ValueError(f"trainer.max_steps={raw!r}: not an integer") from None
    if steps is not None and steps_over is not None and steps != steps_over:
        raise ValueError(f"--steps {steps} and trainer.max_steps={steps_over} disagree; give one")
    if steps is None:  # "is None", not "or": an explicit 0 must reach the check below
        steps = steps_over if steps_over is not None else (8 if smoke else 300)
    if steps < 1:
        raise ValueError("--steps must be >= 1")
    return [o for o in overrides if override_key(o) != "trainer.max_steps"], steps


def plan(user: list[str], steps: int, micro_batch: int) -> list[RunSpec]:
    """The three runs' Hydra overrides: :data:`DEFAULTS`, then the user's, then the controlled
    keys (Hydra lets the last value of a key win)."""
    half = micro_batch // 2
    fixed = [f"trainer.max_steps={steps}", "trainer.log_every=1", "trainer.resume=never"]
    return [
        RunSpec("A_torch", "torch", micro_batch,
                [*DEFAULTS, *user, *fixed, "ffn.impl=torch"]),
        RunSpec("B_torch_half_micro", "torch", half,
                [*DEFAULTS, *user, *fixed, "ffn.impl=torch", f"trainer.micro_batch={half}"]),
        RunSpec("C_twell", "twell", micro_batch,
                [*DEFAULTS, *user, *fixed, "ffn.impl=twell"]),
    ]


def check_plan(user: list[str], steps: int):
    """Compose every run's configuration before the first one starts.

    Returns:
        ``(cfg, specs, accum)``: the composed :class:`train.config.TrainConfig` of A, the
        :class:`RunSpec` list of :func:`plan`, and ``{name: gradient-accumulation steps}``.

    Raises:
        train.config.ConfigError: a bad override, or a micro-batch that cannot be halved for
            the half-micro-batch run (B): null, odd or below 2.
    """
    from train.config import ConfigError, compose

    cfg = compose([*DEFAULTS, *user, f"trainer.max_steps={steps}"])
    micro = cfg.trainer.micro_batch
    if micro is None or micro < 2 or micro % 2:  # null: the memory planner's
        raise ConfigError(f"trainer.micro_batch={micro} cannot be halved for the half-micro-batch "
                          "run (B); set an even trainer.micro_batch >= 2")
    specs = plan(user, steps, micro)
    accum = {s.name: compose(s.overrides).check_world(1) for s in specs}
    return cfg, specs, accum


def write_smoke_tokens(path: Path, n_tokens: int = 20_000, vocab: int = 64, seed: int = 0) -> Path:
    """uint16 stream of documents that mostly follow a fixed random successor table (id 0 =
    end of document): a tiny model learns it in a few steps."""
    from train.data.synthetic import write_successor_tokens

    return write_successor_tokens(path, n_tokens, vocab, seed)


def load_run_data(spec: RunSpec, runs_dir: Path, accum: int, wall_s: float | None = None
                  ) -> RunData:
    """The :class:`RunData` of a finished run in ``runs_dir/<name>``.

    Raises:
        studies.report.ReportError: the run is incomplete or unreadable (a ValueError).
    """
    from studies.report import load_run

    run = load_run(runs_dir / spec.name)
    m = run.config["model"]
    return RunData(spec.name, spec.ffn_impl, spec.micro_batch, accum, m["num_layers"],
                   m["intermediate_size"], run.train, run.summary, wall_s)


def curves(runs: list[RunData]) -> dict:
    """Per run: the logged ``step``, ``loss``, ``ce``, ``l0_mean`` and dead units of every step
    (the curves of compare_ffn.json)."""
    out = {r.name: {k: [x.get(k) for x in r.rows] for k in ("step", "loss", "ce", "l0_mean")}
           for r in runs}
    for r in runs:
        out[r.name]["dead_units"] = [dead_units(x, r.intermediate_size) for x in r.rows]
    return out


__all__ = ["CONTROLLED", "DEAD_UNITS_TOL", "DEFAULTS", "L0_REL_TOL", "LAST_STEPS", "NOISE_FACTOR",
           "SMOKE_OVERRIDES", "Criterion", "CurveDiff", "RunData", "RunSpec", "check_plan",
           "compare_runs", "curve", "curve_diff", "curves", "dead_criterion", "dead_units",
           "diff_lines", "final_l0", "json_safe", "l0_criterion", "load_run_data",
           "loss_criterion", "markdown", "override_key", "plan", "rel_diff", "split_steps",
           "summary_rows", "text_table", "write_smoke_tokens"]
