"""The GPU kit's sections (bench/gpu_check.py runs them): the policy they train, and one module per measurement.
Imported by module name from the repository root (``PYTHONPATH=.``): ``from bench.gpu_kit.sync import check_sync``.
"""
