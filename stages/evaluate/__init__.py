"""Held-out evaluation of a policy against its reference and production: `python -m stages.evaluate`. config.py holds its flags, run.py what it runs."""
