"""twell's trainer: ``twell-train`` / ``python -m train`` (see ``train/main.py``).

Modules: ``config`` (typed Hydra configs), ``model`` (Llama + SparseGatedMLP, ``load_model``),
``sparsity`` (L1 term, L0, dead neurons, re-init), ``checkpoint`` (atomic ``step{N}/`` folders),
``trainer`` (the accelerate loop), ``data`` (corpus, tokenizer, batches).
"""
