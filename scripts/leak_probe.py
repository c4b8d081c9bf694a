"""Memory left behind by the whole-model bench's sequence on one trainer, with and without
``trainer.recompute_norms`` / ``trainer.recast_attn_weights`` (the command line of
``studies/memory/leak_probe.py``, whose docstring says what each stage does).

    python scripts/leak_probe.py                      # CUDA when there is one, else the CPU
    python scripts/leak_probe.py --hidden 1024 --layers 8 --seq 1024 --micro 8
"""

from studies.memory.leak_probe import main

if __name__ == "__main__":
    main()
