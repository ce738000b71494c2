"""The one exception type for errors a user can cause (bad path, bad name, corrupt file, NaN weights)."""


class MixprecError(Exception):
    """A user-facing error: the message says what was wrong and where. The CLI prints it on one line."""
