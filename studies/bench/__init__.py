"""The whole-model benchmark: what is the fastest way to train this model on this card?

    from studies.bench import BenchSettings, run_bench, merge_runs
    res = run_bench(BenchSettings(sizes=["1p5b"], model_from=Path(".../checkpoints/step200"),
                                  out=Path("out")))      # one GPU call; res.table, res.failed
    merge_runs([Path("out_1p5b"), Path("out_2b")], Path("docs/model_bench"))   # on the CPU

Per size: a bench model (trained in-process with the scaling study's recipe at a fixed L1 per
size aimed at the paper's L0, optionally until its sparsity settles, or loaded from a checkpoint), its held-out L0 and checks against plain
transformers, the forward of every path, then per memory budget (a card: the H200 itself and an
80 GB card emulated with ``torch.cuda.set_per_process_memory_fraction``) the fastest
micro-batch x recomputation of every path that fits, found with the memory planner's probes
and timed for ``steps`` steps. Modules: ``recipe`` (paths and overrides), ``source`` (the bench
model), ``steps`` (builds, the plain-transformers step, timing), ``search`` (budgets, the
search), ``core`` / ``stages`` / ``run`` (the run, stage by stage), ``report`` (CSV, Table 1,
ratios, plots, merging), ``capacity_trace`` (the sparse rows' heavy rows and capacities per step
and layer, and their replay through ``studies.capacity_sim``). ``scripts/bench_model.py`` is the
command line.
"""

from studies.bench.core import BenchSettings
from studies.bench.recipe import PATHS, Recipe
from studies.bench.report import BEST_COLUMNS, OUTPUT_FILES, merge_runs, target_ratios
from studies.bench.run import BenchResult, run_bench
from studies.bench.search import Budget, FakeMemory, parse_budgets
from studies.bench.source import SettleRule, l0_settled

__all__ = ["BEST_COLUMNS", "OUTPUT_FILES", "PATHS", "BenchResult", "BenchSettings", "Budget",
           "FakeMemory", "Recipe", "SettleRule", "l0_settled", "merge_runs", "parse_budgets",
           "run_bench", "target_ratios"]
