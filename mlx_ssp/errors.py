"""User-facing errors: one line that says what was wrong and what to do, never a traceback."""


class UserError(Exception):
    """A mistake in the user's input (path, config, model, data). The CLI prints it on one line
    and exits with status 2; library callers can catch it like any exception."""


class NotBuiltError(UserError):
    """A stage that this version does not implement yet."""
