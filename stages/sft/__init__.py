"""Supervised fine-tuning: `python -m stages.sft`. config.py holds its flags, train.py what it runs."""
