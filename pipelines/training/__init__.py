"""The training step, the Ray Train worker loop, trainer helpers and starting weights: knows no stage."""
