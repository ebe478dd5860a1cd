"""The one exception type that reaches the user as a one-line message instead of a traceback."""


class QuantgateError(Exception):
    """Bad input or a failed precondition; the message names the file, line or key and what was expected."""
