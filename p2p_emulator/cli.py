"""`emulate`: run one emulation from flags and/or a config file.

Settings resolve as: built-in defaults, then `--config FILE` (YAML or TOML;
`--scenario FILE` is the same), then flags. The emulator's own settings come
from `RunConfig`; the chosen protocol's from its `Options` dataclass, and only
those: another protocol's flag is an error naming both. Bad input of any kind
ends with one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

from emulator import wire
from emulator.clock import DeadlockError
from emulator.errors import UsageError, WorkerLost
from emulator.protocol import protocols
from emulator.units import UnitError

from . import __version__, transport
from . import settings as cfg
from .runs import LateFailure, execute, out_dir

SUBCOMMANDS = {"report": "p2p_emulator.analysis.report:main", "sweep": "p2p_emulator.sweeps:main",
               "watch": "p2p_emulator.analysis.watch:main", "node": "p2p_emulator.cli:node_main",
               "merge": "p2p_emulator.cli:merge_main"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(message)


def _add_field(group, name: str, default: Any, help_text: str) -> None:
    if isinstance(default, bool):
        group.add_argument(cfg.flag(name), dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
    else:
        kind = type(default) if isinstance(default, (int, float)) else cfg.OPTIONAL_NUMBERS.get(name, str)
        group.add_argument(cfg.flag(name), dest=name, type=kind, default=argparse.SUPPRESS,
                           metavar=name.upper(), help=f"{help_text} (default: {default})")


def _protocol_group(parser: argparse.ArgumentParser, name: str, cls: type) -> None:
    group = parser.add_argument_group(f"protocol options ({name})")
    for f in fields(cls.Options):
        _add_field(group, f.name, cfg.default(f), f.metadata.get("help", f.name.replace("_", " ")))


def build_parser(registry: dict, protocol: str | None = None) -> _Parser:
    """The emulator's flags and those of `protocol` (None: no protocol's)."""
    parser = _Parser(prog="emulate", description="Emulate a peer-to-peer learning protocol on a network.",
                     epilog="Subcommands: `emulate report RUN_DIR...`, `emulate sweep --grid FILE`, "
                            "`emulate watch RUN_DIR`, `emulate node ...` and `emulate merge RUN_DIR` "
                            "(docs/validation.md).")
    parser.add_argument("--config", "--scenario", dest="config", metavar="FILE",
                        help="YAML or TOML file of settings (a scenario: every flag is a key); flags override it")
    parser.add_argument("--list-protocols", action="store_true", help="list the protocols and exit")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    group = parser.add_argument_group("emulator")
    for f in fields(cfg.RunConfig):
        _add_field(group, f.name, cfg.default(f), cfg.HELP[f.name])
    if protocol is not None:
        _protocol_group(parser, protocol, registry[protocol])
    return parser


def protocol_list(registry: dict) -> str:
    """One line a protocol: its name, then the first line of its docstring, in one column."""
    width = max(map(len, registry))
    return "\n".join(f"{name:{width}}  {((cls.__doc__ or '').strip().splitlines() or [''])[0]}"
                     for name, cls in registry.items())


def full_help(registry: dict) -> str:
    """The emulator's flags, then every protocol's own options with its own defaults."""
    parts = [build_parser(registry).format_help()]
    for name, cls in registry.items():
        parser = _Parser(prog="emulate", usage=argparse.SUPPRESS, add_help=False)
        _protocol_group(parser, name, cls)
        parts.append(parser.format_help().strip("\n") + "\n")
    return "\n".join(parts)


def _chosen_protocol(argv: list[str]) -> tuple[str | None, dict]:
    """The protocol the flags or the config file name (None if neither does), and the file's settings."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--config", "--scenario", dest="config")
    early.add_argument("--protocol")
    known, _ = early.parse_known_args(argv)
    from_file = cfg.read_config_file(known.config) if known.config else {}
    return known.protocol or from_file.get("protocol"), from_file


def resolve(argv: list[str], registry: dict) -> tuple[cfg.RunConfig, Any]:
    """Flags over the config file over the defaults, checked."""
    named, settings = _chosen_protocol(argv)
    protocol = named or cfg.default(next(f for f in fields(cfg.RunConfig) if f.name == "protocol"))
    if protocol not in registry:
        raise UsageError(f"--protocol {protocol!r}: unknown; choose one of {', '.join(registry)}")
    args, extra = build_parser(registry, protocol).parse_known_args(argv)
    flags = [token for token in extra if token.startswith("--")]
    if flags:
        raise cfg.unknown_setting(flags[0][2:].split("=")[0].replace("-", "_"), protocol, registry)
    if extra:
        raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
    given = vars(args)
    given.pop("config", None)
    given.pop("list_protocols", None)
    given.pop("version", None)
    return cfg.resolve({**settings, **given}, registry)


MAX_ERROR = 180  # characters of an error line: it quotes user input, which may be anything


def one_line(message: str) -> str:
    """The first line of an error, cut short."""
    first = (message.strip().splitlines() or [""])[0]
    return first if len(first) <= MAX_ERROR else first[:MAX_ERROR - 1] + "…"


def _one_line_warnings(message, category, filename, lineno, file=None, line=None):
    return f"warning: {message}\n"


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it ends as Ctrl-C does (no `except Exception` swallows it)."""


def _terminate(signum, frame):
    raise _Terminated


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings.formatwarning = _one_line_warnings
    if argv and argv[0] in SUBCOMMANDS:
        module, _, function = SUBCOMMANDS[argv[0]].partition(":")
        return getattr(importlib.import_module(module), function)(argv[1:])
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return _main(argv)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    if "--version" in argv:
        print(f"emulate {__version__}")
        return 0
    if argv[:1] == ["resume"]:
        return _reported(lambda: _resume(argv[1:]))
    return _reported(lambda: _run(argv))


def _run(argv: list[str]) -> int:
    registry = protocols()
    if "--list-protocols" in argv:
        print(protocol_list(registry))
        return 0
    if "-h" in argv or "--help" in argv:
        named, _ = _chosen_protocol([a for a in argv if a not in ("-h", "--help")])
        if named is not None and named not in registry:
            raise UsageError(f"--protocol {named!r}: unknown; choose one of {', '.join(registry)}")
        print(build_parser(registry, named).format_help() if named else full_help(registry))
        return 0
    config, options = resolve(argv, registry)
    wire.keep_large_frames_in_the_heap()
    execute(config, options, registry[config.protocol], out_dir(config))
    return 0


def _resume(argv: list[str]) -> int:
    """emulate resume RUN_DIR: continue a run from its checkpoint, with the settings in its config.yaml."""
    if len(argv) != 1 or argv[0].startswith("-"):
        raise UsageError("usage: emulate resume RUN_DIR")
    run_dir = Path(argv[0])
    if (run_dir / "summary.json").exists():
        raise UsageError(f"{run_dir}: the run finished (summary.json is there); nothing to resume")
    if not (run_dir / "config.yaml").is_file():
        raise UsageError(f"{run_dir}: not a run directory (no config.yaml)")
    registry = protocols()
    config, options = cfg.resolve(cfg.read_config_file(str(run_dir / "config.yaml")), registry)
    wire.keep_large_frames_in_the_heap()
    execute(config, options, registry[config.protocol], run_dir, resume=True)
    return 0


def node_parser() -> _Parser:
    """`emulate node`'s flags."""
    parser = _Parser(prog="emulate node", description="Run one node of a run over TCP (docs/validation.md).")
    parser.add_argument("--config", required=True, help="the run's settings (a launched run's config.yaml)")
    parser.add_argument("--id", type=int, required=True, help="this node's id")
    parser.add_argument("--listen", required=True, help="HOST:PORT this node accepts its in-neighbours on")
    parser.add_argument("--peers", required=True, help="CSV node,host,port of (at least) its out-neighbours")
    parser.add_argument("--out", required=True, help="this node's run directory")
    parser.add_argument("--start-at", type=float, default=None, help="the run's start, wall seconds since the epoch")
    parser.add_argument("--launched", action="store_true", help=argparse.SUPPRESS)
    return parser


def node_main(argv: list[str]) -> int:
    """emulate node: run one node of a run, connected to its peers over TCP, into its own directory."""
    def body() -> int:
        args = node_parser().parse_args(argv)
        registry = protocols()
        settings = cfg.read_config_file(args.config)
        settings.update(out=args.out, overwrite=True, quiet=True, no_plots=True, watch=False, log_to="")  # the run's
        config, options = cfg.resolve(settings, registry)
        if config.transport == "emulated":
            config.transport = "tcp"
        where = transport.placement(args.id, args.listen, args.peers, args.start_at, args.launched)
        execute(config, options, registry[config.protocol], Path(args.out), placement=where)
        return 0
    return _reported(body)


def merge_main(argv: list[str]) -> int:
    """emulate merge RUN_DIR: merge the node directories under RUN_DIR/nodes (nodes started on their own)."""
    def body() -> int:
        if len(argv) != 1 or not (Path(argv[0]) / "nodes").is_dir():
            raise UsageError("usage: emulate merge RUN_DIR (with the nodes' directories in RUN_DIR/nodes/<id>)")
        transport.merge(Path(argv[0]))
        return 0
    return _reported(body)


def _reported(body) -> int:
    """body(), with its failures reported in one line and the exit code they call for."""
    try:
        return body()
    except (UsageError, UnitError) as exc:
        print(f"emulate: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except (LateFailure, transport.NodeFailed) as exc:
        print(f"emulate: error: {exc}", file=sys.stderr)
        return 1
    except WorkerLost as exc:  # a Ray worker died: its nodes' state is gone, the closed rounds are on disk
        print(f"emulate: error: {one_line(str(exc))}; the run directory holds the closed rounds", file=sys.stderr)
        return 1
    except DeadlockError as exc:  # a protocol that waits with no timeout: its bug, not bad input
        print(f"emulate: error: {exc}; the run directory is incomplete", file=sys.stderr)
        return 1
    except OSError as exc:  # writing the run directory: a full disk, a directory removed under the run
        print(f"emulate: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except _Terminated:
        print("emulate: terminated; the run directory is incomplete", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("emulate: interrupted; the run directory is incomplete", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
