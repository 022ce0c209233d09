"""The two ways this package reports a problem with a topology."""


class TopologyError(ValueError):
    """A topology cannot be built; the message is one user-facing line."""


class TopologyWarning(UserWarning):
    """A topology was built but is probably not what the user wants (e.g. disconnected)."""
