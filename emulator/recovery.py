"""Loss on a reliable transport (--loss-model reliable): a lost segment is sent again, so a lossy link
delivers every message, later by what TCP's recovery costs.

A message of n payload bytes crosses its link as S = ceil(n / 1448) segments, in flights under a
congestion window W (in segments), as Linux's default TCP keeps it (CUBIC, with SACK and RACK-TLP).
R, the round trip, is twice the message's latency sample (the way back is taken to be as long), and
a segment's transmission time is the message's own (its wire bits over the link's rate) over S.

  1. A link's window starts unlimited: a connection that has lost nothing sends at the link's rate,
     as the loss-free model has it, in flights of its bandwidth-delay product.
  2. A flight is min(W, left) segments, the ones lost in the last flight first. Each segment is
     lost as the link's loss model draws it, from the link's own stream (Gilbert-Elliott's state
     steps per segment).
  3. A flight that loses nothing and holds the message's last segment ends the transfer: its
     transmission, then the latency. Any other flight takes max(R + one segment's transmission, its
     transmission): a window per round trip, or the link's pace (an unlimited window's: its
     transmission).
  4. A flight that loses segments costs the detection as well: R/4 more (RACK's reordering window),
     or, when its last segment is lost at the message's end (no later segment shows the loss), a
     tail-loss probe after 2R instead (with one segment out, 1.5R + 200 ms). A flight lost whole
     waits out the retransmission timeout (R + 200 ms: Linux's floor) and restarts from W = 1. The
     window is cut once per flight: W <- max(2, 0.7 W) (CUBIC's beta; a window never cut is the
     link's bandwidth-delay product first), and so is ssthresh.
  5. A flight that loses nothing grows W: it doubles below ssthresh (slow start), else takes CUBIC's
     window a round trip on, W_max + 0.4 (t + R - K)^3 with K = cbrt(0.3 W_max / 0.4), or its
     Reno-friendly estimate 0.7 W_max + 0.53 / 2 x (t + R) / R (the receiver acknowledges every
     second segment), t the time since the cut, at most 1.5 W.

What is left out: slow start on a new or idle connection (the loss-free model has none either),
the queue a shaper builds, loss of ACKs, and more than one connection sharing a link's loss.
Held against Linux TCP (docs/network-model.md): 15 of 24 cells within 15%; at 5% loss up to a fifth fast,
within 9% given the round trip TCP itself saw; at 1% up to a fifth slow, a third given that round trip.
"""
from __future__ import annotations

import math

BETA = 0.7  # CUBIC's multiplicative decrease
CUBIC_C = 0.4  # CUBIC's scaling constant, segments per s^3
ACKED = 2  # segments per ACK: the receiver acknowledges every second segment (delayed ACKs)
FRIENDLY = 3 * (1 - BETA) / (1 + BETA) / ACKED  # the Reno-friendly window's growth per round trip, per ACK
RTO_MIN = 0.2  # s: Linux's floor on the retransmission timeout (TCP_RTO_MIN), and its delayed ACK's most
LOSS_WINDOW = 1  # segments after a retransmission timeout


class Window:
    """A link's congestion state, carried from message to message: one connection per directed link."""
    __slots__ = ("cwnd", "ssthresh", "w_max", "cut_at", "busy")

    def __init__(self):
        self.cwnd = math.inf  # never cut: a warm connection, at the link's rate
        self.ssthresh = math.inf
        self.w_max = 0.0  # the window at the last cut
        self.cut_at = 0.0  # when, in `busy` time, the window was last cut
        self.busy = 0.0  # seconds the link has spent sending (idle time does not count, as in Linux's CUBIC)

    def state(self) -> list:
        return [self.cwnd, self.ssthresh, self.w_max, self.cut_at, self.busy]

    def load_state(self, state: list) -> None:
        self.cwnd, self.ssthresh, self.w_max, self.cut_at, self.busy = state


def transfer(window: Window, nbytes: int, segment: int, sending: float, rtt: float, lost, link) -> tuple[float, int]:
    """The seconds from a message's first bit on the link to its last bit sent (its latency comes after), and
    the payload bytes sent again. The message is nbytes of payload in segments of `segment` bytes; `sending` is
    its loss-free transmission time; `lost(rng, link)` the loss model's draw for one segment."""
    segments = max(1, -(-nbytes // segment))
    last_size = nbytes - (segments - 1) * segment
    per_segment = sending / segments
    rng = link.rng
    bdp = rtt / per_segment if per_segment else math.inf  # the flight that keeps the link busy for a round trip
    fresh, pending, last_pending = segments, 0, False  # never sent; lost, to send again (the last one among them?)
    elapsed, resent = 0.0, 0
    while True:
        limit = window.cwnd if window.cwnd != math.inf else bdp
        flight = max(1, int(min(limit, pending + fresh)))
        again = min(pending, flight)  # lost segments go first
        new = flight - again
        # The message's last segment, if this flight holds it, is the flight's last.
        holds_last = (last_pending and again == pending) or (fresh > 0 and new == fresh)
        resent += again * segment - (segment - last_size if last_pending and holds_last else 0)
        dropped = [lost(rng, link) for _ in range(flight)]
        lost_now = sum(dropped)
        fresh -= new
        pending += lost_now - again
        last_pending = (last_pending and not holds_last) or (holds_last and dropped[-1])
        busy = flight * per_segment
        if not lost_now and not pending and not fresh:
            window.busy += elapsed + busy
            return elapsed + busy, resent
        if not lost_now:  # a window never cut keeps the link busy: its flights follow one another at its pace
            elapsed += busy if window.cwnd == math.inf else max(rtt + per_segment, busy)
            _grow(window, rtt, window.busy + elapsed)
            continue
        if lost_now == flight:  # nothing came through: the retransmission timer fires
            elapsed += max(rtt + per_segment, busy) + RTO_MIN
            _cut(window, window.busy + elapsed, bdp)
            window.cwnd = LOSS_WINDOW
        elif dropped[-1] and not fresh:  # a tail loss: no later segment reveals it, a probe does
            elapsed += max(2 * rtt if flight > 1 else 1.5 * rtt + RTO_MIN, busy)
            _cut(window, window.busy + elapsed, bdp)
        else:
            elapsed += max(rtt + per_segment, busy) + rtt / 4
            _cut(window, window.busy + elapsed, bdp)


def _cut(window: Window, now: float, bdp: float) -> None:
    """A loss: CUBIC's multiplicative decrease (of the bandwidth-delay product, for a window never cut)."""
    window.w_max = window.cwnd if window.cwnd != math.inf else bdp
    window.cwnd = window.ssthresh = max(2.0, BETA * window.w_max)
    window.cut_at = now


def _grow(window: Window, rtt: float, now: float) -> None:
    """A round trip without loss: slow start below ssthresh, else CUBIC's window or its Reno-friendly one."""
    cwnd = window.cwnd
    if cwnd == math.inf:
        return
    if cwnd < window.ssthresh:
        window.cwnd = min(2 * cwnd, window.ssthresh)
        return
    t = now - window.cut_at + rtt
    k = (window.w_max * (1 - BETA) / CUBIC_C) ** (1 / 3)
    friendly = window.w_max * BETA + FRIENDLY * t / rtt if rtt else cwnd
    window.cwnd = min(max(cwnd, window.w_max + CUBIC_C * (t - k) ** 3, friendly), 1.5 * cwnd)
