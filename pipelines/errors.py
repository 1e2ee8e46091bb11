"""Errors a user can act on. The CLI prints them as one line, no stack trace."""


class UserwiseError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class InputError(UserwiseError):
    """Input data that cannot be used (missing path, unreadable format...)."""


class QuarantineLimitError(UserwiseError):
    """Too large a share of the input was rejected."""


class ShardError(UserwiseError):
    """A shard set that is incomplete, corrupt or of another format."""
