"""The CLI's main in a process forked from a server that imported the emulator, its protocols and torch once,
for the tests that kill runs with SIGKILL or signal a sweep: a tenth of a second to the run's first file
instead of the seconds a fresh interpreter takes to import them, which every kill or sweep would pay."""
from __future__ import annotations

import multiprocessing
import os
import pkgutil
import signal
import sys

import protocols
from p2p_emulator.cli import main

# One forkserver per process, started with the preload list of its first use: every test file that kills runs
# uses this one list. torch._dynamo comes with the first optimiser, torchvision with the hetero models.
_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["p2p_emulator.cli", "p2p_emulator.runs", "torch", "torch._dynamo", "torchvision.models",
                                 *(f"protocols.{module.name}" for module in pkgutil.iter_modules(protocols.__path__))])


class Forked:
    """`main(flags)` in a forked process."""

    def __init__(self, flags: list):
        self.process = _context.Process(target=main, args=([*map(str, flags)],), daemon=True)
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL."""
        self.process.kill()

    def wait(self, timeout: float | None = None) -> None:
        self.process.join(timeout)


def _main_apart(flags: list, cwd: str, stderr: str) -> None:
    """`main(flags)` as a shell starts `emulate`: in a session of its own, in `cwd`, its stderr into the file
    `stderr` (its stdout dropped), with Ctrl-C raising KeyboardInterrupt."""
    os.setsid()
    os.chdir(cwd)
    for fd, path in ((1, os.devnull), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main(flags))


class ForkedApart(Forked):
    """`main(flags)` forked as `_main_apart` runs it: its process group (pid) holds every process it starts, and
    it may start worker processes (so it is no daemon)."""

    def __init__(self, flags: list, cwd, stderr):
        self.process = _context.Process(target=_main_apart, args=([*map(str, flags)], str(cwd), str(stderr)))
        self.process.start()
        self.pid = self.process.pid
