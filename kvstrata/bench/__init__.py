"""Benchmarks behind ``kvstrata bench``: each module prints one JSON object of measured figures.

They sit above ``tools`` (the operator CLI and the engine helpers they reuse: ``tools.engine``,
``tools.jobs``, ``tools.ttft``, ``tools.models``); ``tools.cli`` dispatches to them by module name
only, so ``tools`` never imports this package (``tests/unit/test_layers.py``).
"""
