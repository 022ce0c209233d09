"""--watch beside a run (p2p_emulator.analysis.watch serves the page).

The port is bound before any work, so one in use is bad input, and handed to `emulate watch --follow`
in a process of its own once config.yaml is written, so that drawing the page never takes the run's
interpreter. Once the run has written summary.json and done its own work after it (plots, --log-to), it
waits up to LINGER seconds for a page to be sent the summary.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

from emulator.errors import UsageError

from . import settings as cfg
from .analysis.output import ArgumentsError

LINGER = 10.0  # seconds: the server's start, the page's last poll and FOLLOW_GRACE (analysis/watch.py)


class Watch:
    """The page's port (None without --watch) and, once started, its server."""

    def __init__(self, config: cfg.RunConfig):
        self.server: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        if config.watch:
            from .analysis import watch  # Plotly and matplotlib: only for a watched run

            try:
                self.sock = watch.bind(config.watch_port)
            except ArgumentsError as exc:
                raise UsageError(f"--watch-port: {exc}") from None
            self.address = watch.url(self.sock)

    def start(self, out_dir: Path) -> None:
        """Serve the run directory's page from now on; its address is printed (even with --quiet)."""
        if self.sock is None:
            return
        self.server = subprocess.Popen(
            [sys.executable, "-m", "p2p_emulator.analysis.watch", str(out_dir), "--follow", str(os.getpid()),
             "--fd", str(self.sock.fileno())], pass_fds=[self.sock.fileno()], stdin=subprocess.DEVNULL)
        print(f"emulate: watch the run at {self.address}", file=sys.stderr, flush=True)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, failed, *_) -> None:
        """The run's work after summary.json is done: unless it failed, give a page up to LINGER seconds to be sent
        the summary (the server stops then); then stop the server and let go of the port."""
        if self.server is not None and not failed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(timeout=LINGER)
        self.close()

    def close(self) -> None:
        """Stop the server (nothing, when it has stopped) and let go of the port."""
        if self.server is not None:
            self.server.terminate()
            self.server.wait()
        if self.sock is not None:
            self.sock.close()
