"""User-facing errors.

Every problem a user can fix (bad config, bad input file, mismatched cache, missing package)
is raised as a :class:`DeepSpecError` subclass whose message says what was wrong *and* what
to do. The CLI prints these as one line, without a traceback.
"""


class DeepSpecError(Exception):
    """Base class for errors the user can act on."""


class ConfigError(DeepSpecError):
    """An invalid config file, override or field value."""


class DataError(DeepSpecError):
    """An input data file that cannot be used as given."""


class CacheError(DeepSpecError):
    """A hidden-state cache that is missing, corrupt or built for another setup."""


class TargetError(DeepSpecError):
    """A target model that cannot be found or loaded."""


class EngineError(DeepSpecError):
    """An inference engine (vLLM, OpenAI-compatible server) that failed or is unreachable."""


class CheckpointError(DeepSpecError):
    """A draft checkpoint that is missing, incomplete or made for another target."""


class MissingDependencyError(DeepSpecError):
    """An optional package needed for the requested path is not installed."""

    def __init__(self, package: str, purpose: str, install: str | None = None):
        hint = install or f"pip install {package}"
        super().__init__(f"{purpose} needs the '{package}' package, which is not installed; run `{hint}`.")
