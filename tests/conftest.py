"""Session-wide test settings, fixed before any test module is imported.

``TRITON_INTERPRET``: without CUDA the Triton kernels run in triton's interpreter. triton reads the
variable when a kernel is defined (``@triton.jit``, at import) and twell's training ops read it at
each call (``twell.ops.train_backend.pick_backend``), so it is set once here, as
``scripts/test.sh`` does: which backend a test runs then does not depend on which other test
modules were collected before it. A test that wants the ops' PyTorch backend removes it with
``monkeypatch.delenv("TRITON_INTERPRET")`` (read per call: that is enough for the training ops).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
