"""Loss on a reliable transport: the emulator's model (emulator.recovery) against Linux TCP with packets
dropped and delayed in the kernel.

    ./dev bench loss [--rates 10,100] [--rtts 10,50] [--losses 1,5] [--sizes 1,4,16] [--seeds 3]
                     [--out runs/loss] [--json FILE]

The testbed: two network namespaces (p2p_emulator.testbed), node 0's uplink shaped by htb to the rate
(tc counts 1514 bytes per full segment). Node 1's INPUT drops each of node 0's packets with the loss
probability (iptables' statistic match), then holds the rest RTT/2 (an NFQUEUE delayer,
p2p_emulator.delayer); node 0's INPUT holds node 1's ACKs RTT/2: TCP sees the round trip and the
loss. The sender runs CUBIC (Linux's default; this machine's own default is BBR; the namespaces' sysctls
are read-only here, so the socket sets it).

A cell (rate, round trip, loss) is one connection: a 4 MB warm-up message (so that the window starts
where loss keeps it, not where a fresh connection's does), then --seeds messages of each size, each
sent when the one before has arrived. A message's transfer time is from the sender's first write to
the receiver's last byte. The emulated twin: a link of that rate (--link-overhead tcp), the testbed's
latency (measured first for each rate and round trip: the median transfer time of 30 1-byte messages
with no loss) and Bernoulli loss under --loss-model reliable, seed s: the warm-up, then one message of
the size; its arrival less its send. Errors are emulated/real - 1 of the medians over seeds.
`--again FILE...` plays the model again against the real times an earlier --json kept.
Needs root, iptables and the netfilterqueue package (pip install netfilterqueue; apt install
iptables libnetfilter-queue-dev).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from emulator.ledger import LINK_COUNTERS
from emulator.links import TCP_HEADERS, TCP_SEGMENT, Bernoulli, Capacity, Delay, Link, LinkSpec, tcp_wire_bytes
from emulator.seeds import Seeds
from p2p_emulator.testbed import Testbed

MB = 1_000_000
WARM_UP = 4 * MB  # enough for the window to come down to where loss keeps it, in the model and in Linux
PORT = 5201
CALIBRATION_MESSAGES = 30
HEADER = struct.Struct("!Q")


def emulated(rate: float, one_way: float, loss: float, size: int, seed: int) -> float:
    """The model's transfer time of a `size`-byte message after the warm-up, on a fresh link of this seed."""
    link = Link(0, 1, LinkSpec(Delay("constant", value=one_way), rate, Bernoulli(loss)), Seeds(seed),
                Capacity(math.inf), Capacity(math.inf), [0] * len(LINK_COUNTERS), reliable=True)
    warm = link.transmit(0.0, tcp_wire_bytes(WARM_UP), WARM_UP)
    return link.transmit(warm, tcp_wire_bytes(size), size) - warm


def receive(port: int) -> None:
    """Node 1: take messages (an 8-byte length, then the bytes), answer each with one byte, print each's
    last-byte time (time.monotonic: one clock for every namespace)."""
    server = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray(1 << 20)
    while header := conn.recv(HEADER.size, socket.MSG_WAITALL):
        left = HEADER.unpack(header)[0]
        while left:
            left -= conn.recv_into(buffer, min(left, len(buffer)))
        print(time.monotonic(), flush=True)
        conn.sendall(b"k")


def send(host: str, port: int, sizes: list[int]) -> None:
    """Node 0: send each message when the one before is answered; print each's first-write time."""
    conn = socket.create_connection((host, port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")  # Linux's default (this machine's: BBR)
    for size in sizes:
        payload = bytes(size)
        start = time.monotonic()
        conn.sendall(HEADER.pack(size) + payload)
        conn.recv(1)
        print(start, flush=True)


def real(bed: Testbed, rtt: float, loss: float, sizes: list[int], srtt: list[float] | None = None) -> list[float]:
    """Transfer times of `sizes` on one connection through the shaped, lossy, delayed testbed; the sender's
    smoothed round trip as its kernel has it (ss), every 0.1 s, appended to `srtt` if given."""
    python = sys.executable
    rules = {1: [f"-A INPUT -p tcp -s {bed.address(0)} -m statistic --mode random --probability {loss} -j DROP",
                 "-A INPUT -p tcp -j NFQUEUE --queue-num 0"],
             0: ["-A INPUT -p tcp -j NFQUEUE --queue-num 0"]}
    delayers = []
    try:
        for node in (0, 1):
            _run(bed.command(node, ["iptables", "-F", "INPUT"]))
            for rule in rules[node]:
                _run(bed.command(node, ["iptables", *rule.split()]))
            delayer = subprocess.Popen(bed.command(node, [python, "-m", "p2p_emulator.delayer", "--delay",
                                                          str(rtt / 2)]), stdout=subprocess.PIPE, text=True)
            delayers.append(delayer)
            _ready(delayer)
        receiver = subprocess.Popen(bed.command(1, [python, __file__, "--receive", str(PORT)]), stdout=subprocess.PIPE,
                                    text=True)
        _ready(receiver)
        sending = subprocess.Popen(bed.command(0, [python, __file__, "--send", bed.address(1), str(PORT),
                                                   ",".join(map(str, sizes))]), stdout=subprocess.PIPE, text=True)
        while srtt is not None and sending.poll() is None:
            state = subprocess.run(bed.command(0, ["ss", "-tin", "dst", bed.address(1)]), capture_output=True,
                                   text=True).stdout
            srtt.extend(float(ms) for ms in re.findall(r"\brtt:([\d.]+)/", state))
            time.sleep(0.1)
        sender = subprocess.CompletedProcess(sending.args, sending.wait(), sending.communicate()[0])
        receiver.terminate()
        ends = [float(line) for line in receiver.communicate()[0].split()]
        starts = [float(line) for line in sender.stdout.split()]
        return [end - start for start, end in zip(starts, ends)]
    finally:
        for delayer in delayers:
            delayer.terminate()
            delayer.wait()


def _ready(process: subprocess.Popen) -> None:
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{process.args}: did not start")


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def testbed(rate: float) -> Testbed:
    bed = Testbed(2, [rate, math.inf], [math.inf, math.inf])
    bed.__enter__()
    return bed


def calibrate(bed: Testbed, rtt: float) -> float:
    """The testbed's one-way latency at a nominal round trip: the median transfer time of 1-byte messages with no
    loss (the delayer's own hold, and its wake-ups, about 0.5 ms each way)."""
    return statistics.median(real(bed, rtt, 0.0, [1] * CALIBRATION_MESSAGES))


def cell(rate: float, rtt: float, loss: float, size: int, measured: list[float], one_way: float) -> dict:
    """One cell's result: the model given the testbed's measured one-way latency, against the real times."""
    model = [emulated(rate * 1e6, one_way, loss / 100, size, seed) for seed in range(len(measured))]
    return {"rate_mbps": rate, "rtt_ms": rtt, "loss_pct": loss, "size_mb": size / MB, "one_way_s": one_way,
            "real": measured, "emulated": model, "error": statistics.median(model) / statistics.median(measured) - 1}


def under_load(result: dict) -> float:
    """The model's error given the round trip TCP itself measured during the cell (its srtt, less one segment's
    transmission, which the model adds), instead of the idle one: how much of the error is the delayer's hold
    growing under load."""
    segment = 8 * (TCP_SEGMENT + TCP_HEADERS) / (result["rate_mbps"] * 1e6)
    one_way = (result["srtt_ms"] / 1000 - segment) / 2
    return cell(result["rate_mbps"], result["rtt_ms"], result["loss_pct"], int(result["size_mb"] * MB),
                result["real"], one_way)["error"]


def row(result: dict) -> str:
    return (f"| {result['rate_mbps']:g} Mbit/s | {result['rtt_ms']:g} ms | {result['loss_pct']:g}% | "
            f"{result['size_mb']:g} MB | {statistics.median(result['emulated']):.3f} | "
            f"{statistics.median(result['real']):.3f} | {result['error']:+.1%} | "
            f"{2000 * result['one_way_s']:.1f} / {result['srtt_ms']:.1f} | {under_load(result):+.1%} |")


HEAD = ("| rate | RTT | loss | size | emulated s | real s | error | round trip idle / TCP's srtt, ms | "
        "error at TCP's srtt |\n|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    numbers = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--rates", type=numbers, default=[10, 100], help="Mbit/s")
    parser.add_argument("--rtts", type=numbers, default=[10, 50], help="ms")
    parser.add_argument("--losses", type=numbers, default=[1, 5], help="percent of packets")
    parser.add_argument("--sizes", type=numbers, default=[1, 4, 16], help="MB")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", help="append each cell's result here as a JSON line")
    parser.add_argument("--again", nargs="+", metavar="JSON", help="the model again against the real times of "
                        "earlier --json files; runs nothing real")
    parser.add_argument("--receive", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--send", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receive(args.receive)
        return 0
    if args.send:
        send(args.send[0], int(args.send[1]), [int(x) for x in args.send[2].split(",")])
        return 0
    print(HEAD, flush=True)
    if args.again:
        results = [json.loads(line) for path in args.again for line in Path(path).read_text().splitlines()]
        # A file kept before cells carried their calibration takes that of the same rate and round trip.
        one_way = {(old["rate_mbps"], old["rtt_ms"]): old["one_way_s"] for old in results if "one_way_s" in old}
        errors = []
        for old in results:
            new = cell(old["rate_mbps"], old["rtt_ms"], old["loss_pct"], int(old["size_mb"] * MB), old["real"],
                       one_way[old["rate_mbps"], old["rtt_ms"]])
            new["srtt_ms"] = old["srtt_ms"]
            errors.append(abs(new["error"]))
            print(row(new))
        print(f"\n|error|: median {statistics.median(errors):.1%}, worst {max(errors):.1%}, "
              f"{sum(e <= 0.15 for e in errors)} of {len(errors)} within 15%")
        return 0
    for rate in args.rates:
        bed = testbed(rate * 1e6)
        try:
            for rtt in args.rtts:
                one_way = calibrate(bed, rtt / 1000)
                for loss in args.losses:
                    sizes = [int(mb * MB) for mb in args.sizes]
                    srtt: list[float] = []
                    times = real(bed, rtt / 1000, loss / 100, [WARM_UP] + [s for s in sizes for _ in range(args.seeds)],
                                 srtt)
                    for i, size in enumerate(sizes):
                        result = cell(rate, rtt, loss, size, times[1 + i * args.seeds:1 + (i + 1) * args.seeds],
                                      one_way)
                        result["srtt_ms"] = statistics.median(srtt)
                        print(row(result), flush=True)
                        if args.json:
                            with open(args.json, "a") as out:
                                out.write(json.dumps(result) + "\n")
        finally:
            bed.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
