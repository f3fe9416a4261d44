"""The command line's own mistake: a bad combination of arguments (the rest are engine errors)."""

from engine.errors import VlmstreamError


class UsageError(VlmstreamError):
    """A bad combination of command-line arguments (exit code 2, like every user mistake)."""
