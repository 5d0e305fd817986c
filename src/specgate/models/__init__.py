"""specgate.models."""
