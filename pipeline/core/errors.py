"""The one error type a user sees for bad configuration."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the valid choices."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"Invalid config `{key}`: {message}")


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback and where each rank was."""
