"""twell's trainer: ``twell-train`` / ``python -m train`` (see ``train/main.py``).

Modules: ``config`` (typed Hydra configs), ``model`` (Llama + SparseGatedMLP, ``load_model``),
``sparsity`` (L1 term, L0, dead neurons, re-init), ``checkpoint`` (atomic ``step{N}/`` folders),
``trainer`` (the accelerate loop), ``data`` (corpus, tokenizer, batches).
"""

from train.packages import use_checkout_packages as _use_checkout_packages

# started from the folder holding the clone, the clone's folder would shadow the twell package
_use_checkout_packages()
