"""The app's own mistakes, each a user's: a bad combination of command-line arguments, or a
mistake on the web UI's page (the rest are engine errors)."""

from engine.errors import VlmstreamError


class UsageError(VlmstreamError):
    """A bad combination of command-line arguments (exit code 2, like every user mistake)."""


class UIError(Exception):
    """A user mistake the page reports in one line (bad URL, unreadable upload, empty question)."""
