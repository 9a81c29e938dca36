"""The one error type a user sees for bad configuration, and how its messages list numbers."""


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


def ranges(indices) -> str:  # noqa: ANN001 - any iterable of ints
    """[0, 1, 2, 5] -> '0-2, 5': a list of stages, ranks or layers as a message shows it (80
    stages named one by one is a line nobody reads)."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
