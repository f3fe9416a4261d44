"""Exception types of the public API.

Every user mistake (a bad model folder, an unreadable image, an invalid sampling parameter)
raises a subclass of `VlmstreamError` whose message is one line that says what is wrong and
where. The CLI prints that line and exits with code 2; anything else is a bug.
"""


class VlmstreamError(Exception):
    """Base class: a problem the user can fix, described in one line."""


class ConfigError(VlmstreamError, ValueError):
    """A config.json or a config value is invalid."""


class ModelLoadError(VlmstreamError):
    """A model folder is missing, incomplete, corrupt, or does not match its config."""


class ImageError(VlmstreamError):
    """An image could not be read or decoded."""


class RequestError(VlmstreamError, ValueError):
    """A request is invalid: bad sampling parameters, empty question, prompt too long."""


class ConstraintError(RequestError):
    """A constraint that cannot be compiled (bad regex or schema, or no token can satisfy it)."""


class DeviceError(VlmstreamError):
    """The requested device is not available on this machine."""


class EngineClosedError(VlmstreamError):
    """The engine is closed (or failed) and takes no more work."""


def shortened(name: str, limit: int = 80) -> str:
    """A name for a one-line message: a long one (past the file system's limit, 5,000 letters
    typed into a page) as its start and end."""
    return name if len(name) <= limit else name[:40] + "..." + name[-20:]
