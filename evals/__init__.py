"""twell's downstream evaluations: seven zero-shot cloze tasks (arXiv 2603.23198).

``from evals import evaluate`` -> see :func:`evals.harness.evaluate`. Prompt formats:
:mod:`evals.tasks`. Data: :mod:`evals.data`. CLI: ``twell-eval`` (:mod:`evals.cli`).
"""

from evals.harness import evaluate
from evals.tasks import ALL_TASKS, TASKS

__all__ = ["evaluate", "ALL_TASKS", "TASKS"]
