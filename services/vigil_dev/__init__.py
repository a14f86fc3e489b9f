"""vigil's tooling, beside the product: the local stack, the demo, the scripted Messages API,
the benchmarks and the chaos run.

The product package ``vigil`` imports nothing from here (tests/test_layout.py holds it to
that); this package imports the product freely. ``vigil-dev`` (or ``python -m vigil_dev``) is
its command line.
"""
