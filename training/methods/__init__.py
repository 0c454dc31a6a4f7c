"""Training methods beyond the plain loop, each in one home: LoRA, distillation (teacher, objective, schema) and GRPO
(rollouts, rewards, objective, schema). The objectives shared by every method live beside them in objectives/."""
