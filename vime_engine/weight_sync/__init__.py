"""Moving the trainer's weights into the rollout engine: strategies (driver side) and endpoints (actor side)."""
