"""GRPO: rollouts generated in the training layout, rewards and scoring, the objective and its config section."""
