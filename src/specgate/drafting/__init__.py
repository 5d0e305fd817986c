"""specgate.drafting."""
