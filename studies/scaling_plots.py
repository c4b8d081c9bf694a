"""The scaling study's plots (matplotlib, Agg), one function per figure of the paper it mirrors.

Each ``plot_*(results, path)`` takes the result dicts of :func:`studies.scaling.run_study` (one
series: the paper sizes or the depth series; :func:`studies.scaling_report.normalise`-d and sorted
by :func:`studies.scaling_report.sort_key`) and writes one PNG, or returns a reason (str) why it
has nothing to draw. Rows of one series, the same L1 strength and number of steps
(:func:`studies.scaling.series_key`; rows of different steps saw different tokens), share a panel
or a line; lines are sizes (paper series) or depths (depth series); where the results hold
several step counts every title and legend names the steps. :func:`write_plots` draws the paper-size rows under :data:`PLOT_FUNCS`'
names and the depth series (probe rows left out) under :data:`DEPTH_PLOT_FUNCS`' names.
"""

from __future__ import annotations

from pathlib import Path

from studies.scaling import row_label, series_text, several_steps
from studies.sizes import PAPER_POINTS  # size -> (layers, the paper's L0 at L1 2e-5)

TOP_TOKENS = 15


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_l1(results: list[dict], reinit: bool | None = False,
           dense: bool = True) -> dict[tuple[float, int | None], list[dict]]:
    """Rows by series, (L1 strength, steps): the strongest first, then the fewest steps; without
    L1 = 0 unless ``dense``; re-init rows only (True), none (False) or with their plain twins
    (None); each series sorted by depth."""
    by: dict[tuple[float, int | None], list[dict]] = {}
    for r in results:
        if (reinit is None or bool(r["row"]["reinit"]) == reinit) and (
                dense or r["row"]["l1_coeff"] > 0):
            by.setdefault((r["row"]["l1_coeff"], r["row"].get("steps")), []).append(r)
    return {k: sorted(v, key=lambda r: (r["row"]["layers"], bool(r["row"]["reinit"])))
            for k, v in sorted(by.items(), key=lambda kv: (-kv[0][0], kv[0][1] or 0))}


def _colors(results: list[dict]) -> dict[int, str]:
    """A colour per depth (or size), the same in every panel: ``C0``, ``C1``, ... shallowest
    first."""
    return {n: f"C{i}" for i, n in enumerate(sorted({r["row"]["layers"] for r in results}))}


def _series_styles(keys) -> dict[tuple, tuple[str, str]]:
    """One look per series (``(L1, steps)`` keys of :func:`_by_l1`), the same in every plot:
    ``(colour, line style)``, the colour by L1 strength (black for L1 0, the dense control;
    ``C0``, ``C1``, ... from the weakest), the line style by step count (solid for the fewest)."""
    l1s = sorted({k[0] for k in keys if k[0] != 0})
    steps = sorted({k[1] or 0 for k in keys})
    return {k: ("k" if k[0] == 0 else f"C{l1s.index(k[0])}",
                ("-", "--", ":", "-.")[steps.index(k[1] or 0) % 4]) for k in keys}


def _title(key: tuple[float, int | None], results: list[dict]) -> str:
    """A series' name in a title or legend: ``L1 6.6e-4`` (``, 1500 steps`` when the results
    hold several step counts)."""
    return series_text(key[0], key[1], several_steps(results))


def _depth(results: list[dict]) -> bool:
    return any(r["row"].get("series") == "depth" for r in results)


def _log_axis(ax, values, axis: str = "y") -> None:
    """Log scale with plain-number tick labels (``30``, not ``3x10^1``); the minor ticks are
    labelled too when the positive ``values`` span less than a decade."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    a = ax.yaxis if axis == "y" else ax.xaxis
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    a.set_major_formatter(fmt)
    pos = [v for v in values if v is not None and v > 0]
    a.set_minor_formatter(fmt if pos and max(pos) < 10 * min(pos) else NullFormatter())


def _panels(n: int, width: float = 5.0, height: float = 3.8, cols: int = 4):
    """``n`` panels in rows of at most ``cols`` (eight in one row are unreadable at page
    width); the grid's unused cells hidden."""
    plt = _plt()
    c = min(n, cols)
    rows = -(-n // c)
    fig, axes = plt.subplots(rows, c, figsize=(width * c, height * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    for a in flat[n:]:
        a.set_visible(False)
    return plt, fig, flat[:n]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(ax, xlabel: str, ylabel: str, title: str, which: str = "both") -> None:
    """A series panel's labels, grid and legend (the same look in every per-series plot)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which=which)
    ax.legend(fontsize=7)


def plot_l0_vs_size(results: list[dict], path: Path):
    """Held-out mean L0 against the number of layers, a line per series (L1 strength and steps,
    in :func:`_series_styles`' look; re-init rows as open markers), with the paper's 39 / 29 /
    24 at L1 2e-5 for reference."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4))
    look = _series_styles(by)
    color = {key: c for key, (c, _) in look.items()}
    for key, rs in by.items():
        ax.plot([r["row"]["layers"] for r in rs], [r["profile"]["l0_mean"] for r in rs],
                look[key][1], marker="o", color=look[key][0], label=_title(key, results))
    for r in results:
        if r["row"]["reinit"]:
            key = (r["row"]["l1_coeff"], r["row"].get("steps"))
            ax.plot(r["row"]["layers"], r["profile"]["l0_mean"], "s", mfc="none", ms=9,
                    color=color.get(key, "gray"),
                    label=f"{row_label(r)} re-init, {_title(key, results)}")
    px, py = zip(*PAPER_POINTS.values())
    ax.plot(px, py, ":", color="0.5", marker="x", label="paper (L1 2e-5, 10-40 B tokens)")
    layers = sorted({r["row"]["layers"] for r in results})
    depth = _depth(results)
    ax.set_xticks(layers, [f"{n} layers" if depth else row_label(next(
        r for r in results if r["row"]["layers"] == n)) + f"\n{n} layers" for n in layers])
    _log_axis(ax, [r["profile"]["l0_mean"] for r in results] + list(py))
    ax.set_ylabel("mean L0 (active units per token, held out)")
    ax.set_title("L0 falls with depth?" if depth else "L0 falls with size?")
    ax.grid(alpha=0.3, which="both")
    # beside the axes: with several series a legend inside covers their points
    ax.legend(fontsize=7, handlelength=4, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(plt, fig, path)


def plot_l0_per_layer(results: list[dict], path: Path):
    """Held-out L0 of every layer (1-based), a panel per series (L1 strength and steps), a line
    per size (depth), each in its colour in every panel."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt, fig, axes = _panels(len(by))
    color = _colors(results)
    for ax, (key, rs) in zip(axes, by.items()):
        for r in rs:
            l0 = [float("nan") if v is None else v for v in r["profile"]["l0_L"]]
            ax.plot(range(1, len(l0) + 1), l0, ".-", label=row_label(r),
                    color=color[r["row"]["layers"]])
        _log_axis(ax, [v for r in rs for v in r["profile"]["l0_L"]])
        _label(ax, "layer", "L0 (held out)", f"L0 per layer, {_title(key, results)}")
    return _save(plt, fig, path)


def plot_l0_by_position(results: list[dict], path: Path):
    """L0 averaged over layers at each position (1 = the first token), log-log; a panel per
    series (L1 strength and steps)."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt, fig, axes = _panels(len(by))
    color = _colors(results)
    for ax, (key, rs) in zip(axes, by.items()):
        for r in rs:
            y = [float("nan") if v is None else v for v in r["profile"]["l0_T"]]
            ax.plot(range(1, len(y) + 1), y, lw=1, label=row_label(r),
                    color=color[r["row"]["layers"]])
        _log_axis(ax, [1, max(len(r["profile"]["l0_T"]) for r in rs)], "x")
        _log_axis(ax, [v for r in rs for v in r["profile"]["l0_T"]])
        _label(ax, "position in the sequence (1 = first token)", "L0, mean over layers",
               f"L0 by position, {_title(key, results)}")
    return _save(plt, fig, path)


def plot_max_vs_mean(results: list[dict], path: Path):
    """Per layer: the most active token's count against the layer's mean L0 (log-log), with the
    lines max = mean and max = 10 x mean; a panel per series (L1 strength and steps)."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt, fig, axes = _panels(len(by))
    color = _colors(results)
    for ax, (key, rs) in zip(axes, by.items()):
        lo, hi = float("inf"), 0.0
        for r in rs:
            pairs = [(m, x) for m, x in zip(r["profile"]["l0_L"], r["profile"]["nnz_max_L"])
                     if m is not None and m > 0]
            if not pairs:
                continue
            ax.plot(*zip(*pairs), "o", ms=4, alpha=0.8, label=row_label(r),
                    color=color[r["row"]["layers"]])
            lo, hi = min(lo, min(p[0] for p in pairs)), max(hi, max(p[1] for p in pairs))
        if hi > 0:
            xs = [lo, hi]
            ax.plot(xs, xs, "k:", lw=1, label="max = mean")
            ax.plot(xs, [10 * x for x in xs], "k--", lw=1, label="max = 10 x mean")
        _log_axis(ax, [lo, hi], "x")
        _log_axis(ax, [lo, 10 * hi])
        _label(ax, "layer mean L0", "max active units of one token",
               f"per-token max vs mean, {_title(key, results)}")
    return _save(plt, fig, path)


def token_label(tokens: dict, i: int) -> str:
    """A token's text as a short readable label (``repr``-escaped), else ``id N``."""
    text = tokens.get("text")
    if text is None:
        return f"id {tokens['ids'][i]}"
    s = repr(text[i])
    return s if len(s) <= 18 else s[:17] + "…"


def token_extremes(r: dict, n: int = TOP_TOKENS) -> tuple[list[int], list[int]]:
    """Indices into the row's frequency-filtered token table of the ``n`` least and the ``n``
    most active tokens (the table is ordered least to most)."""
    k = len(r["profile"]["tokens"]["ids"])
    return list(range(min(n, k))), list(range(max(k - n, 0), k))[::-1]


def plot_tokens(results: list[dict], path: Path):
    """The least and the most active tokens (frequency-filtered) of the largest size of each
    sparse series (L1 strength and steps): their L0 averaged over layers and occurrences."""
    by = _by_l1(results, dense=False)
    picked = [(key, rs[-1]) for key, rs in by.items() if rs[-1]["profile"]["tokens"]["ids"]]
    if not picked:
        return "no row with a token table"
    plt = _plt()
    fig, axes = plt.subplots(len(picked), 2, figsize=(10, 0.28 * TOP_TOKENS * len(picked) + 1.2),
                             squeeze=False)
    for (key, r), (ax_lo, ax_hi) in zip(picked, axes):
        tok = r["profile"]["tokens"]
        lo, hi = token_extremes(r)
        for ax, idx, what in ((ax_lo, lo, "least"), (ax_hi, hi, "most")):
            ax.barh(range(len(idx)), [tok["l0"][i] for i in idx])
            ax.set_yticks(range(len(idx)), [token_label(tok, i) for i in idx], fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("L0, mean over layers and occurrences")
            ax.set_title(f"{what} active tokens, {row_label(r)} {_title(key, results)}",
                         fontsize=9)
    return _save(plt, fig, path)


def plot_dead_over_training(results: list[dict], path: Path):
    """Dead units (% of all units, per dead-neuron window of training) against tokens, with and
    without re-initialisation; a panel per series (L1 strength and steps)."""
    by = _by_l1(results, reinit=None)
    by = {key: [r for r in rs if any(v is not None for v in r["curves"]["dead_frac"])]
          for key, rs in by.items()}
    by = {key: rs for key, rs in by.items() if rs}
    if not by:
        return "no dead-unit curve (no dead-neuron window closed in any run)"
    plt, fig, axes = _panels(len(by))
    color = _colors(results)
    for ax, (key, rs) in zip(axes, by.items()):
        for r in rs:
            c = r["curves"]
            pts = [(t / 1e6, 100 * d) for t, d in zip(c["tokens"], c["dead_frac"]) if d is not None]
            style = "--" if r["row"]["reinit"] else "-"
            name = row_label(r) + (" re-init" if r["row"]["reinit"] else "")
            # a depth in its colour in every panel; a re-init row in the next one after them
            col = f"C{len(color)}" if r["row"]["reinit"] else color[r["row"]["layers"]]
            ax.step(*zip(*pts), style, where="post", marker=".", label=name, color=col)
        _label(ax, "training tokens (M)", "dead units (%), last window",
               f"dead units, {_title(key, results)}", which="major")
    return _save(plt, fig, path)


def plot_vs_dense(results: list[dict], path: Path):
    """Against the dense controls, per depth: the validation loss (left) and the seven-task
    mean with its standard error (right), a line per series (L1 strength and steps, in
    :func:`_series_styles`' look: L1 = 0, the dense control, black; a longer step count
    dashed)."""
    by = _by_l1(results)
    have_eval = any(r.get("evals") for rs in by.values() for r in rs)
    if not any(k[0] == 0 for k in by) or len(by) < 2:
        return "no dense control (L1 = 0) beside a sparse row"
    look = _series_styles(by)
    plt, fig, (ax_v, ax_e) = _panels(2, width=6.0)
    for key, rs in sorted(by.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0])):
        l1 = key[0]
        xs = [r["row"]["layers"] for r in rs]
        color, style = look[key]
        label = (f"dense ({_title(key, results)})" if l1 == 0 else _title(key, results))
        ax_v.plot(xs, [r["summary"].get("val_loss") for r in rs], style, marker="o", color=color,
                  label=label)
        ev = [(r["row"]["layers"], 100 * r["evals"]["mean"],
               100 * (r["evals"].get("mean_stderr") or 0)) for r in rs if r.get("evals")]
        if ev:
            ax_e.errorbar(*zip(*ev), fmt=style, marker="o", color=color, capsize=3, label=label)
    for ax, what in ((ax_v, "validation loss (held out)"),
                     (ax_e, "seven-task mean accuracy (%), +- 1 s.e.")):
        ax.set_xticks(sorted({r["row"]["layers"] for rs in by.values() for r in rs}))
        ax.set_xlabel("layers")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    # one legend for both panels (the same series), beside them so that it covers no point
    ax_e.legend(fontsize=7, handlelength=4, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax_v.set_title("validation loss against dense")
    ax_e.set_title("seven tasks against dense" if have_eval else "no evals in these results")
    return _save(plt, fig, path)


PLOT_FUNCS = {"l0_vs_size": plot_l0_vs_size, "l0_per_layer": plot_l0_per_layer,
              "l0_by_position": plot_l0_by_position, "max_vs_mean": plot_max_vs_mean,
              "tokens": plot_tokens, "dead_over_training": plot_dead_over_training}
DEPTH_PLOT_FUNCS = {"depth_l0_vs_depth": plot_l0_vs_size, "depth_l0_per_layer": plot_l0_per_layer,
                    "depth_l0_by_position": plot_l0_by_position,
                    "depth_max_vs_mean": plot_max_vs_mean, "depth_tokens": plot_tokens,
                    "depth_dead_over_training": plot_dead_over_training,
                    "depth_vs_dense": plot_vs_dense}


def write_plots(results: list[dict], out_dir: Path) -> dict[str, Path | str]:
    """Every plot of :data:`PLOT_FUNCS` (the paper-size rows) and :data:`DEPTH_PLOT_FUNCS` (the
    depth series without its probe rows) into ``out_dir/<name>.png``: name -> path, or the
    reason it was left out (a stale PNG of that name is removed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paper = [r for r in results if r["row"].get("series", "paper") == "paper"]
    depth = [r for r in results if r["row"].get("series") == "depth" and not r["row"].get("probe")]
    done: dict[str, Path | str] = {}
    for funcs, rows, what in ((PLOT_FUNCS, paper, "paper-size"), (DEPTH_PLOT_FUNCS, depth,
                                                                   "depth-series")):
        for name, fn in funcs.items():
            p = out_dir / f"{name}.png"
            got = fn(rows, p) if rows else f"no {what} row"
            if isinstance(got, str):
                p.unlink(missing_ok=True)
            done[name] = got
    return done


__all__ = ["DEPTH_PLOT_FUNCS", "PLOT_FUNCS", "plot_vs_dense", "token_extremes", "token_label",
           "write_plots"]
