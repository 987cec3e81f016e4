"""Training: strategies, models, data, checkpoints, TensorBoard and the planner (docs/ARCHITECTURE.md)."""
