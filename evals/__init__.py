"""twell's downstream evaluations: seven zero-shot cloze tasks (arXiv 2603.23198).

``from evals import evaluate`` -> :func:`evals.harness.evaluate`. Prompt formats:
:mod:`evals.tasks`. Data: :mod:`evals.data`. CLI: ``twell-eval`` (:mod:`evals.cli`).
Imported lazily so ``import evals`` stays light.
"""

__all__ = ["ALL_TASKS", "TASKS", "evaluate"]


def __getattr__(name: str):
    if name == "evaluate":
        from evals.harness import evaluate

        return evaluate
    if name in ("ALL_TASKS", "TASKS"):
        from evals import tasks

        return getattr(tasks, name)
    raise AttributeError(f"module 'evals' has no attribute {name!r}")
