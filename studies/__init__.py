"""The studies that use the trainer (``train``) and the kernels (``twell``) through their public
API, driven by ``scripts/`` and ``twell-report``. Imports flow one way: ``studies`` uses
``train`` and ``twell``; neither imports ``studies``.

Modules: ``jobs`` (training runs as subprocesses, the runner of the study scripts), ``report``
(``twell-report``: runs into tables and plots), ``profile`` (the sparsity profile of a trained
model), ``scaling`` / ``scaling_report`` / ``scaling_plots`` (the scaling-of-sparsity study),
``relufy`` / ``relufy_report`` (the ReLUfication study), ``ffn_compare`` (torch vs TwELL
training), ``multi_gpu`` (the two-GPU acceptance report), ``bench`` (the whole-model benchmark).

Kernel-level: ``capacity_sim`` (the no-sync backup capacity rules on synthetic traces).
"""
