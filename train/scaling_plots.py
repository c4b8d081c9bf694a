"""The scaling study's plots (matplotlib, Agg), one function per figure of the paper it mirrors.

Each ``plot_*(results, path)`` takes the result dicts of :func:`train.scaling.run_study` (sorted
by :func:`train.scaling_report.sort_key`) and writes one PNG, or returns a reason (str) why it
has nothing to draw. Rows at the same L1 strength share a panel; lines are sizes.
"""

from __future__ import annotations

from pathlib import Path

from train.scaling import l1_text

PAPER_POINTS = {"0p5b": (8, 39.0), "1p5b": (28, 29.0), "2b": (38, 24.0)}  # layers, L0 at 2e-5
TOP_TOKENS = 15


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(size: str) -> str:
    from train.scaling_report import size_label

    return size_label(size)


def _by_l1(results: list[dict], reinit: bool | None = False) -> dict[float, list[dict]]:
    by: dict[float, list[dict]] = {}
    for r in results:
        if reinit is None or bool(r["row"]["reinit"]) == reinit:
            by.setdefault(r["row"]["l1_coeff"], []).append(r)
    return {k: sorted(v, key=lambda r: r["row"]["layers"]) for k, v in
            sorted(by.items(), reverse=True)}


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


def _panels(n: int, width: float = 5.0, height: float = 3.8):
    plt = _plt()
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return plt, fig, list(axes[0])


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_l0_vs_size(results: list[dict], path: Path):
    """Held-out mean L0 against the number of layers, a line per L1 strength (re-init rows as
    open markers), with the paper's 39 / 29 / 24 at L1 2e-5 for reference."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    color = {}
    for l1, rs in by.items():
        (line,) = ax.plot([r["row"]["layers"] for r in rs], [r["profile"]["l0_mean"] for r in rs],
                          "o-", label=f"L1 {l1_text(l1)}")
        color[l1] = line.get_color()
    for r in results:
        if r["row"]["reinit"]:
            l1 = r["row"]["l1_coeff"]
            ax.plot(r["row"]["layers"], r["profile"]["l0_mean"], "s", mfc="none", ms=9,
                    color=color.get(l1, "gray"),
                    label=f"{_label(r['row']['size'])} re-init, L1 {l1_text(l1)}")
    px, py = zip(*PAPER_POINTS.values())
    ax.plot(px, py, "k--", marker="x", label="paper (L1 2e-5, 10-40 B tokens)")
    layers = sorted({r["row"]["layers"] for r in results})
    ax.set_xticks(layers, [_label(next(r["row"]["size"] for r in results
                                       if r["row"]["layers"] == n)) + f"\n{n} layers"
                           for n in layers])
    _log_axis(ax, [r["profile"]["l0_mean"] for r in results] + list(py))
    ax.set_ylabel("mean L0 (active units per token, held out)")
    ax.set_title("L0 falls with size?")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_l0_per_layer(results: list[dict], path: Path):
    """Held-out L0 of every layer (1-based), a panel per L1 strength, a line per size."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt, fig, axes = _panels(len(by))
    for ax, (l1, rs) in zip(axes, by.items()):
        for r in rs:
            l0 = [float("nan") if v is None else v for v in r["profile"]["l0_L"]]
            ax.plot(range(1, len(l0) + 1), l0, ".-", label=_label(r["row"]["size"]))
        _log_axis(ax, [v for r in rs for v in r["profile"]["l0_L"]])
        ax.set_xlabel("layer")
        ax.set_ylabel("L0 (held out)")
        ax.set_title(f"L0 per layer, L1 {l1_text(l1)}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_l0_by_position(results: list[dict], path: Path):
    """L0 averaged over layers at each position (1 = the first token), log-log."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt, fig, axes = _panels(len(by))
    for ax, (l1, rs) in zip(axes, by.items()):
        for r in rs:
            y = [float("nan") if v is None else v for v in r["profile"]["l0_T"]]
            ax.plot(range(1, len(y) + 1), y, lw=1, label=_label(r["row"]["size"]))
        _log_axis(ax, [1, max(len(r["profile"]["l0_T"]) for r in rs)], "x")
        _log_axis(ax, [v for r in rs for v in r["profile"]["l0_T"]])
        ax.set_xlabel("position in the sequence (1 = first token)")
        ax.set_ylabel("L0, mean over layers")
        ax.set_title(f"L0 by position, L1 {l1_text(l1)}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_max_vs_mean(results: list[dict], path: Path):
    """Per layer: the most active token's count against the layer's mean L0 (log-log), with the
    lines max = mean and max = 10 x mean."""
    by = _by_l1(results)
    if not by:
        return "no plain L1 rows"
    plt, fig, axes = _panels(len(by))
    for ax, (l1, rs) in zip(axes, by.items()):
        lo, hi = float("inf"), 0.0
        for r in rs:
            pairs = [(m, x) for m, x in zip(r["profile"]["l0_L"], r["profile"]["nnz_max_L"])
                     if m is not None and m > 0]
            if not pairs:
                continue
            ax.plot(*zip(*pairs), "o", ms=4, alpha=0.8, label=_label(r["row"]["size"]))
            lo, hi = min(lo, min(p[0] for p in pairs)), max(hi, max(p[1] for p in pairs))
        if hi > 0:
            xs = [lo, hi]
            ax.plot(xs, xs, "k:", lw=1, label="max = mean")
            ax.plot(xs, [10 * x for x in xs], "k--", lw=1, label="max = 10 x mean")
        _log_axis(ax, [lo, hi], "x")
        _log_axis(ax, [lo, 10 * hi])
        ax.set_xlabel("layer mean L0")
        ax.set_ylabel("max active units of one token")
        ax.set_title(f"per-token max vs mean, L1 {l1_text(l1)}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
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
    """The least and the most active tokens (frequency-filtered) of the largest size at each L1
    strength: their L0 averaged over layers and occurrences."""
    by = _by_l1(results)
    picked = [(l1, rs[-1]) for l1, rs in by.items() if rs[-1]["profile"]["tokens"]["ids"]]
    if not picked:
        return "no row with a token table"
    plt = _plt()
    fig, axes = plt.subplots(len(picked), 2, figsize=(10, 0.28 * TOP_TOKENS * len(picked) + 1.2),
                             squeeze=False)
    for (l1, r), (ax_lo, ax_hi) in zip(picked, axes):
        tok = r["profile"]["tokens"]
        lo, hi = token_extremes(r)
        for ax, idx, what in ((ax_lo, lo, "least"), (ax_hi, hi, "most")):
            ax.barh(range(len(idx)), [tok["l0"][i] for i in idx])
            ax.set_yticks(range(len(idx)), [token_label(tok, i) for i in idx], fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("L0, mean over layers and occurrences")
            ax.set_title(f"{what} active tokens, {_label(r['row']['size'])} L1 {l1_text(l1)}",
                         fontsize=9)
    return _save(plt, fig, path)


def plot_dead_over_training(results: list[dict], path: Path):
    """Dead units (% of all units, per dead-neuron window of training) against tokens, with and
    without re-initialisation; a panel per L1 strength."""
    by = _by_l1(results, reinit=None)
    by = {l1: [r for r in rs if any(v is not None for v in r["curves"]["dead_frac"])]
          for l1, rs in by.items()}
    by = {l1: rs for l1, rs in by.items() if rs}
    if not by:
        return "no dead-unit curve (no dead-neuron window closed in any run)"
    plt, fig, axes = _panels(len(by))
    for ax, (l1, rs) in zip(axes, by.items()):
        for r in rs:
            c = r["curves"]
            pts = [(t / 1e6, 100 * d) for t, d in zip(c["tokens"], c["dead_frac"]) if d is not None]
            style = "--" if r["row"]["reinit"] else "-"
            name = _label(r["row"]["size"]) + (" re-init" if r["row"]["reinit"] else "")
            ax.step(*zip(*pts), style, where="post", marker=".", label=name)
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("dead units (%), last window")
        ax.set_title(f"dead units, L1 {l1_text(l1)}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


PLOT_FUNCS = {"l0_vs_size": plot_l0_vs_size, "l0_per_layer": plot_l0_per_layer,
              "l0_by_position": plot_l0_by_position, "max_vs_mean": plot_max_vs_mean,
              "tokens": plot_tokens, "dead_over_training": plot_dead_over_training}


def write_plots(results: list[dict], out_dir: Path) -> dict[str, Path | str]:
    """Every plot of :data:`PLOT_FUNCS` into ``out_dir/<name>.png``: name -> path, or the reason
    it was left out (a stale PNG of that name is removed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    done: dict[str, Path | str] = {}
    for name, fn in PLOT_FUNCS.items():
        p = out_dir / f"{name}.png"
        got = fn(results, p)
        if isinstance(got, str):
            p.unlink(missing_ok=True)
        done[name] = got
    return done


__all__ = ["PLOT_FUNCS", "token_extremes", "token_label", "write_plots"]
