"""A run's parts built from its settings: its topology, and the clock, network, compute and executor it runs on."""
from __future__ import annotations

import warnings
from functools import partial

import networkx as nx

import topologies
from emulator import dynamics
from emulator.adversaries import Adversaries
from emulator.checkpoint import Checkpoints
from emulator.clock import RealClock, VirtualClock
from emulator.compute import BatchedExecutor, Compute, ComputeModel, ThreadExecutor
from emulator.emulation import Emulation
from emulator.errors import UsageError
from emulator.ledger import Ledger
from emulator.network import Network
from emulator.tcp import Placement, TcpNetwork
from emulator.protocol import Protocol
from emulator.seeds import Seeds

from . import scenario as scenarios
from . import settings as cfg
from .specs import parse_adversaries


def build_topology(config: cfg.RunConfig):
    """The round-0 graph and the time-varying schedule (None for a static topology).

    A topology or schedule file owns the node count: an explicit --nodes must agree with it.
    """
    nodes = cfg.DEFAULT_NODES if config.nodes is None else config.nodes
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", topologies.TopologyWarning)
            schedule = scenarios.schedule(config, nodes)
            if schedule is not None:
                graph = schedule.graph(0)
            else:
                from_file = topologies.files.looks_like_path(config.topology.strip())
                graph = topologies.build(config.topology, config.nodes if from_file else nodes,
                                         Seeds(config.seed).integer("topology"))
    except topologies.TopologyError as exc:  # a file's error names the file already
        raise UsageError(str(exc) if config.topology in str(exc) else f"--topology {config.topology}: {exc}") from None
    if schedule is not None and config.nodes is not None and schedule.num_nodes != config.nodes:
        raise UsageError(f"--topology-schedule {config.topology_schedule}: has {schedule.num_nodes} nodes but "
                         f"--nodes {config.nodes}; leave --nodes unset to use the file's node count")
    for warning in caught:
        warnings.warn(str(warning.message), warning.category)
    return graph, schedule


def build_emulation(config: cfg.RunConfig, graph: nx.Graph, protocol: Protocol,
                    executor, scenario: dynamics.Scenario | None = None,
                    on_round=lambda rnd, now: None, checkpointing: Checkpoints | None = None,
                    compute_model: ComputeModel | None = None, placement: Placement | None = None) -> Emulation:
    """The clock, network, compute and availability the settings ask for, and the emulation over them
    (compute_model: the one the settings make, when the caller has made it already; placement: the one
    node this process runs over TCP, on the wall clock)."""
    n = graph.number_of_nodes()
    scenario = scenario if scenario is not None else scenarios.scenario(config, n, scenarios.schedule(config, n))
    seeds = Seeds(config.seed)
    clock = RealClock(config.time_scale) if config.clock == "real" or placement else VirtualClock()
    try:
        spec = cfg.link_spec(config)
        make_network = partial(TcpNetwork, placement=placement) if placement else Network
        network = make_network(graph, clock, Ledger(trace=config.trace), spec, seeds,
                               edge_specs=cfg.edge_specs(graph, spec),
                               uplink=cfg.capacities(graph, "uplink", config.uplink, seeds),
                               downlink=cfg.capacities(graph, "downlink", config.downlink, seeds),
                               compress=config.compress, max_message_bytes=cfg.max_message_bytes(config),
                               schedule=scenario.schedule,
                               faults=dynamics.LinkFaults(scenario, seeds) if scenario.links_change else None,
                               nodes_change=scenario.nodes_change, checksum=not config.no_checksum,
                               adversaries=_adversaries(config, n, seeds), sharing=config.link_sharing,
                               overhead=config.link_overhead, loss_model=config.loss_model)
        availability = (dynamics.Availability(scenario, network.online, clock, seeds)
                        if scenario.nodes_change else None)
        compute_model = compute_model or cfg.compute_model(config, n, seeds)
        compute = Compute(compute_model, clock, availability, executor)
        return Emulation(protocol, network, clock, compute, config.rounds, seeds, availability, on_round,
                         checkpointing, config.duration, config.eval_every_seconds,
                         placement.node if placement else None)
    except BaseException:  # bad input met while building (a file's edge attribute): the loop never runs
        clock.loop.close()
        raise


def make_executor(config: cfg.RunConfig):
    """Where the nodes' jobs run: threads here, or Ray workers (started or joined here)."""
    if config.executor == "ray":
        from emulator.ray_executor import RayExecutor

        return RayExecutor(nodes=config.nodes, address=config.ray_address.strip(), workers=config.ray_workers,
                           cpus_per_worker=config.ray_cpus_per_worker, gpus_per_worker=config.ray_gpus_per_worker)
    if config.executor == "batched":
        from .workloads.batched import BATCHERS, SHORTCUTS

        return BatchedExecutor(cfg.workers(config), BATCHERS, SHORTCUTS)
    return ThreadExecutor(cfg.workers(config))


def _adversaries(config: cfg.RunConfig, n: int, seeds: Seeds) -> Adversaries | None:
    spec = parse_adversaries(config.adversaries)
    return Adversaries(spec, n, seeds) if spec is not None else None
