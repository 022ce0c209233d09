"""What a run does beside its work for `--watch` and `--log-to` (p2p_emulator.analysis.watch and .trackers).

--watch binds its port here, before any work (a port in use is bad input), and hands the socket to
`emulate watch --follow` in a process of its own, so that drawing the page never takes the run's
interpreter. When the run has finished, it waits up to LINGER seconds for the page to show the summary.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from emulator.errors import UsageError

from . import settings as cfg
from .analysis import trackers, watch
from .analysis.output import ArgumentsError

LINGER = watch.FOLLOW_GRACE + 2 * watch.POLL_SECONDS + 5.0  # the page's last poll, and the server's start


@contextlib.contextmanager
def watched(config: cfg.RunConfig, out_dir: Path) -> Iterator[None]:
    """With --watch, the page's server runs meanwhile; its address is printed (even with --quiet)."""
    if not config.watch:
        yield
        return
    try:
        sock = watch.bind(config.watch_port)
    except ArgumentsError as exc:
        raise UsageError(f"--watch-port: {exc}") from None
    with sock:
        server = subprocess.Popen([sys.executable, "-m", "p2p_emulator.analysis.watch", str(out_dir), "--follow",
                                   "--fd", str(sock.fileno())], pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL)
        print(f"emulate: watch the run at {watch.url(sock)}", file=sys.stderr, flush=True)
    try:
        yield
    except BaseException:
        server.terminate()
        raise
    else:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=LINGER)
    finally:
        server.terminate()  # nothing, when it has stopped
        server.wait()


def log(config: cfg.RunConfig, out_dir: Path) -> None:
    """--log-to: the finished run, to each tracker."""
    if config.log_to:
        trackers.log_run(out_dir, trackers.destinations(config.log_to))
