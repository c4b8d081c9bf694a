"""A failed run's one-line reason: ``twell-train`` writes it to :data:`ERROR_FILE` in the run dir
(``train/main.py``) and ``twell-report`` reads it. A diverged run's facts go beside it in
:data:`ERROR_FACTS`, so the report reads them as fields, not out of the line's text.

No imports: the report reads it without loading torch.
"""

ERROR_FILE = "error.txt"  # a failed run's one-line reason in its run dir (written by twell-train)
# a diverged run's facts beside it, as JSON: {"error": "NonFiniteLossError", "step": N,
# "reason": "...", "last_good_checkpoint": "checkpoints/stepM" (relative to the run dir) or null}
ERROR_FACTS = "error.json"
