"""Dr. GRPO: GRPO done right (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783,
eq. 3).

GRPO divides each sequence's loss by its length |τ_i| and each advantage by the group's reward
std; both bias the gradient (toward long wrong answers, and toward too easy or too hard
prompts). Dr. GRPO removes both. Its token loss is PPO-clip's; what changes is around it:

    A_i    = R_i − mean_g(R)                          rollout.advantage = "dr_grpo"
    loss   = Σ_{i,t} loss_t / (B · L_max)               objective.loss_agg = "constant"

The config refuses `dr_grpo` without those two settings rather than silently running GRPO.
"""
from asyncrl.objectives.ppo_clip import loss  # noqa: F401  (the same token loss)
