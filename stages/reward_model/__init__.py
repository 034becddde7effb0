"""The reward model on preference pairs (OpenRLHF's train_rm): `python -m stages.reward_model`. config.py holds its flags, train.py what it runs."""
