"""Strata benchmarks: every figure is a ratio measured side by side in one process and one run.

``python -m bench.run`` (``make bench``) runs the cases round-robin and writes
``bench/results/latest.json`` and ``bench/results/latest.png``; see ``bench/README.md``.
"""
