"""specgate.sampling."""
