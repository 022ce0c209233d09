"""`emulate`: run one emulation from flags and/or a config file.

Settings resolve as: built-in defaults, then `--config FILE` (YAML or TOML;
`--scenario FILE` is the same), then flags. The emulator's own settings come
from `RunConfig`; the chosen protocol's come from its `Options` dataclass.
Bad input of any kind ends with one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
import tomllib
import warnings
from dataclasses import MISSING, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from . import config as cfg
from . import wire
from .clock import DeadlockError
from .errors import UsageError
from .protocol import protocols
from .units import UnitError

SUBCOMMANDS = {"report": "analysis.report", "sweep": "analysis.sweep"}
OPTIONAL_INTS = {"nodes": int}  # settings whose default None means "unset"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(message)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_field(group, name: str, default: Any, help_text: str) -> None:
    if isinstance(default, bool):
        group.add_argument(_flag(name), dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
    else:
        kind = type(default) if isinstance(default, (int, float)) else OPTIONAL_INTS.get(name, str)
        group.add_argument(_flag(name), dest=name, type=kind, default=argparse.SUPPRESS,
                           metavar=name.upper(), help=f"{help_text} (default: {default})")


def _default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def build_parser(registry: dict) -> _Parser:
    parser = _Parser(prog="emulate", description="Emulate a peer-to-peer learning protocol on a network.",
                     epilog="Subcommands: `emulate report RUN_DIR...`, `emulate sweep --grid FILE`.")
    parser.add_argument("--config", "--scenario", dest="config", metavar="FILE",
                        help="YAML or TOML file of settings (a scenario: every flag is a key); flags override it")
    parser.add_argument("--list-protocols", action="store_true", help="list the protocols and exit")
    group = parser.add_argument_group("emulator")
    for f in fields(cfg.RunConfig):
        _add_field(group, f.name, _default(f), cfg.HELP[f.name])
    seen = set(cfg.field_names())
    for name, cls in registry.items():
        group = parser.add_argument_group(f"protocol options ({name})")
        for f in fields(cls.Options):
            if f.name not in seen:
                seen.add(f.name)
                _add_field(group, f.name, _default(f), f.metadata.get("help", f.name.replace("_", " ")))
    return parser


def read_config_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        data = tomllib.loads(file.read_text()) if file.suffix == ".toml" else yaml.safe_load(file.read_text())
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise UsageError(f"--config {path}: cannot parse: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Config-file values take the type of the default they replace; a list for a text setting is ';'-joined,
    false (YAML off) for one is 'none'."""
    if value is None:  # YAML null: the default
        return default
    if default is None and name in OPTIONAL_INTS:
        default = OPTIONAL_INTS[name]()
    if isinstance(default, str) and value is False:  # YAML off / no / false
        return "none"
    if isinstance(default, str) and isinstance(value, list):
        return ";".join(str(item) for item in value)
    if default is None or isinstance(value, type(default)) and not (isinstance(value, bool) ^ isinstance(default, bool)):
        return value
    try:
        if isinstance(default, bool):
            if str(value).lower() in ("true", "false", "1", "0", "yes", "no"):
                return str(value).lower() in ("true", "1", "yes")
            raise ValueError
        return type(default)(value)
    except (TypeError, ValueError):
        raise UsageError(f"{_flag(name)} {value!r}: expected {type(default).__name__}") from None


def resolve(argv: list[str], registry: dict) -> tuple[cfg.RunConfig, Any]:
    args = vars(build_parser(registry).parse_args(argv))
    settings = read_config_file(args.pop("config")) if args.get("config") else {}
    args.pop("config", None)
    args.pop("list_protocols", None)
    settings.update(args)
    run_fields = {f.name: _default(f) for f in fields(cfg.RunConfig)}
    protocol = settings.get("protocol", run_fields["protocol"])
    if protocol not in registry:
        raise UsageError(f"--protocol {protocol!r}: unknown; choose one of {', '.join(registry)}")
    option_fields = {f.name: _default(f) for f in fields(registry[protocol].Options)}
    unknown = sorted(set(settings) - set(run_fields) - set(option_fields))
    if unknown:
        raise UsageError(f"{_flag(unknown[0])}: not a setting of the emulator or of protocol {protocol!r}")
    run = cfg.RunConfig(**{k: _coerce(k, v, run_fields[k]) for k, v in settings.items() if k in run_fields})
    options = registry[protocol].Options(**{k: _coerce(k, v, option_fields[k])
                                            for k, v in settings.items() if k in option_fields})
    cfg.validate(run)
    check = getattr(options, "validate", None)
    if check is not None:
        check()
    return run, options


def default_out_dir(run: cfg.RunConfig) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    topology = Path(run.topology).stem if "/" in run.topology else run.topology.split(":")[0]
    return Path("runs") / f"{stamp}-{run.protocol}-{topology}"


def _one_line_warnings(message, category, filename, lineno, file=None, line=None):
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings.formatwarning = _one_line_warnings
    if argv and argv[0] in SUBCOMMANDS:
        import importlib

        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    try:
        registry = protocols()
        if "--list-protocols" in argv:
            for name, cls in registry.items():
                print(f"{name:12s} {(cls.__doc__ or '').strip().splitlines()[0]}")
            return 0
        run, options = resolve(argv, registry)
        wire.keep_large_frames_in_the_heap()
        from .session import execute

        execute(run, options, registry[run.protocol], Path(run.out) if run.out else default_out_dir(run))
    except (UsageError, UnitError) as exc:
        print(f"emulate: error: {exc}", file=sys.stderr)
        return 2
    except DeadlockError as exc:  # a protocol that waits with no timeout: its bug, not bad input
        print(f"emulate: error: {exc}; the run directory is incomplete", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("emulate: interrupted; the run directory is incomplete", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
