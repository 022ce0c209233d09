"""A shaped network of n nodes on one machine: one network namespace per node, for real TCP processes.

Layout. Node i runs in namespace `p2pe<pid>n<i>` (pid: the launcher's) with one interface, `eth0`,
addressed 10.77.x.y/16 where x.y is i+1 (node 0 is 10.77.0.1). The other end of its veth pair, `v<i>`,
lives in the hub namespace `p2pe<pid>hub`, enslaved to a Linux bridge there. Nothing is made in the
root namespace. A bridge takes at most 1023 ports, so nodes are attached in groups of
PORTS_PER_BRIDGE to bridges `b<g>`, and more than one group are joined by unshaped veths to a `core`
bridge.

What is shaped where (tc shapes what leaves an interface; everything else runs at veth speed):
- node i's uplink, and its per-link bandwidths, on eth0's egress in its namespace: an htb root class
  at the uplink rate; with per-link bandwidths, one child class per capped destination (picked by a
  u32 filter on the destination address) whose ceiling is min(bandwidth, uplink), and a default child
  for all other traffic. The children borrow from the root, so they share the uplink. Everything the
  node sends counts: its data, its ACKs for what it receives, ARP.
- node i's downlink on v<i>'s egress in the hub namespace (toward the node): an htb class at that rate.
  It carries what others send to node i, and the ACKs of what node i sends.
- an unshaped node (infinite uplink, no per-link bandwidths; infinite downlink) gets no qdisc.
A shaped class queues in a FIFO of 1000 packets (the veth's txqueuelen), so a saturated link builds
queueing delay, and TCP sharing a link behaves as TCP does: no fairness is enforced between flows.

tc counts link-layer bytes: the Ethernet header (14), IP (20) and TCP (20, plus 12 of timestamps)
headers count with the payload, not preamble or frame check sequence. A full segment carries 1448 bytes
of payload in 1514 counted bytes, so TCP's payload goodput is at most 1448/1514 = 0.956 of a rate.

Latency is not made here: this kernel has no netem. The application adds each link's latency itself
(emulator.tcp holds a frame for its latency sample after its last byte is read).

A launcher that is killed leaves its namespaces behind; `cleanup_stale` (run by every Testbed on
entry) deletes those whose launcher pid is no longer alive.
"""
from __future__ import annotations

import atexit
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

PREFIX = "p2pe"
_OURS = re.compile(rf"{PREFIX}(\d+)(?:n\d+|hub|probe)")
MAX_NODES = 65000  # addresses 10.77.0.1 .. 10.77.253.232; htb class minors stay under 0xffff
PORTS_PER_BRIDGE = 1000  # a Linux bridge takes at most 1023 ports (BR_MAX_PORTS)
FRAME = 1514  # bytes tc counts for a full-size TCP segment: Ethernet 14 + IP 20 + TCP 32 + payload 1448
# Burst: the bytes a class may send at once above its rate; an idle class has them saved up, so a
# transfer ends up to burst/rate early. tc's default is tuned for throughput; here a rate should hold
# over short transfers, so the burst is 2 frames (2.4 ms at 10 Mbit/s, 24 ms at 1 Mbit/s, 0.24 s at
# 100 kbit/s), or 1 ms of the rate where that is more (above 24 Mbit/s), so that htb's timer need not
# fire for every frame. Not 1 frame: a timer that fires late then loses what it saved up. Measured:
# 2 frames held 10 Mbit/s over 4 MiB as well as 4 or 16 did, and 1 Mbit/s ended 14-18 ms early on
# 0.5 MiB against 44 ms with 4 frames and 188 ms with 16.
BURST_FRAMES = 2
BURST_SECONDS = 0.001
UNSHAPED = 100e9  # bit/s: the root class when the uplink is infinite but per-link caps need a tree
DEFAULT_CLASS, FIRST_LINK_CLASS = 2, 16  # htb minors: 1 the root, 2 the default child, 16+j destination j


def unavailable() -> str | None:
    """Why namespaces cannot be used here (not root, no `ip`/`tc`, `ip netns add` fails), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _run(["ip", "netns", "add", probe])
    except RuntimeError as error:
        return f"cannot add a network namespace: {error}"
    try:  # what a Testbed needs inside: a bridge, a veth pair, an htb qdisc
        _run(["ip", "-n", probe, "-batch", "-"], ["link add name b type bridge", "link add name v type veth peer name w"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "v", "root", "handle", "1:", "htb"])
    except RuntimeError as error:
        return f"network namespaces lack a feature: {error}"
    finally:
        _run(["ip", "netns", "del", probe])
    return None


def cleanup_stale() -> list[str]:
    """Delete the namespaces of earlier launchers that are gone (no /proc/<pid>); their names."""
    stale = [name for name in _namespaces() if (pid := _launcher(name)) is not None
             and pid != os.getpid() and not os.path.exists(f"/proc/{pid}")]
    _delete(stale)
    return stale


class Testbed:
    """A context manager. Testbed(n, uplink, downlink, bandwidth) with
    uplink, downlink: list of n rates in bit/s (math.inf = unshaped),
    bandwidth: dict[(src, dst)] -> bit/s for each directed link that is shaped (math.inf or missing =
    not shaped per link).
    """

    cleanup_stale = staticmethod(cleanup_stale)

    def __init__(self, n: int, uplink: Sequence[float], downlink: Sequence[float],
                 bandwidth: Mapping[tuple[int, int], float] | None = None):
        if not 1 <= n <= MAX_NODES:
            raise ValueError(f"Testbed: n={n}, expected 1..{MAX_NODES}")
        if len(uplink) != n or len(downlink) != n:
            raise ValueError(f"Testbed: {len(uplink)} uplinks and {len(downlink)} downlinks for {n} nodes")
        for rate in [*uplink, *downlink, *(bandwidth or {}).values()]:
            _check_rate(rate)
        caps = {link: rate for link, rate in (bandwidth or {}).items() if rate != math.inf}
        for src, dst in caps:
            if not (0 <= src < n and 0 <= dst < n and src != dst):
                raise ValueError(f"Testbed: bandwidth for link ({src}, {dst}) of {n} nodes")
        self.n, self.uplink, self.downlink = n, list(uplink), list(downlink)
        self.caps: dict[int, dict[int, float]] = {}  # src -> {dst: bit/s}
        for (src, dst), rate in sorted(caps.items()):
            self.caps.setdefault(src, {})[dst] = rate
        self._shaped_downlinks = sum(rate != math.inf for rate in self.downlink)
        self.hub = f"{PREFIX}{os.getpid()}hub"
        self._made: list[str] = []  # namespaces this Testbed added, the only ones it deletes

    def __enter__(self) -> Testbed:
        cleanup_stale()
        names = [self.hub, *(self.namespace(i) for i in range(self.n))]
        if clash := set(names) & set(_namespaces()):  # another Testbed of this process: leave it alone
            raise RuntimeError(f"Testbed: namespace {min(clash)} exists (one Testbed per process at a time)")
        atexit.register(self.remove)
        try:
            self._made = names  # from here on every one of them is ours to delete
            _run(["ip", "-batch", "-"], [f"netns add {name}" for name in names])
            _run(["ip", "-n", self.hub, "-batch", "-"], self._hub_links())
            # In parallel: each `ip -n`/`tc -n` process copies the mount namespace, which holds one mount per
            # network namespace, so a node costs 15 ms at 200 nodes and 20 ms at 1100 (2 busy CPUs).
            with ThreadPoolExecutor(os.cpu_count()) as pool:
                list(pool.map(self._set_up_node, range(self.n)))
            if downlinks := self._downlink_shaping():
                _run(["tc", "-n", self.hub, "-batch", "-"], downlinks)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.remove()

    def remove(self) -> None:
        """Delete every namespace this Testbed made (their interfaces go with them)."""
        atexit.unregister(self.remove)
        made, self._made = self._made, []
        _delete(made)

    def namespace(self, node: int) -> str:
        """The node's namespace's name."""
        self._check_node(node)
        return f"{PREFIX}{os.getpid()}n{node}"

    def address(self, node: int) -> str:
        """The node's IPv4 address: 10.77.x.y with x.y = node+1."""
        self._check_node(node)
        return f"10.77.{(node + 1) >> 8}.{(node + 1) & 255}"

    def command(self, node: int, argv: list[str]) -> list[str]:
        """argv wrapped to run inside the node's namespace."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.n:
            raise ValueError(f"Testbed: node {node} of {self.n}")

    # -- building -------------------------------------------------------------------

    def _hub_links(self) -> list[str]:
        """ip commands in the hub: the bridges, and each node's veth pair with its hub end on one."""
        groups = range(math.ceil(self.n / PORTS_PER_BRIDGE))
        lines = ["link set lo up"]
        for g in groups:  # forward_delay 0: STP is off, so a port forwards at once
            lines += [f"link add name b{g} type bridge forward_delay 0", *_up(f"b{g}")]
        if len(groups) > 1:
            lines += ["link add name core type bridge forward_delay 0", *_up("core")]
            for g in groups:
                lines += [f"link add name t{g} type veth peer name c{g}", f"link set t{g} master b{g}",
                          f"link set c{g} master core", *_up(f"t{g}"), *_up(f"c{g}")]
        for i in range(self.n):
            lines += [f"link add name v{i} type veth peer name eth0 netns {self.namespace(i)}",
                      f"link set v{i} master b{i // PORTS_PER_BRIDGE}", *_up(f"v{i}")]
        return lines

    def _set_up_node(self, i: int) -> None:
        namespace = self.namespace(i)
        one_frame = ["link set eth0 gso_max_segs 1"] if self._crosses_shaping(i) else []  # see GSO below
        _run(["ip", "-n", namespace, "-batch", "-"], [
            "link set lo up", *one_frame, f"addr add {self.address(i)}/16 dev eth0", *_up("eth0")])
        if uplink := self._uplink_shaping(i):
            _run(["tc", "-n", namespace, "-batch", "-"], uplink)

    def _crosses_shaping(self, i: int) -> bool:
        """Whether what node i sends may meet a shaped class: its own uplink or caps, or another's downlink."""
        others = self._shaped_downlinks - (self.downlink[i] != math.inf)
        return self.uplink[i] != math.inf or i in self.caps or others > 0

    def _uplink_shaping(self, i: int) -> list[str]:
        """tc commands for node i's eth0: its uplink, and its per-link caps as children sharing it."""
        uplink, caps = self.uplink[i], self.caps.get(i, {})
        if not caps:
            if uplink == math.inf:
                return []
            return ["qdisc add dev eth0 root handle 1: htb default 1", _htb_class("eth0", "1:", "1:1", uplink)]
        root = uplink if uplink != math.inf else UNSHAPED
        share = root / (len(caps) + 1)  # each child's guaranteed rate; above it a child borrows from the root
        lines = [f"qdisc add dev eth0 root handle 1: htb default {DEFAULT_CLASS:x}",
                 _htb_class("eth0", "1:", "1:1", root),
                 _htb_class("eth0", "1:1", f"1:{DEFAULT_CLASS:x}", root, rate=share)]
        for dst, bandwidth in caps.items():
            ceil = min(bandwidth, root)
            classid = f"1:{FIRST_LINK_CLASS + dst:x}"
            lines += [_htb_class("eth0", "1:1", classid, ceil, rate=min(share, ceil)),
                      f"filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst {self.address(dst)}/32 "
                      f"flowid {classid}"]
        return lines

    def _downlink_shaping(self) -> list[str]:
        """tc commands in the hub: each shaped downlink on the egress of the node's hub-side veth."""
        lines = []
        for i, rate in enumerate(self.downlink):
            if rate != math.inf:
                lines += [f"qdisc add dev v{i} root handle 1: htb default 1", _htb_class(f"v{i}", "1:", "1:1", rate)]
        return lines


# GSO: a veth offers TSO, so TCP would hand it segments of up to 64 KB, and htb would take one whole
# (counting the headers of every frame in it) and then owe for it: at 10 Mbit/s a 64 KB segment is 52 ms
# of the link at once, and a transfer ends up to that much early (measured: 1 MiB at 10 Mbit/s 2-4%
# early and uneven, against within 0.6% with one frame per segment). gso_max_segs 1 on a node's eth0
# makes TCP build one frame per segment, so tc sees what a real link would. It costs CPU (an unshaped
# veth carried ~0.6 Gbit/s instead of 4-6), so a node whose traffic meets no shaped class keeps GSO.
# (GRO is off on a veth unless XDP or ethtool turns it on; ethtool is not needed.)


def _up(dev: str) -> list[str]:
    """ip commands that bring an interface up without an IPv6 link-local address (set before up, or the
    kernel gives it one): no IPv6 DAD, router solicitations or MLD reports in the shaped queues."""
    return [f"link set {dev} addrgenmode none", f"link set {dev} up"]


def _htb_class(dev: str, parent: str, classid: str, ceil: float, rate: float | None = None) -> str:
    """An htb class line: rate (default: ceil) guaranteed, up to ceil with borrowing, small bursts."""
    rate = ceil if rate is None else rate
    return (f"class add dev {dev} parent {parent} classid {classid} htb rate {_bits(rate)} ceil {_bits(ceil)} "
            f"burst {_burst(rate)} cburst {_burst(ceil)} quantum {FRAME}")  # quantum: children take turns frame by frame


def _bits(rate: float) -> str:
    return f"{max(1, round(rate))}bit"


def _burst(rate: float) -> int:
    return max(BURST_FRAMES * FRAME, round(rate * BURST_SECONDS / 8))


def _check_rate(rate: float) -> None:
    if not float(rate) > 0:  # NaN fails too
        raise ValueError(f"Testbed: rate {rate!r} bit/s, expected > 0 or math.inf")


# -- ip and tc ---------------------------------------------------------------------------


def _run(argv: list[str], lines: list[str] | None = None) -> str:
    """Run an ip or tc command, with `lines` on its stdin for -batch; a failure is a RuntimeError naming it."""
    stdin = None if lines is None else "".join(line + "\n" for line in lines)
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise RuntimeError(f"{argv[0]}: not found") from None
    except subprocess.CalledProcessError as failed:
        raise RuntimeError(f"{_named(argv, lines, failed.stderr)}: {_one_line(failed.stderr)}") from None


def _named(argv: list[str], lines: list[str] | None, stderr: str) -> str:
    """The command that failed: argv, and for a batch the line it stopped at ("Command failed -:N")."""
    found = re.search(r"Command failed -:(\d+)", stderr)
    if lines and found and 0 < int(found[1]) <= len(lines):
        return f"{' '.join(argv)} at `{lines[int(found[1]) - 1]}`"
    return " ".join(argv)


def _one_line(stderr: str) -> str:
    kept = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("Command failed")]
    return "; ".join(kept) or "failed"


def _namespaces() -> list[str]:
    """Names of the machine's network namespaces."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _launcher(name: str) -> int | None:
    """The pid of the launcher that named a namespace of ours; None for anyone else's."""
    found = _OURS.fullmatch(name)
    return int(found[1]) if found else None


def _delete(names: list[str]) -> None:
    """Delete these namespaces; those already gone are fine."""
    if not names:
        return
    try:  # -force: go on past a name already gone
        _run(["ip", "-force", "-batch", "-"], [f"netns del {name}" for name in names])
    except RuntimeError:
        left = set(names) & set(_namespaces())
        if left:
            raise RuntimeError(f"Testbed: could not delete namespaces {sorted(left)[:5]}") from None
