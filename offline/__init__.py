"""Offline inputs shared by ``train`` and ``evals``: the package-by-name fetcher and the SmolLM2 GGUF.

Imports neither ``train``, ``evals`` nor ``twell``, so both ``train`` and ``evals`` can use it
while only ``train`` imports ``evals``.
"""
