"""How an emulated link is shaped, so that every message pays its bytes / rate.

A link is a veth pair with a token bucket filter (tc tbf) on each end. tbf lets a packet pass as
soon as its bucket holds the packet's length in tokens, and refills the bucket at the rate while
the link is idle. Two things decide how faithful that is:

* **The bucket.** After an idle period (a compute step) the first ``bucket`` bytes of a message
  pass at veth speed. A large bucket turns a slow link into a fast one for every message that
  fits (a 48 KB message, 19.2 ms of wire at 20 Mbit/s, crosses a 96 KB bucket at once). The
  bucket must still hold a little more than one packet, or tbf's watchdog timer latency is
  lost at every packet and the link runs below its rate.
* **The packet size.** TCP hands the veth GSO packets of up to 64 KB, and tbf sends each one
  whole: a packet is ahead of a real wire by its own length. Capping the veths' GSO size
  (``gso_max_size`` / ``gso_max_segs``) keeps packets to a short slice of the rate.

The *paced* link (the default) sizes both from time: packets of about :data:`PACKET_S` of the
rate (whole MSS segments, at least one) and a bucket of one packet plus :data:`SLACK_S` of the
rate. The lead any message can gain over bytes / rate is then about
``bucket / rate``. Smaller packets cost the emulator CPU per byte (every frame crosses veth,
bridge and veth), which is why the slice grows with the rate instead of being one frame always
(docs/netem.md has the measured accuracy and CPU cost).

The *bursting* link (``--burst SIZE``) keeps the kernel's 64 KB GSO packets and a bucket of
``SIZE``: it models a policer that lets bursts through, as some clouds shape.

Propagation delay needs the ``netem`` qdisc, which some kernels lack (it is a module that a
container cannot load). :func:`has_qdisc` finds out; a link with ``rtt_s > 0`` puts netem under
tbf on every hop and is refused with one line where the kernel has none.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["LinkShape", "paced", "bursting", "check_burst", "PACKET_S", "SLACK_S", "MSS_BYTES", "FRAME_BYTES"]

#: TCP payload bytes per MTU frame (1500 MTU - 40 bytes IP/TCP - 12 bytes timestamps option)
MSS_BYTES = 1448
#: bytes one full frame occupies in tbf's accounting (payload + TCP/IP + Ethernet headers)
FRAME_BYTES = 1514
#: the GSO segment count Linux uses by default (64 KB packets)
MAX_SEGMENTS = 44
#: a packet is at most this many seconds of the rate (rounded down to whole segments, >= 1).
#: Each packet costs tbf one watchdog wake-up, which is what a paced link spends its CPU on, so
#: longer packets cost less CPU per byte; this slice keeps delivery within a few percent of
#: bytes / rate (docs/netem.md has both, measured)
PACKET_S = 250e-6
#: the bucket holds one packet plus this many seconds of the rate: tbf's watchdog timer wakes a
#: little late, and tokens that arrive meanwhile must not be lost to a full bucket, or the link
#: runs below its rate
SLACK_S = 100e-6
#: at least this much headroom over one packet: tbf converts lengths to time with rounding, and a
#: packet that does not fit its bucket is cut into frames in software
BUCKET_HEADROOM_BYTES = 86


@dataclass(frozen=True)
class LinkShape:
    """The shaping of every hop of an emulated link (a worker's uplink and its downlink)."""

    #: bits per second; None: not shaped
    rate_bits: Optional[int]
    #: tbf's bucket in bytes
    bucket_bytes: int
    #: GSO segments per packet on the veths; None leaves the kernel's default (64 KB packets)
    segments: Optional[int]
    #: round-trip propagation delay between two workers in seconds (0: none added)
    rtt_s: float = 0.0

    @property
    def model(self) -> str:
        """"unshaped", "paced" or "bursting"."""
        if self.rate_bits is None:
            return "unshaped"
        return "paced" if self.segments is not None else "bursting"

    @property
    def hop_delay_s(self) -> float:
        """netem delay on each hop: a message from one worker to another crosses two hops
        (the sender's uplink, the receiver's downlink), and its answer two more."""
        return self.rtt_s / 4.0

    @property
    def lead_s(self) -> float:
        """How far ahead of bytes / rate a message that follows an idle period can get."""
        if self.rate_bits is None:
            return 0.0
        return self.bucket_bytes * 8 / self.rate_bits

    def describe(self) -> str:
        """One line for result rows and run headers."""
        if self.rate_bits is None:
            return "unshaped"
        packets = (f"{self.segments}-segment packets" if self.segments is not None
                   else "64 KB GSO packets")
        delay = f"rtt {self.rtt_s * 1e3:g} ms" if self.rtt_s > 0 else "no added delay"
        return f"{self.model}: tbf bucket {self.bucket_bytes} B, {packets}, {delay}"

    def as_row(self) -> dict:
        """The fields a bench row records about its link."""
        return {"link_model": self.model, "link_bucket_bytes": self.bucket_bytes,
                "link_segments": self.segments, "link_rtt_ms": self.rtt_s * 1e3,
                "link": self.describe()}


def _segments_for(rate_bits: int) -> int:
    return max(1, min(MAX_SEGMENTS, int(rate_bits * PACKET_S / 8 // FRAME_BYTES)))


def paced(rate_bits: Optional[int], rtt_s: float = 0.0) -> LinkShape:
    """The faithful default: small packets and a bucket of one packet plus :data:`SLACK_S`, so a message after
    idle takes about its bytes / rate."""
    _check_rtt(rtt_s)
    if rate_bits is None:
        return LinkShape(None, 0, None, rtt_s)
    segments = _segments_for(rate_bits)
    packet = segments * FRAME_BYTES
    bucket = packet + max(BUCKET_HEADROOM_BYTES, int(rate_bits * SLACK_S / 8))
    return LinkShape(rate_bits, bucket, segments, rtt_s)


#: the smallest bucket of a bursting link: one 64 KB GSO packet is cut into frames that must fit
MIN_BURST_BYTES = 2048


def check_burst(burst_bytes: int) -> int:
    """A bursting link's bucket in bytes, or ``ValueError`` when one frame would not fit."""
    if isinstance(burst_bytes, bool) or not isinstance(burst_bytes, int) or burst_bytes < MIN_BURST_BYTES:
        raise ValueError(f"burst must be at least {MIN_BURST_BYTES} bytes (2kb: one MTU frame), got {burst_bytes!r}")
    return burst_bytes


def bursting(rate_bits: Optional[int], bucket_bytes: int, rtt_s: float = 0.0) -> LinkShape:
    """A policer with a large bucket: after idle, ``bucket_bytes`` pass at veth speed."""
    _check_rtt(rtt_s)
    return LinkShape(rate_bits, check_burst(bucket_bytes), None, rtt_s)


def _check_rtt(rtt_s: float) -> None:
    if not isinstance(rtt_s, (int, float)) or not math.isfinite(rtt_s) or rtt_s < 0:
        raise ValueError(f"rtt must be a finite number of seconds >= 0, got {rtt_s!r}")
