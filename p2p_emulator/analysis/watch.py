"""`emulate watch RUN_DIR [--port N] [--open]`: a page on 127.0.0.1 that follows a run directory as it streams.

The page (watch.html) shows the run's charts (charts.py, drawn by Plotly.js as the plotly package
ships it: no network), the figures of the installed analysis extensions (the protocols' own, such as
MAPL's learned graph, drawn as PNGs by matplotlib) and, once summary.json lands, the run's row of
`emulate report`. The page asks for /state.json every POLL_SECONDS. The server reads the run
directory again only after a file in it changed, no sooner than DRAW_SHARE times its last drawing's
time after it, and draws the extensions' PNGs at most every IMAGE_SECONDS (or DRAW_SHARE times their
drawing time) while the run goes. It reads nothing but the run directory, so it serves a finished
run, an incomplete one, and one that another machine writes into a shared folder.

`emulate --watch` starts it beside a run, in a process of its own on a socket the run bound (so a
port in use is bad input before any work), with `--follow PID` (the run's): it then stops once the
run has finished and a page has been sent its summary, or no page asked for it within FOLLOW_GRACE
seconds, or the run's process is gone.
"""
from __future__ import annotations

import argparse
import functools
import io
import json
import os
import socket
import sys
import threading
import time
import webbrowser
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from plotly.io.json import to_json_plotly
from plotly.offline import get_plotlyjs

from .charts import charts, warm_up
from .drawing import DPI
from .extensions import extension_figures
from .output import ArgumentsError, Parser, fail
from .report import comparison, headers
from .rundir import RunDirError, read_run

PROG = "emulate watch"
HOST = "127.0.0.1"  # never another interface: the page shows a run's settings and results
POLL_SECONDS = 1.0
IMAGE_SECONDS = 10.0
DRAW_SHARE = 10
FOLLOW_GRACE = 3.0
PAGE = Path(__file__).with_name("watch.html")


class RunPage:
    """What the page shows of one run directory: drawn again after a file in it changed, but no sooner than
    DRAW_SHARE times the last drawing's time after it (the server takes at most a 1/DRAW_SHARE share of a core;
    a large run's page is redrawn less often), except when summary.json lands."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.RLock()  # current() refreshes under it
        self.version = 0
        self.state = b""
        self.images: dict[str, bytes] = {}
        self.finished = False
        self.summary_drawn = False  # drawn since summary.json landed (at once then, whatever the pacing)
        self.asked = time.monotonic()  # when a page last asked for the state
        self.shown_final = False  # a page has been sent the finished run's state, whole
        self.images_version = 0
        self._seen: tuple = ()
        self._next_draw = 0.0  # time.monotonic() from which the state may be drawn again
        self._next_images = 0.0  # ... and the extensions' PNGs
        self._images_stale = False  # the run changed since they were drawn

    def signature(self) -> tuple:
        """The run directory's files with their sizes and modification times."""
        files = []
        for path in self.path.iterdir() if self.path.is_dir() else ():
            try:
                stat = path.stat()
            except OSError:  # replaced or removed meanwhile: the next look sees it
                continue
            files.append((path.name, stat.st_size, stat.st_mtime_ns))
        return tuple(sorted(files))

    def current(self, since: int) -> tuple[bytes, bool]:
        """The state as JSON (only its version when the page already has it), and whether it is the finished run's."""
        with self.lock:
            self.asked = time.monotonic()
            self.refresh()
            body = self.state if since != self.version else json.dumps({"version": self.version}).encode()
            return body, self.finished

    def refresh(self) -> None:
        """Draw the state again if it is due."""
        with self.lock:
            if self._due():
                self.version += 1
                start = time.monotonic()
                self.state = self._draw().encode()
                end = time.monotonic()
                self._next_draw = end + DRAW_SHARE * (end - start)

    def _due(self) -> bool:
        seen = self.signature()
        landed = not self.summary_drawn and (self.path / "summary.json").exists()
        if landed or (time.monotonic() >= self._next_draw and (seen != self._seen or self._images_stale)):
            self._seen = seen
            self.summary_drawn |= landed
            return True
        return False

    def _draw(self) -> str:
        try:
            run = read_run(self.path, partial=True)
            self.finished = not run.incomplete
            self._draw_images(run)
            state = {"version": self.version, "status": "finished" if self.finished else "running",
                     "name": run.name, "protocol": run.protocol, "topology": run.topology, "nodes": run.num_nodes,
                     "charts": charts(run), "images": {"version": self.images_version, "names": sorted(self.images)},
                     "report": {"headers": headers([run])[0], "cells": comparison([run])[0][0]}}
        except (RunDirError, OSError, ValueError, KeyError, TypeError) as exc:  # not started, or a file half written
            return json.dumps({"version": self.version, "status": "waiting", "name": self.path.name,
                               "note": f"{type(exc).__name__}: {exc}".splitlines()[0]})
        return to_json_plotly(state)

    def _draw_images(self, run) -> None:
        """The extensions' figures, at most every IMAGE_SECONDS (or DRAW_SHARE times their drawing time) while the
        run goes, and once more when it has finished."""
        start = time.monotonic()
        self._images_stale = not self.finished and start < self._next_images
        if self._images_stale:
            return
        self.images = dict(self._images(run))  # a new dict: the handler's threads read the old one meanwhile
        self.images_version += 1
        end = time.monotonic()
        self._next_images = end + max(IMAGE_SECONDS, DRAW_SHARE * (end - start))

    @staticmethod
    def _images(run):
        """The extensions' figures of the run as it stands, as PNG bytes; an extension whose figures fail on the run
        as it stands (a file half written) is left out of this drawing."""
        for figures in extension_figures():
            try:
                for name, fig in figures(run):
                    buffer = io.BytesIO()
                    fig.savefig(buffer, format="png", dpi=DPI)
                    yield name, buffer.getvalue()
            except Exception:  # noqa: BLE001 - another package's code, on a run half written: the next drawing
                continue


def handler(page: RunPage) -> type[BaseHTTPRequestHandler]:
    """The page's routes: / (the page), /plotly.js, /state.json?since=VERSION and /image/NAME."""
    html = PAGE.read_text().replace("{{POLL_MS}}", str(int(POLL_SECONDS * 1000))).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            request = urlparse(self.path)
            name = request.path.removeprefix("/image/")
            if request.path == "/":
                self._send(html, "text/html; charset=utf-8")
            elif request.path == "/plotly.js":
                self._send(plotly_js(), "text/javascript; charset=utf-8")
            elif request.path == "/state.json":
                body, finished = page.current(_version(parse_qs(request.query).get("since", [""])[0]))
                self._send(body, "application/json")
                page.shown_final |= finished  # once written: `--follow` may stop the server after this
            elif request.path.startswith("/image/") and (image := page.images.get(name)) is not None:
                self._send(image, "image/png")
            elif request.path == "/favicon.ico":
                self.send_response(HTTPStatus.NO_CONTENT)
                self.end_headers()
            else:
                self.send_error(HTTPStatus.NOT_FOUND)

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 - the base class's name; no line per request
            pass

    return Handler


def _version(text: str) -> int:
    """The version the page has (-1: none)."""
    try:
        return int(text)
    except ValueError:
        return -1


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A page closed or reloaded mid-answer is no error; anything else is printed as the base class does."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@functools.cache
def plotly_js() -> bytes:
    """Plotly.js as the plotly package ships it, read on the page's first load."""
    return get_plotlyjs().encode()


def bind(port: int) -> socket.socket:
    """A listening socket on HOST:port (0: a free port); ArgumentsError when it is taken."""
    try:
        return socket.create_server((HOST, port))
    except OSError as exc:
        raise ArgumentsError(f"port {port}: {exc.strerror or exc}") from None
    except OverflowError:
        raise ArgumentsError(f"port {port}: expected 0..65535") from None


def url(sock: socket.socket) -> str:
    return f"http://{HOST}:{sock.getsockname()[1]}/"


def serve(path: Path, sock: socket.socket, run_pid: int | None = None) -> None:
    """Serve the page of the run at `path` on `sock` until Ctrl-C; with `run_pid` (the run's process, `--follow`),
    until the run has finished and a page has shown it (or none asked within FOLLOW_GRACE seconds), or the run's
    process is gone."""
    warm_up()
    page = RunPage(path)
    server = Server((HOST, 0), handler(page), bind_and_activate=False)
    server.socket.close()
    server.socket = sock  # bound already: by `emulate --watch` before its work, or by main()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    try:
        while run_pid is None or not _followed(page, path, run_pid):
            if not page.summary_drawn and (path / "summary.json").exists():
                page.refresh()  # the finished run's state, drawn before a page asks for it
            time.sleep(0.2)
    finally:
        server.shutdown()
        server.server_close()


def _followed(page: RunPage, path: Path, run_pid: int) -> bool:
    """The run finished and a page was shown so, or no page is asking; or the run's process is gone (killed)."""
    if os.getppid() != run_pid:
        return True
    if not (path / "summary.json").exists():
        return False
    return page.shown_final or time.monotonic() - page.asked > FOLLOW_GRACE


def parse(argv: list[str]):
    parser = Parser(prog=PROG, description="A page on 127.0.0.1 that follows a run directory as it streams.")
    parser.add_argument("run", metavar="RUN_DIR", help="a run directory, finished or still being written")
    parser.add_argument("--port", type=int, default=0, help="the port to serve on (default: a free one)")
    parser.add_argument("--open", action="store_true", help="open the page in the default browser")
    parser.add_argument("--follow", type=int, metavar="PID", help=argparse.SUPPRESS)  # `emulate --watch`: its pid
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)  # the socket `emulate --watch` bound
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
        path = Path(args.run)
        if not path.is_dir():
            raise ArgumentsError(f"{path}: no such run directory")
        if not (path / "config.yaml").is_file():
            raise ArgumentsError(f"{path}: not a run directory (no config.yaml)")
        sock = socket.socket(fileno=args.fd) if args.fd is not None else bind(args.port)
    except ArgumentsError as exc:
        fail(PROG, str(exc))
        return 2
    if args.follow is None:
        print(f"{PROG}: {url(sock)} follows {path} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    if args.open:
        webbrowser.open(url(sock))
    try:
        serve(path, sock, args.follow)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":  # `emulate --watch` starts the server so, without the command's imports
    sys.exit(main(sys.argv[1:]))
