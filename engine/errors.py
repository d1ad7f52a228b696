"""Errors the engine raises for the user to read: each message says what went wrong and what to do."""


class UserError(Exception):
    """An error whose message is written for the user: one line that says what to change. The app shows it
    as it is; anything else it shows with its type, as a bug."""


class ModelLoadError(UserError, RuntimeError):
    """The model could not be loaded; the message says why and what to do."""
