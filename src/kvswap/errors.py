"""User-facing errors.

A `KvSwapError` is a mistake the user can fix: its message is one line that
names what was wrong and what is allowed. The CLI prints it and exits with 2;
it never shows a traceback for one.
"""


class KvSwapError(Exception):
    """A user mistake or an environment problem, explained in one line."""


class ConfigError(KvSwapError):
    """A configuration value or file is invalid."""


class StopRun(KvSwapError):
    """A failure of what every request shares (a user's tier that raised): no request
    owns it, so it is never blamed on the request being served; the run stops with
    this one line."""
