"""The names of the algorithms' variants, without the math (stages/algorithms.py), so configs need no torch."""

KL_ESTIMATORS = ("k1", "k2", "k3")
# Estimators whose baseline comes from the other samples of the same prompt.
GROUP_ESTIMATORS = ("group_norm", "rloo", "dr_grpo", "reinforce_baseline")
ADVANTAGE_ESTIMATORS = ("gae", "reinforce", *GROUP_ESTIMATORS)
# Estimators whose token advantages are whitened over the whole rollout batch (REINFORCE++ style).
GLOBALLY_NORMALIZED_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline")
