"""The data package's one error type."""


class DataError(ValueError):
    """A data file or prompt file is missing or malformed; the message names file, line, field."""
