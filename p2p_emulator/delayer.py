"""Hold every packet an NFQUEUE queue hands over for a fixed delay, then let it through: latency that TCP
itself sees, on a kernel without netem.

    python -m p2p_emulator.delayer --queue 0 --delay 0.025

Run inside a network namespace whose INPUT chain sends packets to the queue (`iptables -A INPUT ...
-j NFQUEUE --queue-num 0`). Packets leave in the order they came, each `--delay` seconds after the
kernel handed it over (the asyncio loop's timers: measured 0.5-0.7 ms late each way when idle, and TCP
saw 2-6 ms more per round trip under load: docs/network-model.md).
Needs the `netfilterqueue` package (pip; it builds against libnetfilter-queue-dev from Debian).
Prints "ready" once bound, and runs until killed.
"""
from __future__ import annotations

import argparse
import asyncio
import socket


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2p_emulator.delayer", description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0, help="NFQUEUE queue number")
    parser.add_argument("--delay", type=float, required=True, help="seconds to hold each packet")
    args = parser.parse_args(argv)
    from netfilterqueue import COPY_META, NetfilterQueue  # only here: the emulator does not need it

    loop = asyncio.new_event_loop()
    queue = NetfilterQueue()

    def hold(packet) -> None:
        loop.call_later(args.delay, packet.accept)

    queue.bind(args.queue, hold, max_len=65536, mode=COPY_META)
    channel = socket.fromfd(queue.get_fd(), socket.AF_NETLINK, socket.SOCK_RAW)
    loop.add_reader(channel.fileno(), queue.run, False)
    print("ready", flush=True)
    try:
        loop.run_forever()
    finally:
        queue.unbind()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
