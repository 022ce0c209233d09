"""Settings: the emulator's own (network, clock, compute, output), resolved once at the edge.

`resolve` turns a mapping of settings (config file and flags, or `run(**settings)`)
into a checked RunConfig and the protocol's options; the builders here make the
emulator's objects from it (links, per-node capacities, the compute model), with
the spec parsers of specs.py. Nothing below p2p_emulator/ parses a setting.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tomllib
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import yaml

from emulator import units
from emulator.compute import ComputeModel, physical_memory
from emulator.errors import UsageError
from emulator.links import LOSS_MODELS, OVERHEADS, LinkSpec
from emulator.seeds import Seeds

from .analysis.trackers import TrackerError, destinations
from .scenario import check as check_dynamics
from .workloads.profiles import ProfileError, node_profiles
from .specs import node_rates, parse_adversaries, parse_corrupt, parse_delay, parse_loss, slowdowns


class ConfigError(UsageError):
    """A bad emulator setting."""


@dataclass
class RunConfig:
    protocol: str = "mapl"
    topology: str = "mesh"
    nodes: int | None = None  # unset: DEFAULT_NODES, or the count of a topology or schedule file
    rounds: int | None = None  # unset: DEFAULT_ROUNDS, or no limit with --duration
    duration: float = 0.0
    eval_every_seconds: float = 0.0
    seed: int = 0
    clock: str = "virtual"
    transport: str = "emulated"
    time_scale: float = 1.0
    latency: str = "10ms"
    bandwidth: str = "100Mbps"
    loss: str = "0"
    loss_model: str = "reliable"
    corrupt: str = "0"
    no_checksum: bool = False
    adversaries: str = "none"
    uplink: str = "inf"
    downlink: str = "inf"
    link_sharing: str = "fifo"
    link_overhead: str = "none"
    compress: str = "none"
    max_message_size: str = "256MB"
    compute_time: str = "counted"
    compute_profile: str = "reference"
    compute_cost: str = "1ms"
    compute_factor: float = 1.0
    compute_speed: str = "constant"
    churn: str = "none"
    crash: str = "none"
    availability: str = ""
    link_failures: str = "none"
    partition_event: str = ""
    topology_schedule: str = "none"
    device: str = "cpu"
    workers: int = 0
    executor: str = "thread"
    ray_address: str = ""
    ray_workers: int = 0
    ray_cpus_per_worker: float = 1.0
    ray_gpus_per_worker: float = 0.0
    checkpoint_every: int = 0
    out: str = ""
    overwrite: bool = False
    trace: bool = False
    no_plots: bool = False
    quiet: bool = False
    watch: bool = False
    watch_port: int = 0
    log_to: str = ""

    def __post_init__(self):
        if self.rounds is None:  # unset: a time horizon alone, or the usual count
            self.rounds = MAX_ROUNDS if self.duration else DEFAULT_ROUNDS


HELP = {
    "protocol": "protocol to run (see --list-protocols)",
    "topology": "graph: a name with parameters (ring, torus, regular:d=4, er:p=0.3, ...) or an edge-list/GraphML path",
    "nodes": "number of nodes (unset: 10, or the count of a topology or schedule file, which must agree if set)",
    "rounds": "rounds each node runs (an asynchronous protocol's node: its own steps); unset: 20, or no limit "
              "with --duration",
    "duration": "emulated seconds to run: no node starts a round (an asynchronous protocol's step) after this "
                "instant; with --rounds, whichever comes first (0: no time limit)",
    "eval_every_seconds": "every S emulated seconds, score each node's current model (charging no compute, "
                          "moving no node) into RUN_DIR/samples.jsonl with its step and traffic so far (0: never)",
    "seed": "seed of every random choice in the run",
    "clock": "virtual (emulated time; idle waits cost nothing) or real (wall clock on uvloop)",
    "transport": "emulated (links modelled), tcp (each node its own process, frames over loopback TCP, real "
                 "clock and compute) or netns (tcp between network namespaces shaped by tc to the link "
                 "settings; needs root): docs/validation.md",
    "time_scale": "real clock only: emulated seconds per wall second",
    "latency": "link latency: 20ms, uniform:low=10ms,high=30ms, normal:mean=20ms,std=5ms, lognormal:median=20ms,sigma=0.5",
    "bandwidth": "link bandwidth, SI units: 10Mbps = 10^7 bit/s; inf for unlimited",
    "loss": "loss on each link: a probability (Bernoulli) or ge:p=..,r=..[,loss_good=..,loss_bad=..] (Gilbert-Elliott), "
            "per TCP segment or per message as --loss-model says",
    "loss_model": "reliable (TCP: a lost segment is sent again, so a message arrives later, never not at all; "
                  "summary.json's bytes_resent counts what was sent again) or datagram (whole messages are lost, "
                  "cause loss: UDP-style): docs/network-model.md",
    "corrupt": "bit flips in arriving frames: a probability per message (one bit flips), or ber:1e-7 (each "
               "bit flips with that probability); with checksums the frame is dropped (cause corrupt)",
    "no_checksum": "send frames without their CRC32C: corrupted frames reach the protocol (silent corruption), "
                   "which drops what it cannot use (cause invalid)",
    "adversaries": "fraction=0.1,kind=signflip|noise:std=1|random|nan|stale|oversize: that fraction of nodes "
                   "(drawn from the seed; summary.json lists them) send an attack instead of their model",
    "uplink": "per-node uplink capacity shared by all its links: a rate, inf (none), "
              "uniform:low=1Mbps,high=10Mbps or lognormal:median=10Mbps,sigma=0.5 (drawn per node); "
              "a GraphML topology's node attribute uplink overrides it",
    "downlink": "per-node downlink capacity, as --uplink (node attribute downlink)",
    "link_sharing": "how messages share link, uplink and downlink capacity: fifo (a link sends one message at "
                    "a time, a node's uplink one at a time over all its links, a downlink takes delivery one at a "
                    "time) or fair (each link's head message is a flow; flows share uplinks and downlinks max-min "
                    "fairly, as concurrent TCP connections do; not with --checkpoint-every)",
    "link_overhead": "bytes a message puts on the wire besides its payload: none, or tcp (66 header bytes per "
                     "1448-byte segment: IP, TCP with timestamps, Ethernet, as a tc shaper counts them); "
                     "summary.json's wire_bytes totals them, the bytes counts stay the payload's",
    "compress": "wire compression of float tensors: none, fp16, bf16, q8, q4",
    "max_message_size": "messages larger than this are refused at send (e.g. 64MB)",
    "compute_time": "counted (each job's kernels, FLOPs and memory traffic, counted from the model, priced by "
                    "--compute-profile), per-sample (--compute-cost per training sample, the old 'model') or "
                    "measured (wall time x factor); each x the node's --compute-speed slowdown",
    "compute_profile": "counted compute time's device: reference (the project's 2-core machine: the same times "
                       "on any machine), host (this machine, calibrated once and cached), a training FLOP/s "
                       "figure (5e9, 12G), or a CSV with header node,profile naming one of those per node "
                       "(unlisted nodes: reference)",
    "compute_cost": "--compute-time per-sample: emulated time charged per training sample",
    "compute_factor": "measured compute time only: multiplier on wall time",
    "compute_speed": "stragglers: per-node compute slowdown, constant, uniform:low=1,high=3, "
                     "lognormal:sigma=0.5, or stragglers:fraction=0.1,slowdown=5",
    "churn": "node churn: up=60s,down=30s[,immune=0.1]: each node alternates up and down periods "
             "drawn from exponentials with these means; a fraction of nodes is immune. Offline nodes "
             "do not compute and their messages are dropped (cause offline); they rejoin with their state",
    "crash": "permanent crashes: FRACTION@TIME, e.g. 0.5@100s (which nodes: drawn from the seed)",
    "availability": "availability trace: CSV with header node,t_down,t_up (t_up empty or inf: never back)",
    "link_failures": "link failures: up=..,down=..: each edge (both directions) alternates up and down "
                     "periods drawn from exponentials; messages sent on a down edge drop (cause link_down)",
    "partition_event": "partition: t=100s:groups=0-4|5-9[:heal=200s]; several separated by ';'. Until the "
                       "heal, messages between groups drop (link_down); unlisted nodes form one more group",
    "topology_schedule": "time-varying graph: resample:every=K (a new draw of the random --topology every K "
                         "rounds; every=5s: every 5 emulated seconds, for time-driven protocols), "
                         "one-peer-exponential (directed: in round t node i sends to i+2^(t mod "
                         "log2 n)), or a CSV file round,src,dst (undirected) or round,sender,receiver "
                         "(directed), repeating (t,src,dst: from each instant t in emulated seconds); a node's "
                         "graph follows its own round (of a schedule in time: the instant)",
    "device": "cpu or cuda (cuda: one GPU worker)",
    "workers": "thread executor: threads (0: one per CPU core, or $EMULATE_CORES; a parallel sweep sets it)",
    "executor": "where nodes' compute jobs run: thread (this process), batched (this process; nodes of one "
                "architecture train and evaluate as one vectorised job) or ray (Ray workers; pip install -e '.[ray]')",
    "ray_address": "ray: a running cluster, auto or HOST:PORT (unset: start a local Ray on this machine's cores)",
    "ray_workers": "ray: worker processes, each holding its nodes' models and data (0: as many as the cluster's "
                   "CPUs and GPUs hold at --ray-cpus/gpus-per-worker, at most one per node)",
    "ray_cpus_per_worker": "ray: CPUs each worker reserves (also its torch threads)",
    "ray_gpus_per_worker": "ray: GPUs each worker reserves; a fraction (0.25) lets workers share a GPU",
    "checkpoint_every": "every K rounds, all nodes meet at a barrier and RUN_DIR/checkpoint is written; "
                        "`emulate resume RUN_DIR` continues a killed run from it (0: never)",
    "out": "run directory (default: runs/<time>-<protocol>-<topology>); it must not hold files yet",
    "overwrite": "clear an --out directory that holds files (an earlier run) before writing",
    "trace": "write messages.jsonl with one row per message",
    "no_plots": "skip the PNG plots under RUN_DIR/plots",
    "quiet": "no progress bar or summary table",
    "watch": "serve a page on 127.0.0.1 that follows the run as it goes (`emulate watch RUN_DIR` does the same "
             "for any run directory); its address is printed",
    "watch_port": "--watch's port (0: a free one)",
    "log_to": "once the run has finished, log it to tensorboard:DIR and/or mlflow[:URI] (a folder, default "
              "./mlruns), comma-separated; needs the extra p2p-emulator[tensorboard] or [mlflow]",
}

DEFAULT_NODES = 10
DEFAULT_ROUNDS = 20
MAX_CONFIG_BYTES = 1 << 20
MAX_SEED = 2**63 - 1
MAX_ROUNDS = 10**9
MAX_WORKERS = 1024
# The emulator's own state per node at the least (gossip: its node, mailbox, links and ledger
# rows on a 4-regular graph measure 13 KiB a node in ./dev bench memory); a learning protocol
# adds its models.
NODE_FLOOR_BYTES = 10 * 1024
CLOCKS = ("virtual", "real")
TRANSPORTS = ("emulated", "tcp", "netns")
# What a real transport does not emulate: the network's own loss and corruption, and no instant holds every node.
NOT_OVER_TCP = {"loss": "0", "corrupt": "0", "churn": "none", "crash": "none", "availability": "",
                "link_failures": "none", "partition_event": "", "topology_schedule": "none", "checkpoint_every": 0,
                "time_scale": 1.0, "link_sharing": "fifo", "link_overhead": "none"}
COMPUTE_TIMES = ("counted", "per-sample", "measured")
DEVICES = ("cpu", "cuda")
EXECUTORS = ("thread", "batched", "ray")
RAY_MIN_SHARE = 1e-4  # Ray refuses finer fractions of a CPU or GPU
COMPRESSIONS = ("none", "fp16", "bf16", "q8", "q4")
LINK_SHARINGS = ("fifo", "fair")
LINK_OVERHEADS = tuple(OVERHEADS)
OPTIONAL_NUMBERS = {"nodes": int, "rounds": int, "consensus_step": float}  # settings whose default None means "unset"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def default(f) -> Any:
    """A dataclass field's default value."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def read_config_file(path: str) -> dict:
    """A YAML or TOML mapping of settings; keys may be spelt with - or _.

    Bounded before it is parsed: at most MAX_CONFIG_BYTES, UTF-8, and no YAML aliases
    (settings never need them, and nested ones expand exponentially).
    """
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise UsageError(f"--config {path}: {file.stat().st_size:,} bytes, over the {MAX_CONFIG_BYTES:,}-byte limit "
                         "of a settings file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--config {path}: not a UTF-8 text file") from None
    try:
        if file.suffix != ".toml" and any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text)):
            raise UsageError(f"--config {path}: uses a YAML alias (*name); write each setting out")
        data = tomllib.loads(text) if file.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise UsageError(f"--config {path}: cannot parse: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _coerce(name: str, value: Any, default_value: Any) -> Any:
    """Values take the type of the default they replace; a list for a text setting is ';'-joined,
    false (YAML off) for one is 'none'."""
    if value is None:  # YAML null: the default
        return default_value
    if default_value is None and name in OPTIONAL_NUMBERS:
        default_value = OPTIONAL_NUMBERS[name]()
    if isinstance(default_value, int) and not isinstance(default_value, bool) and isinstance(value, (bool, float)):
        raise UsageError(f"{flag(name)} {value!r:.40}: expected an integer, not {type(value).__name__}")
    if isinstance(default_value, float):
        return _finite(name, value)
    if isinstance(default_value, str) and value is False:  # YAML off / no / false
        return "none"
    if isinstance(default_value, str) and isinstance(value, list):
        return ";".join(str(item) for item in value)
    if default_value is None or isinstance(value, type(default_value)) and not (
            isinstance(value, bool) ^ isinstance(default_value, bool)):
        return value
    try:
        if isinstance(default_value, bool):
            if str(value).lower() in ("true", "false", "1", "0", "yes", "no"):
                return str(value).lower() in ("true", "1", "yes")
            raise ValueError
        return type(default_value)(value)
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{flag(name)} {value!r:.40}: expected {type(default_value).__name__}") from None


def _finite(name: str, value: Any) -> float:
    """A float setting's value: a finite number (NaN and infinities mean a mistake, never a setting)."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number):
        raise UsageError(f"{flag(name)} {value!r:.40}: expected a finite number")
    return number


def unknown_setting(name: str, protocol: str, registry: dict[str, type]) -> UsageError:
    """The error for a setting that protocol `protocol` does not have, naming the protocols that do."""
    owners = [other for other, cls in registry.items() if name in {f.name for f in fields(cls.Options)}]
    if owners:
        return UsageError(f"{flag(name)}: not an option of protocol {protocol!r} (it is one of {', '.join(owners)})")
    return UsageError(f"{flag(name)}: not a setting of the emulator or of protocol {protocol!r}")


# where and how a run is shown, not what it computes
PRESENTATION = ("out", "overwrite", "quiet", "no_plots", "watch", "watch_port", "log_to")


# Settings added after runs were made, at the default that gives those runs' results: left out of the digest,
# so that a sweep made before them does not rerun its finished runs.
LATER_DEFAULTS = {"transport": "emulated", "link_sharing": "fifo", "link_overhead": "none",
                  "pml_losses": "cont,proto,uni"}


def config_hash(config: RunConfig, options: Any) -> str:
    """A digest of the resolved settings that decide a run's results: a sweep reruns a run whose digest changed."""
    settings = {k: v for k, v in {**asdict(config), **asdict(options)}.items()
                if k not in PRESENTATION and LATER_DEFAULTS.get(k, ...) != v}
    if config.loss == "0" and not os.path.isfile(config.topology):  # no lossy link: its loss model decides nothing
        del settings["loss_model"]
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolve(settings: dict[str, Any], registry: dict[str, type]) -> tuple[RunConfig, Any]:
    """The checked RunConfig and the chosen protocol's options from a mapping of settings.

    A setting neither the emulator nor the chosen protocol has is an error naming it
    (and the protocols that do have it).
    """
    run_fields = {f.name: default(f) for f in fields(RunConfig)}
    protocol = settings.get("protocol", run_fields["protocol"])
    if protocol not in registry:
        raise UsageError(f"--protocol {protocol!r}: unknown; choose one of {', '.join(registry)}")
    option_fields = {f.name: default(f) for f in fields(registry[protocol].Options)}
    unknown = sorted(set(settings) - set(run_fields) - set(option_fields))
    if unknown:
        raise unknown_setting(unknown[0], protocol, registry)
    run = RunConfig(**{k: _coerce(k, v, run_fields[k]) for k, v in settings.items() if k in run_fields})
    options = registry[protocol].Options(**{k: _coerce(k, v, option_fields[k])
                                            for k, v in settings.items() if k in option_fields})
    validate(run)
    check = getattr(options, "validate", None)
    if check is not None:
        check()
    return run, options


def _choice(value: str, allowed: tuple, flag: str) -> None:
    if value not in allowed:
        raise ConfigError(f"--{flag} {value!r}: choose one of {', '.join(allowed)}")


def validate(config: RunConfig) -> None:
    """Raise ConfigError naming the first bad value."""
    if config.nodes is not None:
        _within("nodes", config.nodes, 1, max_nodes())
    _within("rounds", config.rounds, 0, MAX_ROUNDS)
    for name in ("duration", "eval_every_seconds"):
        if getattr(config, name) < 0:
            raise ConfigError(f"{flag(name)} {getattr(config, name)}: must not be negative (0: off)")
    _within("seed", config.seed, 0, MAX_SEED)
    _within("workers", config.workers, 0, MAX_WORKERS)
    if not config.time_scale > 0:
        raise ConfigError(f"--time-scale {config.time_scale}: must be positive")
    if not config.compute_factor > 0:
        raise ConfigError(f"--compute-factor {config.compute_factor}: must be positive")
    _choice(config.clock, CLOCKS, "clock")
    _choice(config.transport, TRANSPORTS, "transport")
    if config.transport != "emulated":
        check_real_transport(config)
    if config.compute_time == "model":
        raise ConfigError("--compute-time model: renamed per-sample (--compute-cost per training sample); the "
                          "default is now counted, from the model's own work (docs/compute-model.md)")
    _choice(config.compute_time, COMPUTE_TIMES, "compute-time")
    try:
        node_profiles(config.compute_profile, 0, calibrate=False)
    except ProfileError as exc:
        raise ConfigError(f"--compute-profile: {exc}") from None
    _choice(config.device, DEVICES, "device")
    _choice(config.executor, EXECUTORS, "executor")
    check_ray(config)
    _within("checkpoint_every", config.checkpoint_every, 0, MAX_ROUNDS)
    if config.checkpoint_every:
        check_checkpoints(config)
    if config.executor == "batched" and config.clock != "virtual":
        raise ConfigError("--executor batched: needs --clock virtual (it batches the jobs due when every node waits)")
    _choice(config.compress, COMPRESSIONS, "compress")
    _choice(config.link_sharing, LINK_SHARINGS, "link-sharing")
    _choice(config.link_overhead, LINK_OVERHEADS, "link-overhead")
    _choice(config.loss_model, LOSS_MODELS, "loss-model")
    for name, parse in (("latency", parse_delay), ("loss", parse_loss), ("corrupt", parse_corrupt),
                         ("adversaries", parse_adversaries), ("bandwidth", units.rate),
                         ("uplink", lambda text: node_rates(text, 1, np.random.default_rng())),
                         ("downlink", lambda text: node_rates(text, 1, np.random.default_rng())),
                         ("max_message_size", units.size), ("compute_cost", units.duration),
                         ("compute_speed", lambda text: slowdowns(text, 1, np.random.default_rng()))):
        try:
            parse(getattr(config, name))
        except units.UnitError as exc:
            raise ConfigError(f"{flag(name)}: {exc}") from None
    check_dynamics(config)
    check_presentation(config)


def check_presentation(config: RunConfig) -> None:
    """--watch and --log-to."""
    _within("watch_port", config.watch_port, 0, 65535)
    if config.watch_port and not config.watch:
        raise ConfigError(f"--watch-port {config.watch_port}: the port of --watch, which is not given")
    if config.watch and config.transport != "emulated":
        raise ConfigError(f"--watch: follows a run directory as it streams; --transport {config.transport} writes "
                          "it only when its nodes end (`emulate watch RUN_DIR` shows it then)")
    try:
        destinations(config.log_to)
    except TrackerError as exc:
        raise ConfigError(str(exc)) from None


def check_checkpoints(config: RunConfig) -> None:
    """What a checkpoint cannot hold: no instant when every node waits (real clock), state on Ray workers."""
    if config.clock != "virtual":
        raise ConfigError(f"--clock {config.clock}: not with --checkpoint-every (no instant when every node waits)")
    if config.duration:
        raise ConfigError(f"--duration {config.duration:g}: not with --checkpoint-every (a node that stops at the "
                          "horizon meets no later barrier; see docs/checkpoints.md)")
    if config.executor == "ray":
        raise ConfigError("--executor ray: not with --checkpoint-every (the nodes' state lives on the workers)")
    if config.link_sharing == "fair":
        raise ConfigError("--link-sharing fair: not with --checkpoint-every (a checkpoint does not hold the flows "
                          "still sending)")


def check_real_transport(config: RunConfig) -> None:
    """A real transport runs each node in a process of its own on the wall clock, over links that carry
    every frame: the settings that only an emulated network has are refused."""
    for name, default in NOT_OVER_TCP.items():
        if getattr(config, name) != default:
            raise ConfigError(f"{flag(name)} {getattr(config, name)}: not with --transport {config.transport} "
                              "(a real network's own loss and timing apply; see docs/validation.md)")
    if config.executor != "thread":
        raise ConfigError(f"--executor {config.executor}: not with --transport {config.transport} (each node "
                          "process runs its own jobs on threads)")


def check_ray(config: RunConfig) -> None:
    """The --ray-* flags: set only with --executor ray, and each in its range."""
    ray_flags = ("ray_address", "ray_workers", "ray_cpus_per_worker", "ray_gpus_per_worker")
    if config.executor != "ray":
        changed = [name for name in ray_flags if getattr(config, name) != getattr(RunConfig, name)]
        if changed:
            raise ConfigError(f"{flag(changed[0])}: applies to --executor ray only")
        return
    _within("ray_workers", config.ray_workers, 0, MAX_WORKERS)
    if not RAY_MIN_SHARE <= config.ray_cpus_per_worker <= 1024:
        raise ConfigError(f"--ray-cpus-per-worker {config.ray_cpus_per_worker}: must be within {RAY_MIN_SHARE}..1024")
    if not (config.ray_gpus_per_worker == 0 or RAY_MIN_SHARE <= config.ray_gpus_per_worker <= 64):
        raise ConfigError(f"--ray-gpus-per-worker {config.ray_gpus_per_worker}: must be 0 or within "
                          f"{RAY_MIN_SHARE}..64")
    if config.workers:
        raise ConfigError(f"--workers {config.workers}: sizes the thread executor; with --executor ray use "
                          "--ray-workers")
    address = config.ray_address.strip()
    host, _, port = address.rpartition(":")
    if address not in ("", "auto") and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"--ray-address {config.ray_address!r:.60}: expected auto or HOST:PORT")
    if config.device == "cuda":
        raise ConfigError("--device cuda: with --executor ray, give workers GPUs with --ray-gpus-per-worker")


def _within(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        why = ""
        if name == "nodes" and value > high:
            why = (f" (this machine's {physical_memory() / 2**30:.0f} GiB hold at most that many nodes at "
                   f"{NODE_FLOOR_BYTES // 1024} KiB each, the emulator's own state)")
        raise ConfigError(f"{flag(name)} {str(value):.40}: must be within {low}..{high}{why}")


def max_nodes() -> int:
    """The most nodes this machine's memory can hold, at the emulator's own floor per node."""
    return physical_memory() // NODE_FLOOR_BYTES


def link_spec(config: RunConfig) -> LinkSpec:
    """Every link's latency, bandwidth, loss and corruption, as the flags give them."""
    return LinkSpec(parse_delay(config.latency), units.rate(config.bandwidth), parse_loss(config.loss),
                    parse_corrupt(config.corrupt))


EDGE_ATTRIBUTES = ("latency", "bandwidth", "loss", "corrupt")


def edge_specs(graph: nx.Graph, default: LinkSpec) -> dict[tuple[int, int], LinkSpec]:
    """Links with their own latency, bandwidth, loss or corruption (a topology file's edge attributes),
    both ways if undirected."""
    specs = {}
    for src, dst, attrs in graph.edges(data=True):
        if not set(EDGE_ATTRIBUTES) & set(attrs):
            continue
        try:
            spec = LinkSpec(parse_delay(attrs["latency"]) if "latency" in attrs else default.latency,
                            units.rate(attrs["bandwidth"]) if "bandwidth" in attrs else default.bandwidth,
                            parse_loss(attrs["loss"]) if "loss" in attrs else default.loss,
                            parse_corrupt(attrs["corrupt"]) if "corrupt" in attrs else default.corrupt)
        except units.UnitError as exc:
            raise ConfigError(f"{edge_origin(graph, src, dst)}: {exc}") from None
        specs[src, dst] = spec
        if not graph.is_directed():
            specs[dst, src] = spec
    return specs


def edge_origin(graph: nx.Graph, src: int, dst: int) -> str:
    """Where a topology file gave an edge: 'FILE: line N: edge U-V' in the file's own node labels."""
    labels = [str(graph.nodes[node].get("label", node)) for node in (src, dst)]
    where = graph.graph.get("source")
    line = graph.graph.get("edge_lines", {}).get(frozenset(labels))
    return f"{where or 'topology'}: {f'line {line}: ' if line else ''}edge {labels[0]}-{labels[1]}"


def capacities(graph: nx.Graph, attribute: str, default: str, seeds: Seeds) -> list[float]:
    """Per-node capacity: the node's attribute in a topology file, else the flag's value or draw."""
    rates = node_rates(default, graph.number_of_nodes(), seeds.numpy(attribute))
    for node, value in graph.nodes(data=attribute):
        if value is not None:
            try:
                rates[node] = units.rate(value)
            except units.UnitError as exc:
                raise ConfigError(f"topology node {node}: {attribute}: {exc}") from None
    return rates


def compute_model(config: RunConfig, num_nodes: int, seeds: Seeds) -> ComputeModel:
    """How long compute takes on each node: the --compute-* flags, with slowdowns drawn from the seed."""
    try:
        profiles = node_profiles(config.compute_profile, num_nodes) if config.compute_time == "counted" else ()
    except ProfileError as exc:
        raise ConfigError(f"--compute-profile: {exc}") from None
    return ComputeModel(config.compute_time, units.duration(config.compute_cost), config.compute_factor,
                        slowdowns(config.compute_speed, num_nodes, seeds.numpy("compute.speed")), profiles)


CORES_VARIABLE = "EMULATE_CORES"  # the cores a run may use; a parallel sweep gives each run its share


def cores() -> int:
    """The cores this run may use: $EMULATE_CORES, else every core of the machine."""
    return int(os.environ.get(CORES_VARIABLE) or 0) or os.cpu_count() or 1


def workers(config: RunConfig) -> int:
    if config.device == "cuda":
        return 1  # one GPU worker: jobs queue on the device instead of contending for it
    return config.workers or cores()


def max_message_bytes(config: RunConfig) -> int:
    return units.size(config.max_message_size)
