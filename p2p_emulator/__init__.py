"""Settings, the run, the `emulate` command and sweeps."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("p2p-emulator")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"
