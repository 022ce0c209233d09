"""The errors the CLI turns into one line: bad input (exit code 2), and a lost compute worker (exit code 1)."""


class UsageError(ValueError):
    """Bad user input: a flag, a config value, a file, a dataset path."""


class WorkerLost(RuntimeError):
    """A compute worker (a Ray actor) died mid-run; its nodes' resident state went with it."""
