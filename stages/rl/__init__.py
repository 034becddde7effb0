"""Online RL: PPO, GRPO, RLOO, REINFORCE++ (OpenRLHF's train_ppo_ray): `python -m stages.rl`. config.py holds its flags, driver.py what it runs."""
