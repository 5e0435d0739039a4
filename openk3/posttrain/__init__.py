"""Post-training: verifiable tasks, sandbox, rollouts, RL and multi-teacher distillation (issue P12)."""
