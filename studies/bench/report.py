"""The benchmark's outputs: ``best_configs.csv``, ``probes.csv``, ``sparsity_profile.csv``,
``capacity_trace.csv`` (:mod:`studies.bench.capacity_trace`), ``bench_meta.json``, the Table-1
markdown (``bench_model.md``) with the ratios issue-style targets are read from, and two plots;
and the merge of several runs' outputs (one size per GPU call) into one folder.

Ratios (all from ``best_configs.csv`` and ``probes.csv``; speeds are wall-clock tokens/ms unless
named otherwise; "best dense" is the fastest of ``hf``, ``liger``, ``compile`` and ``dense``):

* ``sparse_vs_dense`` (per size and budget): the faster of ``ell`` and ``auto`` over the best
  dense.
* ``dense_vs_liger``: our ``dense`` over transformers + Liger-Kernel (``liger``).
* ``auto_vs_best``: ``auto`` over the faster of ``ell`` and ``dense``.
* ``default_vs_path``: ``default`` over the searched row of its own path (the path of the
  experiment's ``ffn.impl``: ``torch`` -> ``dense``, ``twell`` -> ``ell``, ``auto``).
* ``wall_vs_median``: per sparse row (``ell``, ``auto``, and ``default`` when its FFN is one of
  them), wall-clock over median tokens/ms.
* ``peak_vs_liger`` (per size): the predicted step peak (probe peak + optimizer state) of each
  of our FFN paths at the equal micro-batch without recomputation, over ``liger``'s (``hf``'s
  when ``liger`` was not probed).
* ``forward_vs_dense`` (per size): the forward tokens/ms of ``ell``, ``auto`` and ``default``
  over the best dense forward.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from studies.bench.capacity_trace import ROW_KEYS, TRACE_COLUMNS
from studies.bench.recipe import DENSE_PATHS, FFN_OF_IMPL, PATH_OF_FFN, PATHS, SPARSE_PATHS

BEST_COLUMNS = [
    "size", "budget_gb", "path", "micro_batch", "recompute", "train_tok_per_ms",
    "train_tok_per_ms_wall", "peak_gb", "fwd_tok_per_ms", "is_default",
    # beyond the issue's ten: what each row was measured on and how
    "l0", "ffn", "timed_steps", "redos", "step_ms_median", "step_ms_p10", "step_ms_p90",
    "predicted_peak_gb", "probe_tok_per_ms", "check_ok", "notes"]
PROBE_COLUMNS = ["size", "ffn", "micro_batch", "recompute", "peak_gb", "step_peak_gb", "ms",
                 "tok_per_ms"]
PROFILE_COLUMNS = ["size", "layer", "tokens", "l0", "l0_max", "dead_pct", "hot1_share",
                   "heavy_frac"]
TARGETS = {  # the targets the ratios are read against (None: no target at that size)
    "sparse_vs_dense": 1.3,
    "dense_vs_liger": 0.98,
    "auto_vs_best": 0.98,
    "default_vs_path": 0.97,
    "wall_vs_median": 0.98,
    "peak_vs_liger": 0.70,
    "forward_vs_dense": 1.2,
}
LOWER_IS_BETTER = ("peak_vs_liger",)


# ---------------------------------------------------------------- CSV


def _cell(v):
    if v is None:
        return ""
    return f"{v:.6g}" if isinstance(v, float) else v


def write_csv(rows: list[dict], path: Path, columns: list[str]) -> None:
    """Write ``rows`` (only ``columns``, in that order) through a temporary file."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in columns})
    tmp.replace(path)


def _num(v: str):
    """A CSV cell back to None / bool / int / float / str."""
    if v == "":
        return None
    if v in ("True", "False"):
        return v == "True"
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


def read_csv(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(f)]


# ---------------------------------------------------------------- ratios


def _speed(r: dict | None) -> float | None:
    return None if r is None else r.get("train_tok_per_ms_wall")


def _best(rows: list[dict], paths: tuple[str, ...]) -> dict | None:
    timed = [r for r in rows if r["path"] in paths and _speed(r)]
    return max(timed, key=_speed) if timed else None


def _ratio(a, b):
    return None if a in (None, "") or b in (None, "") or not b else a / b


def _target(name: str, size: str):
    t = TARGETS[name]
    return t.get(size) if isinstance(t, dict) else t


def _entry(name: str, size: str, budget, value, detail: str) -> dict:
    target = _target(name, size)
    ok = None if value is None or target is None else (
        value <= target if name in LOWER_IS_BETTER else value >= target)
    return {"size": size, "budget_gb": budget, "ratio": name, "value": value, "target": target,
            "ok": ok, "detail": detail}


def _groups(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault((r["size"], r["budget_gb"]), []).append(r)
    return out


def target_ratios(rows: list[dict], probes: list[dict], equal_micro: int = 8,
                  default_ffn: dict | None = None) -> list[dict]:
    """Every ratio of the module docstring, one dict each: size, budget_gb (None for the
    per-size ones), ratio, value (None when a side is missing), target, ok, detail.
    ``default_ffn``: per size, the default path's ffn (else read from its rows)."""
    out = []
    for (size, budget), rs in _groups(rows).items():
        by = {r["path"]: r for r in rs}
        s, d = _best(rs, SPARSE_PATHS), _best(rs, DENSE_PATHS)
        out.append(_entry("sparse_vs_dense", size, budget, _ratio(_speed(s), _speed(d)),
                          f"{s and s['path']} / {d and d['path']}"))
        out.append(_entry("dense_vs_liger", size, budget,
                          _ratio(_speed(by.get("dense")), _speed(by.get("liger"))),
                          "dense / liger"))
        ref = _best(rs, ("ell", "dense"))
        out.append(_entry("auto_vs_best", size, budget, _ratio(_speed(by.get("auto")),
                                                                _speed(ref)),
                          f"auto / {ref and ref['path']}"))
        dflt = by.get("default")
        ffn = (default_ffn or {}).get(size) or (dflt or {}).get("ffn")
        own = by.get(PATH_OF_FFN.get(ffn, "")) if ffn else None
        out.append(_entry("default_vs_path", size, budget, _ratio(_speed(dflt), _speed(own)),
                          f"default ({ffn}) / {own and own['path']}"))
        default = by.get("default")
        sparse_default = ("default",) if default and default.get("ffn") in SPARSE_PATHS else ()
        for p in (*SPARSE_PATHS, *sparse_default):
            r = by.get(p)
            out.append(_entry("wall_vs_median", size, budget,
                              _ratio(_speed(r), (r or {}).get("train_tok_per_ms")), p))
    for size in dict.fromkeys(r["size"] for r in rows):
        out += _per_size_ratios(size, [r for r in rows if r["size"] == size],
                                [p for p in probes if p["size"] == size], equal_micro)
    return out


def _per_size_ratios(size: str, rows: list[dict], probes: list[dict], equal_micro: int) -> list:
    out = []
    at = {p["ffn"]: p for p in probes
          if p["micro_batch"] == equal_micro and p["recompute"] == "none"}
    ref_ffn = "liger" if "liger" in at else "hf"
    ref = at.get(ref_ffn)
    for ffn in ("torch", "dense", "ell", "auto"):
        out.append(_entry("peak_vs_liger", size, None,
                          _ratio((at.get(ffn) or {}).get("step_peak_gb"),
                                 (ref or {}).get("step_peak_gb")),
                          f"{ffn} / {ref_ffn} at micro-batch {equal_micro}, no recomputation"))
    fwd = {}
    for r in rows:
        if r.get("fwd_tok_per_ms") is not None:
            fwd.setdefault(r["path"], r["fwd_tok_per_ms"])
    dense = {p: fwd[p] for p in DENSE_PATHS if fwd.get(p)}
    best = max(dense, key=dense.get) if dense else None
    for p in ("ell", "auto", "default"):
        out.append(_entry("forward_vs_dense", size, None,
                          _ratio(fwd.get(p), dense.get(best)), f"{p} / {best}"))
    return out


def default_ffn_of(meta: dict) -> dict:
    """Per size, the default path's ffn from ``bench_meta.json``'s ``sizes`` entries."""
    out = {}
    for size, m in (meta.get("sizes") or {}).items():
        impl = (m.get("default") or {}).get("ffn_impl")
        if impl in FFN_OF_IMPL:
            out[size] = FFN_OF_IMPL[impl]
    return out


# ---------------------------------------------------------------- markdown


def _f(v, fmt=".1f", none="n/a"):
    return none if v in (None, "") else format(v, fmt)


def _pct(r):
    return "" if r is None else f" ({100 * (r - 1):+.1f}%)"


def _config(r: dict | None) -> str:
    if r is None:
        return "n/a"
    return f"`{r['path']}` ({r.get('ffn')}) {r.get('micro_batch')} x {r.get('recompute')}"


def table1(rows: list[dict], l0_by_size: dict) -> str:
    """The paper's Table 1 layout per size and budget: dense = the fastest of ``hf``,
    ``liger``, ``compile`` and ``dense``, sparse = the faster of ``ell`` and ``auto``
    (wall-clock training tokens/ms)."""
    lines = [("| size | budget GB | L0 (held-out) | forward tok/ms dense -> sparse | train tok/ms "
             "(wall) dense -> sparse | peak GB dense -> sparse | dense config | sparse config |"),
             "|---|---|---|---|---|---|---|---|"]
    for (size, budget), rs in _groups(rows).items():
        d, s = _best(rs, DENSE_PATHS), _best(rs, SPARSE_PATHS)
        fd, fs = (d or {}).get("fwd_tok_per_ms"), (s or {}).get("fwd_tok_per_ms")
        td, ts = _speed(d), _speed(s)
        pd, ps = (d or {}).get("peak_gb"), (s or {}).get("peak_gb")
        lines.append(
            f"| {size} | {_f(budget, 'g')} | {_f(l0_by_size.get(size))} | {_f(fd)} -> {_f(fs)}"
            f"{_pct(_ratio(fs, fd))} | {_f(td)} -> {_f(ts)}{_pct(_ratio(ts, td))} | "
            f"{_f(pd)} -> {_f(ps)}{_pct(_ratio(ps, pd))} | {_config(d)} | {_config(s)} |")
    return "\n".join(lines)


def ratios_table(ratios: list[dict]) -> str:
    lines = ["| size | budget GB | ratio | value | target | met | what |", "|---|---|---|---|---|---|---|"]
    for r in ratios:
        cmp = "<=" if r["ratio"] in LOWER_IS_BETTER else ">="
        met = "n/a" if r["ok"] is None else ("yes" if r["ok"] else "**no**")
        tgt = "" if r["target"] is None else f"{cmp} {r['target']:g}"
        lines.append(f"| {r['size']} | {_f(r['budget_gb'], 'g', '')} | {r['ratio']} | "
                     f"{_f(r['value'], '.3f')} | {tgt} | {met} | {r['detail']} |")
    return "\n".join(lines)


def rows_table(rows: list[dict]) -> str:
    cols = [("size", "s"), ("budget_gb", "g"), ("path", "s"), ("ffn", "s"), ("micro_batch", "d"),
            ("recompute", "s"), ("train_tok_per_ms", ".1f"), ("train_tok_per_ms_wall", ".1f"),
            ("timed_steps", "d"), ("redos", "d"), ("peak_gb", ".1f"),
            ("predicted_peak_gb", ".1f"), ("fwd_tok_per_ms", ".1f"), ("l0", ".1f"),
            ("is_default", "s"), ("check_ok", "s"), ("notes", "s")]
    out = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c, fmt in cols:
            v = r.get(c)
            cells.append("" if v in (None, "") else str(v) if fmt == "s" else
                         format(int(v) if fmt == "d" else v, fmt))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_report(out: Path, rows: list[dict], probes: list[dict], profile: list[dict],
                 meta: dict, *, equal_micro: int = 8, plot: bool = True) -> str:
    """``bench_model.md`` (Table 1, the ratios, every row, the run's notes) and, with ``plot``,
    ``bench_train.png`` / ``bench_memory.png``; returns Table 1."""
    l0 = {s: m.get("l0") for s, m in (meta.get("sizes") or {}).items()}
    table = table1(rows, l0)
    ratios = target_ratios(rows, probes, equal_micro, default_ffn_of(meta))
    md = ["# Whole-model benchmark: the fastest way to train each model on each card", "",
          ("Every number is a row of `best_configs.csv` (probes: `probes.csv`); how they are "
          "measured: `studies/bench/` (module docstrings)."), "", "## Table 1", "", table, "",
          "## Ratios", "", ratios_table(ratios), "", "## Every row", "", rows_table(rows), ""]
    md += ["## Runs", ""]
    for size, m in (meta.get("sizes") or {}).items():
        md.append(f"- {size}: {m.get('source')}; held-out L0 {_f(m.get('l0'))}; device "
                  f"{m.get('device')}; stages (s) {m.get('stages')}")
    if meta.get("skipped"):
        md.append(f"- skipped (the deadline): {'; '.join(meta['skipped'])}")
    (out / "bench_model.md").write_text("\n".join(md) + "\n")
    if plot:
        try:
            plots(out, rows, profile)
        except ImportError as e:
            print(f"[bench_model] plots skipped ({e}); render them with --report elsewhere")
    return table


# ---------------------------------------------------------------- plots


def plots(out: Path, rows: list[dict], profile: list[dict]) -> None:
    """``bench_train.png``: per size, wall-clock training tokens/ms per budget and path (the
    median as a tick) and forward tokens/ms per path; ``bench_memory.png``: per size, peak GiB
    per budget and path and the held-out L0 of each layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    if not sizes:
        return
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 3.4 * len(sizes)), squeeze=False)
    for ax, size in zip(axes, sizes):
        _bars(ax[0], [r for r in rows if r["size"] == size], "train_tok_per_ms_wall",
              "train_tok_per_ms", f"{size}: training step (wall; tick = median)", "tokens / ms")
        fwd = {r["path"]: r["fwd_tok_per_ms"] for r in rows
               if r["size"] == size and r.get("fwd_tok_per_ms") is not None}
        ax[1].bar(list(fwd), list(fwd.values()), color="tab:green")
        ax[1].set_title(f"{size}: forward (eval, decoder stack)")
        ax[1].set_ylabel("tokens / ms")
    fig.tight_layout()
    fig.savefig(out / "bench_train.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 3.4 * len(sizes)), squeeze=False)
    for ax, size in zip(axes, sizes):
        rs = [r for r in rows if r["size"] == size]
        _bars(ax[0], rs, "peak_gb", None, f"{size}: peak training memory", "GiB")
        for b in dict.fromkeys(r["budget_gb"] for r in rs):
            ax[0].axhline(b, color="gray", lw=0.6, ls=":")
        ps = [p for p in profile if p["size"] == size]
        ax[1].plot([p["layer"] for p in ps], [p["l0"] for p in ps], marker="o", label="L0")
        ax[1].plot([p["layer"] for p in ps], [p["l0_max"] for p in ps], ls=":",
                   label="max per token")
        ax[1].set_yscale("log")
        ax[1].set_xlabel("layer")
        ax[1].set_title(f"{size}: held-out active FFN units per token")
        ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bench_memory.png", dpi=110)
    plt.close(fig)


def _bars(ax, rows: list[dict], key: str, tick: str | None, title: str, ylabel: str) -> None:
    budgets = list(dict.fromkeys(r["budget_gb"] for r in rows))
    width = 0.8 / len(PATHS)
    for i, p in enumerate(PATHS):
        xs, ys, ts = [], [], []
        for j, b in enumerate(budgets):
            r = next((r for r in rows if r["budget_gb"] == b and r["path"] == p), None)
            if r is not None and r.get(key) is not None:
                xs.append(j + (i - (len(PATHS) - 1) / 2) * width)
                ys.append(r[key])
                ts.append(r.get(tick) if tick else None)
        ax.bar(xs, ys, width, label=p)
        for x, t in zip(xs, ts):
            if t is not None:
                ax.plot([x - width / 2, x + width / 2], [t, t], color="k", lw=1)
    ax.set_xticks(range(len(budgets)), [f"{b:g} GB card" for b in budgets])
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=len(PATHS))


# ---------------------------------------------------------------- files and merging


OUTPUT_FILES = ("best_configs.csv", "probes.csv", "sparsity_profile.csv", "capacity_trace.csv",
                "bench_meta.json", "bench_model.md", "bench_train.png", "bench_memory.png")


def write_outputs(out: Path, rows: list[dict], probes: list[dict], profile: list[dict],
                  meta: dict, *, equal_micro: int = 8, plot: bool = True,
                  trace: list[dict] = ()) -> str:
    """Every output file of :data:`OUTPUT_FILES` into ``out`` (made if missing; ``trace``:
    ``capacity_trace.csv``'s rows, :func:`studies.bench.capacity_trace.trace_rows`); returns
    Table 1."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(list(trace), out / "capacity_trace.csv", TRACE_COLUMNS)
    # the markdown and plots are made from the CSVs as written (6 significant digits), so that
    # --report on these files rebuilds them exactly
    got = []
    for name, data, columns in (("best_configs.csv", rows, BEST_COLUMNS),
                                ("probes.csv", probes, PROBE_COLUMNS),
                                ("sparsity_profile.csv", profile, PROFILE_COLUMNS)):
        write_csv(data, out / name, columns)
        got.append(read_csv(out / name))
    (out / "bench_meta.json").write_text(json.dumps(meta, indent=1, default=str))
    return write_report(out, *got, meta, equal_micro=equal_micro, plot=plot)


def merge_runs(dirs: list[Path], out: Path, *, equal_micro: int = 8, plot: bool = True) -> str:
    """``--report DIR...``: merge the outputs of several runs (e.g. 1.5B from one GPU call, 2B
    from another) into ``out``: rows keyed by (size, budget, path), probes by (size, ffn,
    micro-batch, recompute), profile rows by (size, layer), the capacity trace by benchmark
    row (size, budget, path: all its steps from one folder), meta per size; a later folder
    wins on a repeated key. Returns Table 1.

    Raises:
        FileNotFoundError: a folder without ``best_configs.csv`` (one line naming it).
    """
    rows: dict = {}
    probes: dict = {}
    profile: dict = {}
    trace: dict = {}  # (size, budget, path) -> that row's trace rows
    meta: dict = {"sizes": {}, "skipped": [], "merged_from": []}
    for d in dirs:
        d = Path(d)
        if not (d / "best_configs.csv").is_file():
            raise FileNotFoundError(f"--report {d}: no best_configs.csv there (a benchmark's "
                                    "--out folder)")
        for r in read_csv(d / "best_configs.csv"):
            rows[(r["size"], r["budget_gb"], r["path"])] = r
        for name, keys, into in (("probes.csv", ("size", "ffn", "micro_batch", "recompute"),
                                  probes), ("sparsity_profile.csv", ("size", "layer"), profile)):
            if (d / name).is_file():
                for r in read_csv(d / name):
                    into[tuple(r[k] for k in keys)] = r
        trace.update(_trace_by_row(d / "capacity_trace.csv"))
        if (d / "bench_meta.json").is_file():
            m = json.loads((d / "bench_meta.json").read_text())
            meta["sizes"].update(m.get("sizes") or {})
            meta["skipped"] += m.get("skipped") or []
            # a folder's name only when absolute: no machine's path goes into the committed file
            meta["merged_from"].append(d.name if d.is_absolute() else str(d))
    return write_outputs(out, list(rows.values()), list(probes.values()),
                         list(profile.values()), meta, equal_micro=equal_micro, plot=plot,
                         trace=[r for got in trace.values() for r in got])


def _trace_by_row(path: Path) -> dict:
    """A folder's ``capacity_trace.csv`` rows by benchmark row (none without the file: a run
    from before the trace)."""
    got: dict = {}
    if path.is_file():
        for r in read_csv(path):
            got.setdefault(tuple(r[k] for k in ROW_KEYS), []).append(r)
    return got


__all__ = ["BEST_COLUMNS", "OUTPUT_FILES", "PROBE_COLUMNS", "PROFILE_COLUMNS", "TARGETS",
           "default_ffn_of", "merge_runs", "plots", "ratios_table", "read_csv", "rows_table",
           "table1", "target_ratios", "write_csv", "write_outputs", "write_report"]
