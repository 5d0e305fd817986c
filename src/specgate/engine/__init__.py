"""specgate.engine."""
