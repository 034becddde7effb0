"""Direct preference optimisation (DPO, IPO, cDPO): `python -m stages.dpo`. config.py holds its flags, train.py what it runs."""
