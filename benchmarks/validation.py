"""The link model against real TCP on kernel-shaped links: each scenario emulated and over --transport netns.

    ./dev bench validation [--part transfers|sharing|protocols|async] [--seeds 3] [--model-option ...]
                           [--out DIR] [--json FILE]
    ./dev bench validation --figure RESULT.json...

Every scenario runs with the same settings twice per seed: emulated (the link model) and
real (`--transport netns`: one process and network namespace per node, tc-shaped links,
latency held by the receiving application). Compared, emulated against real:
- per-message delivery time (t_arrive - t_send, messages.jsonl; a link's k-th message of a
  kind and round matched with the other run's),
- per-round time (the last node's end of round r less that of round r - 1) and total time
  (the last row's end), for round-based scenarios,
- bytes: payload bytes per link must be equal (they are counted the same way).
Errors are emulated/real - 1. A table row per scenario: delivery |error| median, p90 and worst
over all messages of all seeds; round and total |error| as the median over seeds of each seed's
median round error and its total error. `--model-option` passes extra settings to the emulated
runs only (e.g. `link_sharing=fair`); the real runs are kept under --out and reused.
Needs root (namespaces): run as `sudo ./dev bench validation` where you are not root.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

import networkx as nx
import numpy as np

import p2p_emulator
from p2p_emulator.analysis.rundir import read_jsonl

MB = 1_000_000


def directed(edges: list[tuple[int, int]], path: Path) -> str:
    """A GraphML file of directed edges (topology files own the node count)."""
    graph = nx.DiGraph(edges)
    path.parent.mkdir(parents=True, exist_ok=True)
    nx.write_graphml(graph, path)
    return str(path)


def gossip_of(nbytes: int) -> dict:
    """Gossip of a float64 vector: frames of about nbytes, and no model (no compute to speak of)."""
    return {"protocol": "gossip", "dim": max(1, nbytes // 8), "timeout": 10_000.0}


def transfers(work: Path) -> list[tuple[str, dict]]:
    """One sender, one receiver: messages queued back to back on the link, sizes 1 kB..16 MB at 1, 10, 100 Mbit/s."""
    topology = directed([(0, 1)], work / "one-link.graphml")
    scenarios = []
    for rate in (1, 10, 100):
        for size in (1_000, 16_000, 250_000, 1 * MB, 4 * MB, 16 * MB):
            seconds = 8 * size / (rate * 1e6)
            if seconds > 15:  # 16 MB at 1 Mbit/s is two minutes a message
                continue
            rounds = int(max(2, min(10, 8 / seconds)))
            scenarios.append((f"1→1 {size / 1e3:g} kB @ {rate} Mbit/s",
                              {**gossip_of(size), "topology": topology, "rounds": rounds,
                               "bandwidth": f"{rate}Mbps", "latency": "2ms"}))
    return scenarios


def sharing(work: Path) -> list[tuple[str, dict]]:
    """One sender to 4 neighbours at once on a shared uplink; 4 senders into one shared downlink."""
    out = directed([(0, i) for i in range(1, 5)], work / "fan-out.graphml")
    into = directed([(i, 0) for i in range(1, 5)], work / "fan-in.graphml")
    common = {**gossip_of(2 * MB), "rounds": 3, "latency": "2ms", "bandwidth": "inf"}
    return [("1→4 2 MB, uplink 10 Mbit/s", {**common, "topology": out, "uplink": "10Mbps"}),
            ("4→1 2 MB, downlink 10 Mbit/s", {**common, "topology": into, "downlink": "10Mbps"})]


def learning(work: Path) -> list[tuple[str, dict]]:
    """D-PSGD on a ring of 8 and FedAvg on a star of 9, a 2.4 MB model on 10 Mbit/s links and uplinks, each job
    charged 5 ms a sample on both sides, and gossip of 2.4 MB vectors on the ring: D-PSGD's messages and next to
    no compute."""
    common = {"model": "mlp:hidden=1024,512", "rounds": 4, "latency": "2ms", "bandwidth": "10Mbps",
              "uplink": "10Mbps", "compute_time": "per-sample", "compute_cost": "5ms", "timeout": 10_000.0,
              "eval_every": 4}
    # Compute equal on both sides: a real job charged more than it took waits out the rest, and 5 ms a sample is
    # several times what one takes here with 8 processes on 2 cores.
    # Gossip of a vector as large as the model, on the same ring: D-PSGD's messages without its compute.
    exchange = {**gossip_of(2_386_264), "topology": "ring", "nodes": 8, "rounds": 4, "latency": "2ms",
                "bandwidth": "10Mbps", "uplink": "10Mbps"}
    return [("D-PSGD ring 8", {**common, "protocol": "dpsgd", "topology": "ring", "nodes": 8}),
            ("FedAvg star 9", {**common, "protocol": "fedavg", "topology": "star", "nodes": 9}),
            ("gossip ring 8, 2.4 MB vectors", exchange)]


def asynchronous(work: Path) -> list[tuple[str, dict]]:
    """Randomized gossip on a ring of 8 for 10 s: exchanges and busy answers follow arrival order."""
    return [("randomized gossip ring 8, 10 s", {"protocol": "randomized-gossip", "topology": "ring", "nodes": 8,
                                                "duration": 10.0, "wake_rate": 5.0, "latency": "20ms",
                                                "bandwidth": "1Mbps"})]


PARTS = {"transfers": transfers, "sharing": sharing, "protocols": learning, "async": asynchronous}


def run(settings: dict, out: Path) -> Path:
    if not (out / "summary.json").exists():
        p2p_emulator.run(**settings, out=str(out), overwrite=True, trace=True, quiet=True, no_plots=True)
    return out


def delivery_times(run_dir: Path) -> dict[tuple, float]:
    """(src, dst, kind, round, k) -> t_arrive - t_send of each delivered message."""
    seen: dict[tuple, int] = {}
    times = {}
    for row in read_jsonl(run_dir / "messages.jsonl"):
        if row["fate"] != "delivered":
            continue
        key = (row["src"], row["dst"], row["kind"], row["round"])
        k = seen[key] = seen.get(key, -1) + 1
        times[(*key, k)] = row["t_arrive"] - row["t_send"]
    return times


def round_ends(run_dir: Path) -> list[float]:
    ends: dict[int, float] = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        ends[row["round"]] = max(ends.get(row["round"], 0.0), row["t"])
    return [ends[r] for r in sorted(ends)]


def link_bytes(run_dir: Path) -> list[str]:
    return [line.split(",")[:2] + line.split(",")[5:7] for line in (run_dir / "links.csv").read_text().splitlines()]


def compare(emulated: Path, real: Path, synchronous: bool) -> dict:
    """Errors of one seed: emulated/real - 1."""
    emu, act = delivery_times(emulated), delivery_times(real)
    common = sorted(set(emu) & set(act))
    result = {"delivery": [emu[k] / act[k] - 1 for k in common], "messages": [len(emu), len(act)],
              "bytes_equal": link_bytes(emulated) == link_bytes(real),
              "delivery_pairs": [[emu[k], act[k]] for k in common]}
    e_ends, r_ends = round_ends(emulated), round_ends(real)
    result["total"] = e_ends[-1] / r_ends[-1] - 1
    result["seconds"] = [e_ends[-1], r_ends[-1]]
    if synchronous and len(e_ends) == len(r_ends):
        e_rounds, r_rounds = np.diff([0.0, *e_ends]), np.diff([0.0, *r_ends])
        result["rounds"] = list(e_rounds / r_rounds - 1)
    return result


def summarise(name: str, seeds: list[dict]) -> dict:
    delivery = np.abs([e for s in seeds for e in s["delivery"]])
    row = {"scenario": name, "seeds": len(seeds), "messages": [sum(s["messages"][i] for s in seeds) for i in (0, 1)],
           "bytes_equal": all(s["bytes_equal"] for s in seeds),
           "delivery_median": float(np.median(delivery)) if len(delivery) else None,
           "delivery_p90": float(np.percentile(delivery, 90)) if len(delivery) else None,
           "delivery_worst": float(delivery.max()) if len(delivery) else None,
           "total": statistics.median(abs(s["total"]) for s in seeds),
           "seconds": [statistics.median(s["seconds"][0] for s in seeds),
                       statistics.median(s["seconds"][1] for s in seeds)]}
    if all("rounds" in s for s in seeds):
        row["round"] = statistics.median(float(np.median(np.abs(s["rounds"]))) for s in seeds)
    return row


def pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def table(rows: list[dict]) -> str:
    lines = ["| scenario | seeds | messages emulated / real | seconds emulated / real | delivery median | p90 | worst | round | total "
             "| payload bytes equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['seeds']} | {r['messages'][0]} / {r['messages'][1]} | {r['seconds'][0]:.2f} / "
                     f"{r['seconds'][1]:.2f} | {pct(r['delivery_median'])} | {pct(r['delivery_p90'])} | "
                     f"{pct(r['delivery_worst'])} | {pct(r.get('round'))} | {pct(r['total'])} | "
                     f"{'yes' if r['bytes_equal'] else 'NO'} |")
    return "\n".join(lines)


def figure(results: list[Path], path: Path) -> None:
    """Emulated against real delivery time of every message, one colour per model (the --json files' options)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_model: dict[str, list] = {}
    for result in results:
        data = json.loads(result.read_text())
        label = ", ".join(f"{k}={v}" for k, v in sorted(data["options"].items())) or "default model"
        by_model.setdefault(label, []).extend(p for seeds in data["seeds"].values() for s in seeds
                                              for p in s["delivery_pairs"])
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for label, pairs in by_model.items():
        pairs = np.array(pairs)
        ax.scatter(pairs[:, 1], pairs[:, 0], s=6, alpha=0.4, label=f"{label} ({len(pairs)} messages)")
    every = np.array([p for pairs in by_model.values() for p in pairs])
    low, high = every.min(), every.max()
    ax.plot([low, high], [low, high], color="black", linewidth=0.8, label="emulated = real")
    ax.set(xscale="log", yscale="log", xlabel="real delivery time (s), TCP on tc-shaped links",
           ylabel="emulated delivery time (s)", title="Per-message delivery time, every scenario and seed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def option(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    return key.replace("-", "_"), value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--model-option", type=option, action="append", default=[],
                        help="KEY=VALUE for the emulated runs only, e.g. link_sharing=fair")
    parser.add_argument("--out", default="runs/validation", help="where the run directories go (reused)")
    parser.add_argument("--json", help="write the rows and every seed's errors here")
    parser.add_argument("--figure", nargs="+", metavar="JSON", help="draw delivery times from earlier --json files "
                        "into docs/images/validation-delivery.png, and run nothing")
    args = parser.parse_args()
    if args.figure:
        figure([Path(p) for p in args.figure], Path("docs/images/validation-delivery.png"))
        return 0
    warnings.simplefilter("ignore")  # one-link and fan topologies are weakly connected, as meant
    out = Path(args.out)
    extra = dict(args.model_option)
    label = "-".join(f"{k}={v}" for k, v in sorted(extra.items())) or "default"
    rows, raw = [], {}
    for part in PARTS if args.part == "all" else [args.part]:
        for index, (name, settings) in enumerate(PARTS[part](out / "topologies")):
            synchronous = part == "protocols"  # elsewhere a sender's rounds take no time: a round is its messages
            seeds = []
            for seed in range(args.seeds):
                stem = out / part / f"{index}-seed{seed}"
                real = run({**settings, "seed": seed, "transport": "netns"}, stem.with_name(stem.name + "-real"))
                emulated = run({**settings, **extra, "seed": seed}, stem.with_name(f"{stem.name}-emulated-{label}"))
                seeds.append(compare(emulated, real, synchronous))
            rows.append(summarise(name, seeds))
            raw[name] = seeds
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"options": extra, "rows": rows, "seeds": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
