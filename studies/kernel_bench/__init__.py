"""The kernel benchmarks: the sparse FFN ops of ``twell.ops`` checked against the fp32 references
of ``twell.ops.reference``, then timed beside dense cuBLAS. Driven by ``scripts/``.

Modules: ``common`` (the error measure, the fp32 references, the timers, peak memory: what every
benchmark below shares), ``cases`` (the inputs: i.i.d. and heavy-tailed rows at a set density,
recorded layers), ``infer`` (the inference FFN's variants and launch shapes,
``scripts/bench_ffn.py``), ``train`` (the training FFN's variants and per-kernel launch shapes,
``scripts/bench_ffn_train.py``), ``real_layers`` (every op on recorded layers,
``scripts/bench_real_layers.py``), ``kernel_profile`` (each of those ops under
``torch.profiler``: wall against GPU busy time, kernels per call). Numbers and their history:
BENCHMARKS.md.
"""
