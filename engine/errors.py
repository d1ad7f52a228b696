"""Errors the engine raises for the user to read: each message says what went wrong and what to do."""


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""
