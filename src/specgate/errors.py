"""Exceptions shared across specgate's packages."""


class UserError(Exception):
    """An error caused by the user's input; the command line prints it as one line and exits with status 2."""
