"""The testbed: one network namespace per node, links shaped by tc, and nothing left behind."""
import math
import os
import subprocess
import sys

import pytest

from p2p_emulator import testbed

REASON = testbed.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces: {REASON}")

INF = math.inf
# tc counts link-layer bytes: a full TCP segment is 1448 bytes of payload in a 1514-byte frame
# (14 Ethernet + 20 IP + 32 TCP with timestamps), so a rate carries 1448/1514 = 0.956 of itself in payload.
OVERHEAD = 1514 / 1448
RATE = 8e6  # bit/s
SIZE = 1 << 20  # bytes: 1.10 s at RATE

RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], 7000))
print("ready", flush=True)
conn, _ = server.accept()
while conn.recv(1 << 16):
    pass
conn.sendall(b"k")
"""
SEND = """
import socket, sys, time
start = time.perf_counter()
conn = socket.create_connection((sys.argv[1], 7000))
conn.sendall(bytes(int(sys.argv[2])))
conn.shutdown(socket.SHUT_WR)
assert conn.recv(1) == b"k"  # the receiver has read every byte
print(time.perf_counter() - start)
"""


def _ours() -> list[str]:
    """This process's namespaces (other test processes may hold their own)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"{testbed.PREFIX}{os.getpid()}")]


def _transfer(bed: testbed.Testbed, src: int, dst: int, size: int) -> float:
    """Seconds from connecting to the receiver's word that it has read `size` bytes."""
    receiver = subprocess.Popen(bed.command(dst, [sys.executable, "-c", RECEIVE, bed.address(dst)]),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        sender = subprocess.run(bed.command(src, [sys.executable, "-c", SEND, bed.address(dst), str(size)]),
                                capture_output=True, text=True, check=True, timeout=30)
        return float(sender.stdout)
    finally:
        receiver.kill()  # a process left inside would keep its namespace alive
        receiver.wait()


def test_a_transfer_takes_its_frames_over_the_uplink_rate():
    with testbed.Testbed(2, [RATE, INF], [INF, INF], {}) as bed:
        assert [bed.address(0), bed.address(1)] == ["10.77.0.1", "10.77.0.2"]
        seconds = _transfer(bed, 0, 1, SIZE)
    assert seconds == pytest.approx(8 * SIZE * OVERHEAD / RATE, rel=0.03)  # measured: within 0.6%
    assert _ours() == []


def test_nothing_is_left_after_an_exception_inside():
    with pytest.raises(KeyError):
        with testbed.Testbed(3, [1e6, INF, 2e6], [INF, 1e6, INF], {(0, 1): 5e5, (2, 0): INF}):
            assert len(_ours()) == 4  # three nodes and the hub
            raise KeyError("inside")
    assert _ours() == []


def test_namespaces_of_a_launcher_that_is_gone_are_removed():
    launcher = subprocess.Popen(["true"])
    launcher.wait()  # its pid is no longer alive
    stale = f"{testbed.PREFIX}{launcher.pid}n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        testbed.cleanup_stale()  # another test process's Testbed may have removed it first: both are fine
        assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)


def test_nodes_on_different_bridges_reach_each_other(monkeypatch):
    monkeypatch.setattr(testbed, "PORTS_PER_BRIDGE", 2)  # 5 nodes: 3 bridges joined by a core bridge
    with testbed.Testbed(5, [INF] * 5, [INF] * 5, {}) as bed:
        assert _transfer(bed, 0, 4, 1000) < 5.0
