"""A failed run's one-line reason: ``twell-train`` writes it to :data:`ERROR_FILE` in the run dir
(``train/main.py``) and ``twell-report`` reads it.

No imports: the report reads it without loading torch.
"""

ERROR_FILE = "error.txt"  # a failed run's one-line reason in its run dir (written by twell-train)
