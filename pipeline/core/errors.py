"""The one error type a user sees for bad configuration."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the valid choices."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"Invalid config `{key}`: {message}")


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback and where each rank was."""


class RunStopped(RuntimeError):
    """The ranks stopped for a signal (SIGTERM) before the launcher could collect their results;
    each had written its part of a checkpoint first (pipeline/runtime/preempt.py)."""

    def __init__(self, signal_name: str) -> None:
        self.signal_name = signal_name
        super().__init__(f"stopped by {signal_name}")
