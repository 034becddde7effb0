"""Kahneman-Tversky optimisation: `python -m stages.kto`. config.py holds its flags, train.py what it runs."""
