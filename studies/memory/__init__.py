"""Where a training step's memory goes: the saved-for-backward audit of the trainer's model.

    from studies.memory.saved_activations import AuditSettings, audit, check_grads
    res = audit(AuditSettings(model="configs/model/2b.yaml", ffn="ell"))   # res.table: Source rows
    check_grads(AuditSettings(ffn="ell", recompute_norms=True))            # bitwise, or not

Modules: ``saved_activations`` (the model, one recorded training forward, the ``a + b T`` fit per
source, the table), ``recording`` (the saved-tensor recorder and the autograd-graph walk),
``liger_like`` (stand-ins for Liger-Kernel's autograd Functions with Liger's save sets, so the
GPU path's saved tensors are seen on the CPU), ``norm_recompute`` (a prototype that recomputes
the norms' outputs and the mid-layer residual in backward). ``scripts/saved_activations.py`` is
the command line.
"""
