"""Scale: large gossip and learning runs, each in a fresh process, and start-up, against the targets of issue 39.

    ./dev bench scale [--only NAME ...] [--no-startup]

gossip-1m (a million nodes, about 8 minutes) runs only when named: --only gossip-1m.

Each run goes through the `emulate` command in a process of its own and reports:
- wall time of the whole process (interpreter start, imports, building, rounds, writing, plots);
- peak memory (peak RSS of that process, VmHWM);
- bytes per node: peak RSS minus the RSS of the same process before the run (its
  imports done: torch too for learning runs), over the node count.
randomized-gossip-100k runs about five Poisson ticks per node (--duration 5), beside gossip-100k's five
synchronous rounds; their messages per second are compared in the same session.
The throughput rows compare messages per second of the 50,000-node gossip run (messages
delivered over the emulation's wall time), and of throughput.py's message path spread over
50,000 nodes, with the small run of benchmarks/throughput.py, measured in this same session:
these machines are noisy, the ratio is the figure.
Start-up: the whole `emulate` command of a 16-node dfedavgm run on digits with --rounds 0
against a plain script that imports torch, loads digits and builds 16 MLPs (medians of 5,
each in a fresh process, alternating).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

GIB = 2**30
GOSSIP = ["--protocol", "gossip", "--topology", "regular:d=4", "--dim", "8"]
RANDOMIZED = ["--protocol", "randomized-gossip", "--topology", "regular:d=4"]  # about 5 ticks per node
DIGITS = ["--protocol", "dfedavgm", "--dataset", "digits", "--partition", "iid", "--rounds", "3", "--no-plots"]
RUNS = {  # name: (emulate flags, nodes, target wall s, target peak GiB)
    "gossip-16-plots": ([*GOSSIP, "--nodes", "16", "--rounds", "5"], 16, 1.2, None),
    "gossip-10k-plots": ([*GOSSIP, "--nodes", "10000", "--rounds", "20"], 10_000, 60, 2),
    "gossip-100k": ([*GOSSIP, "--nodes", "100000", "--rounds", "5", "--no-plots"], 100_000, 45, 2),
    "randomized-gossip-100k": ([*RANDOMIZED, "--nodes", "100000", "--duration", "5", "--no-plots"], 100_000, None, 2),
    "dfedavgm-1000": ([*DIGITS, "--model", "cnn-small", "--topology", "regular:d=4", "--nodes", "1000"], 1000, None, 4),
    "dfedavgm-mesh-256": ([*DIGITS, "--model", "mlp", "--topology", "mesh", "--nodes", "256"], 256, None, 4),
    "gossip-50k": ([*GOSSIP, "--nodes", "50000", "--rounds", "5", "--no-plots"], 50_000, None, None),
    "gossip-1m": ([*GOSSIP, "--nodes", "1000000", "--rounds", "3", "--no-plots"], 1_000_000, 600, 16),
}
DEFAULT = [name for name in RUNS if name != "gossip-1m"]
# Of the small run's messages per second: the message path over 50,000 nodes, and 50,000-node gossip.
PATH_TARGET, GOSSIP_TARGET = 0.8, 0.5
# Of 100k-node synchronous gossip's messages per second (the same run of this script): 100k-node randomized gossip,
# whose exchanges each take a request and an answer, at instants of their own.
RANDOMIZED_TARGET = 1.0
STARTUP = ["--protocol", "dfedavgm", "--dataset", "digits", "--nodes", "16", "--rounds", "0", "--quiet"]
PLAIN_START = """
import torch
from sklearn.datasets import load_digits
digits = load_digits()
x, y = torch.tensor(digits.data, dtype=torch.float32), torch.tensor(digits.target)
models = [torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
          for _ in range(16)]
"""
STARTUP_TARGET = 0.5  # seconds more than the plain script
PATH_NODES, PATH_MESSAGES = 50_000, 20  # the message path alone at scale: 1M messages


def _rss() -> int:
    """Resident bytes of this process now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """Peak resident bytes of this process (VmHWM): unlike getrusage's ru_maxrss, it does not keep
    the high-water mark of the parent it was forked from before exec."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def child(name: str) -> dict:
    """One run in this process; what the parent tabulates."""
    from p2p_emulator.cli import main as emulate

    flags, nodes, *_ = RUNS[name]
    if "--dataset" in flags:
        import torch  # noqa: F401  what a learning run loads anyway: not the nodes' memory
        import p2p_emulator.workloads.models  # noqa: F401
    before = _rss()
    with tempfile.TemporaryDirectory() as out:
        status = emulate([*flags, "--quiet", "--out", out])
        summary = json.loads((Path(out) / "summary.json").read_text())
    peak = peak_rss()
    return {"status": status, "peak": peak, "per_node": (peak - before) / nodes,
            "messages": summary["messages_delivered"], "emulation_wall": summary["wall_seconds"]}


def rates() -> dict:
    """The small run of benchmarks/throughput.py, and its message path spread over 50,000 nodes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import emulator_rate, spread_rate

    return {"small": emulator_rate(200_000), "path": spread_rate(PATH_NODES, PATH_MESSAGES)}


def startup(repeats: int = 5) -> tuple[float, float]:
    """Median whole-process wall of the learning run's start-up and of the plain script, alternating."""
    sys.path.insert(0, str(Path(__file__).parent))
    from startup import pairs

    emulate = Path(sys.executable).with_name("emulate")
    with tempfile.TemporaryDirectory() as out:
        return pairs([str(emulate), *STARTUP, "--out", out, "--overwrite"], [sys.executable, "-c", PLAIN_START],
                     repeats)


def _in_process(*args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(value: float, target: float | None, unit: str) -> str:
    if target is None:
        return ""
    return f"< {target} {unit} " + ("[green]met" if value < target else "[red]missed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(RUNS), default=DEFAULT)
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up comparison")
    parser.add_argument("--child", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--rates", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.rates:
        print(json.dumps(child(args.child) if args.child else rates()))
        return
    console = Console(width=150)
    table = Table(title="scale: each run in a fresh process")
    for column in ("run", "nodes", "wall", "target", "peak RSS", "target", "bytes/node", "msgs/s"):
        table.add_column(column, justify="right" if column not in ("run", "target") else "left")
    results = {}
    for name in args.only:
        flags, nodes, wall_target, peak_target = RUNS[name]
        console.print(f"[dim]emulate {' '.join(flags)}")
        start = time.perf_counter()
        r = results[name] = _in_process("--child", name)
        wall = time.perf_counter() - start  # the whole process: interpreter start and imports too
        assert r["status"] == 0, f"{name}: emulate exited with {r['status']}"
        table.add_row(name, f"{nodes:,}", f"{wall:.2f} s", _check(wall, wall_target, "s"),
                      f"{r['peak'] / GIB:.2f} GiB", _check(r["peak"] / GIB, peak_target, "GiB"),
                      f"{r['per_node'] / 1024:,.1f} KiB", f"{r['messages'] / r['emulation_wall']:,.0f}")
    console.print(table)
    if "gossip-50k" in results:
        rate = _in_process("--rates")
        gossip = results["gossip-50k"]["messages"] / results["gossip-50k"]["emulation_wall"]
        for what, large, target in ((f"message path spread over {PATH_NODES:,} nodes", rate["path"], PATH_TARGET),
                                    ("50k-node gossip", gossip, GOSSIP_TARGET)):
            met = "[green]met" if large >= target * rate["small"] else "[red]missed"
            console.print(f"throughput, {what}: {large:,.0f} msgs/s against the small run's {rate['small']:,.0f}: "
                          f"ratio {large / rate['small']:.2f} (target >= {target}) {met}")
    if {"gossip-100k", "randomized-gossip-100k"} <= results.keys():
        synchronous, randomized = (results[name]["messages"] / results[name]["emulation_wall"]
                                   for name in ("gossip-100k", "randomized-gossip-100k"))
        met = "[green]met" if randomized >= RANDOMIZED_TARGET * synchronous else "[red]missed"
        console.print(f"throughput, 100k-node randomized gossip: {randomized:,.0f} msgs/s against synchronous "
                      f"gossip's {synchronous:,.0f}: ratio {randomized / synchronous:.2f} "
                      f"(target >= {RANDOMIZED_TARGET}) {met}")
    if not args.no_startup:
        run, plain = startup()
        met = "[green]met" if run - plain <= STARTUP_TARGET else "[red]missed"
        console.print(f"start-up, emulate {' '.join(STARTUP)}: {run:.2f} s against a plain script's {plain:.2f} s "
                      f"(medians of 5): {run - plain:+.2f} s (target <= +{STARTUP_TARGET} s) {met}")


if __name__ == "__main__":
    main()
