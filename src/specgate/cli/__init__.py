"""The `specgate` command line. Each command family lives in its own module and registers itself."""
