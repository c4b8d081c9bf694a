"""Independent cross-check of :func:`evals.evaluate` against lm-evaluation-harness (see run.sh)."""
