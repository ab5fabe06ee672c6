"""Emulated bandwidth-limited cluster on one Linux machine.

Why: lowband's algorithms only matter on slow links, but CI and laptops have fast
loopback.  We put every worker in its own network namespace, wire the namespaces
to a Linux bridge (itself in a private "hub" namespace, so nothing touches the
host's network) with veth pairs, and shape both ends of each veth with a token
bucket filter (tc tbf): the worker-side end shapes the worker's uplink, the
hub-side end its downlink.  Gloo workers are then launched through
``ip netns exec`` with ``GLOO_SOCKET_IFNAME`` pointing at their veth.

Topology (N workers, addresses 10.233.0.(rank+1)/24)::

    ns lowband-<pid>-<id>-w0          ns lowband-<pid>-<id>-hub           ns ...-w1
    +-------------------+             +------------------------+          +-----------
    | lo (up)           |             |     bridge lb<id>br    |          | lo (up)
    | lb<id>w0 [tbf] ===|=== veth ====|=[tbf] lb<id>h0         |          |
    | 10.233.0.1/24     |             |        lb<id>h1 [tbf]==|== veth ==|=[tbf] lb<id>w1
    +-------------------+             +------------------------+          | 10.233.0.2/24

Requirements: root, iproute2 (``ip``, ``tc``) and a kernel with netns, veth,
bridge and sch_tbf.  There is no delay/loss emulation (this is tbf, not netem).

Lifetime: names embed the owner's pid and a per-run id, and a state file under
``/run/lowband`` records the owner's process start time.  ``close()`` (and
``__exit__``, SIGINT, SIGTERM, interpreter exit) remove everything; if the owner
is SIGKILLed nothing can run, so the namespaces stay until ``cleanup_stale()``
(called by the next ``EmulatedCluster.__enter__`` and available to launchers)
sees the dead owner and removes them.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

from .link import FRAME_BYTES, LinkShape, bursting, check_burst, paced

__all__ = [
    "NetemError",
    "parse_rate",
    "check_available",
    "cleanup_stale",
    "EmulatedCluster",
    "has_qdisc",
    "check_burst",
]

#: Prefix of every namespace we create; cleanup_stale only ever touches these.
NS_PREFIX = "lowband"
#: Private /24 used inside our own namespaces only (never routed to the host).
SUBNET_PREFIX = "10.233.0"
SUBNET_BITS = 24
#: Host numbers .1 .. .254 are usable in a /24.
MAX_WORLD_SIZE = 254
#: Directory for per-run state files (tmpfs, so it disappears on reboot like netns).
STATE_DIR = Path(os.environ.get("LOWBAND_NETEM_STATE_DIR", "/run/lowband"))
#: Linux IFNAMSIZ is 16 including the terminating NUL.
IFNAME_MAX = 15
#: Seconds a single ip/tc call may take before we call it hung.
CMD_TIMEOUT_S = 30.0
#: TCP congestion control on the workers' data link (the subnet's route in each worker
#: namespace): Linux's default, whatever the host uses.
#: Why not inherit: a new namespace takes the host's setting, and this machine's is BBR. Behind
#: tbf, BBR estimated a 5-16 Gbit/s bottleneck (the burst passes at line speed), and cpsgd on
#: cnn over 50mbit had 6-12 steps per 150 with 100-180 ms of exposed wait; with cubic none
#: (docs/netem.md; the exact BBR mechanism was not pinned down).
CONGESTION_CONTROL = "cubic"
#: Grace period between SIGTERM and SIGKILL for processes left in a worker namespace.
STRAGGLER_GRACE_S = 2.0

_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-([A-Za-z0-9]+)-(hub|w\d+)$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9]{1,8}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_MULT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class NetemError(RuntimeError):
    """An ip/tc command failed; carries the command line and its stderr."""

    def __init__(self, cmd: list[str], returncode: int | None, stderr: str) -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr.strip()
        status = "timed out" if returncode is None else f"exit {returncode}"
        super().__init__(f"command failed ({status}): {' '.join(cmd)}: {self.stderr or '(no stderr)'}")


# ---------------------------------------------------------------------------
# helpers


def _run(cmd: list[str], *, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a command capturing output; raise NetemError (not CalledProcessError) so
    callers see which ip/tc invocation failed and why."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise NetemError(cmd, None, f"no answer after {timeout:.0f} s") from e
    except OSError as e:  # e.g. binary missing
        raise NetemError(cmd, None, str(e)) from e
    if check and proc.returncode != 0:
        raise NetemError(cmd, proc.returncode, proc.stderr)
    return proc


def _proc_starttime(pid: int) -> int | None:
    """Start time (clock ticks since boot) of pid, or None if it does not exist.
    Used with the pid to tell 'owner still alive' from 'pid was reused'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces/parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])  # field 22 overall


def _list_netns() -> list[str]:
    proc = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def _terminate_pids(pids: list[int], grace_s: float = STRAGGLER_GRACE_S) -> None:
    """SIGTERM, then SIGKILL whoever is still there after grace_s. Only used on
    processes inside our own namespaces: without their network they cannot make
    progress and would otherwise hang in gloo until its (long) timeout."""
    me = os.getpid()
    pids = [p for p in pids if p != me]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _proc_starttime(p) is not None and not _is_zombie(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].split()[0] == "Z"


def _delete_netns(ns: str) -> bool:
    """Delete a namespace, tolerating 'already gone'. Returns True if it was removed."""
    proc = _run(["ip", "netns", "delete", ns], check=False)
    if proc.returncode == 0:
        return True
    if ns not in _list_netns():
        return False
    raise NetemError(["ip", "netns", "delete", ns], proc.returncode, proc.stderr)


# ---------------------------------------------------------------------------
# public functions


def parse_rate(text: str) -> int | None:
    """Parse a tc-style rate ("1gbit", "200mbit", "500kbit", "1.5gbit") into bits/s,
    or "none" into None (no shaping).  Units are decimal like tc's (1kbit = 1000 bit).
    Byte units such as "mbps" are rejected on purpose: in tc they mean megaBYTES/s,
    a classic factor-8 mistake."""
    if not isinstance(text, str):
        raise ValueError(f"rate must be a string like '200mbit' or 'none', got {text!r}")
    if text.strip().lower() == "none":
        return None
    m = _RATE_RE.match(text)
    if not m:
        raise ValueError(
            f"invalid rate {text!r}: expected a number followed by bit, kbit, mbit, gbit or tbit "
            "(e.g. '1gbit', '200mbit', '500kbit'), or 'none' to disable shaping"
        )
    bits = int(round(float(m.group(1)) * _RATE_MULT[m.group(2).lower()]))
    if bits <= 0:
        raise ValueError(f"invalid rate {text!r}: must be positive (use 'none' to disable shaping)")
    return bits


def _data_route(ns: str, dev: str, address: str) -> list[str]:
    """argv that puts the subnet's route in ``ns`` on ``dev`` with :data:`CONGESTION_CONTROL`.

    The congestion control rides on the route, not on the namespace's default: a non-init
    namespace may only choose a default from the host's
    ``net.ipv4.tcp_allowed_congestion_control`` (often just "reno bbr"), while a route's
    ``congctl`` applies to every connection over it, at both ends, whatever that list holds.
    Run it once the link is up (bringing a link up re-adds the kernel's own connected route)."""
    return ["ip", "-n", ns, "route", "replace", f"{SUBNET_PREFIX}.0/{SUBNET_BITS}", "dev", dev,
            "proto", "kernel", "scope", "link", "src", address, "congctl", CONGESTION_CONTROL]


def check_available() -> str | None:
    """Return None if an emulated cluster can be built here, else one line saying why.

    Why a live probe: root and the binaries are not enough inside containers, where
    netns creation or the tbf qdisc may be forbidden; we build a tiny namespace with a
    veth pair and a tbf qdisc and tear it down."""
    hint = "; use --bandwidth none to run without emulation"
    if os.geteuid() != 0:
        return f"network emulation needs root (uid {os.geteuid()}){hint}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network emulation needs `{tool}` (iproute2) on PATH{hint}"
    ns = f"{NS_PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}-hub"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "lbprobe0", "type", "veth", "peer", "name", "lbprobe1"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "lbprobe0", "root", "tbf",
              "rate", "1mbit", "burst", "3000b", "latency", "50ms"])
        _run(["ip", "-n", ns, "link", "set", "dev", "lbprobe0", "gso_max_size", str(1514), "gso_max_segs", "1"])
        for dev in ("lbprobe1", "lbprobe0"):
            _run(["ip", "-n", ns, "link", "set", "dev", dev, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{SUBNET_PREFIX}.1/{SUBNET_BITS}", "dev", "lbprobe0"])
        _run(_data_route(ns, "lbprobe0", f"{SUBNET_PREFIX}.1"))
        _run(["ip", "netns", "exec", ns, "true"])
    except NetemError as e:
        return f"network emulation unavailable: {e}{hint}"
    finally:
        try:
            _delete_netns(ns)
        except NetemError:
            pass
    return None


def cleanup_stale() -> list[str]:
    """Remove namespaces and state files of earlier runs whose owner process is dead.

    Needed because a SIGKILLed owner cannot clean up.  Owner liveness = pid exists
    and (if a state file exists) has the recorded start time, so a reused pid does
    not keep garbage alive forever.  Processes still inside a stale namespace
    (orphaned workers) are terminated, since the namespace cannot die while they
    live.  Returns the removed namespace names and state file paths."""
    removed: list[str] = []
    states: dict[tuple[int, str], dict[str, Any]] = {}
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob("*.json"):
            try:
                data = json.loads(path.read_text())
                states[(int(data["pid"]), str(data["run_id"]))] = {**data, "_path": path}
            except (OSError, ValueError, KeyError, TypeError):
                continue

    def owner_alive(pid: int, run_id: str) -> bool:
        start = _proc_starttime(pid)
        if start is None or _is_zombie(pid):
            return False
        st = states.get((pid, run_id))
        return st is None or st.get("starttime") in (None, start)

    namespaces = _list_netns() if shutil.which("ip") else []
    by_run: dict[tuple[int, str], list[str]] = {}
    for ns in namespaces:
        m = _NS_RE.match(ns)
        if m:
            by_run.setdefault((int(m.group(1)), m.group(2)), []).append(ns)
    for key in set(by_run) | set(states):
        pid, run_id = key
        if owner_alive(pid, run_id):
            continue
        # Workers first: deleting them (and their veths) before the hub is tidier.
        for ns in sorted(by_run.get(key, []), key=lambda n: n.endswith("-hub")):
            _terminate_pids(_netns_pids(ns))
            if _delete_netns(ns):
                removed.append(ns)
        st = states.get(key)
        if st is not None:
            try:
                st["_path"].unlink()
                removed.append(str(st["_path"]))
            except FileNotFoundError:
                pass
    return removed


def _shape_commands(ns: str, dev: str, shape: LinkShape, latency: str) -> list[list[str]]:
    """argv list that shapes one hop (``dev`` in ``ns``) as ``shape`` says."""
    cmds: list[list[str]] = []
    if shape.segments is not None:
        cmds.append(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", str(shape.segments * FRAME_BYTES),
                     "gso_max_segs", str(shape.segments)])
    if shape.rate_bits is not None:
        cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                     "rate", f"{shape.rate_bits}bit", "burst", f"{shape.bucket_bytes}b", "latency", latency])
    if shape.rtt_s > 0:
        parent = ["parent", "1:1"] if shape.rate_bits is not None else ["root"]
        cmds.append(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "netem",
                     "delay", f"{shape.hop_delay_s * 1e6:.0f}us", "limit", "100000"])
    return cmds


_QDISC_CACHE: dict[str, bool] = {}


def has_qdisc(kind: str) -> bool:
    """Whether this kernel can attach a ``kind`` qdisc that needs no parameters (netem, htb,
    pfifo; tried on a veth in a scratch namespace; the answer is cached for the process)."""
    if kind in _QDISC_CACHE:
        return _QDISC_CACHE[kind]
    ns = f"{NS_PREFIX}-{os.getpid()}-q{secrets.token_hex(2)}-hub"
    ok = False
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "lbq0", "type", "veth", "peer", "name", "lbq1"])
        ok = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lbq0", "root", kind], check=False).returncode == 0
    except NetemError:
        ok = False
    finally:
        try:
            _delete_netns(ns)
        except NetemError:
            pass
    _QDISC_CACHE[kind] = ok
    return ok


# ---------------------------------------------------------------------------
# the cluster


class EmulatedCluster:
    """World of `world_size` network namespaces joined by a shaped bridge.

    Use as a context manager; launch rank r as
    ``subprocess.Popen(cluster.worker_prefix(r) + cmd, env={**os.environ, **cluster.worker_env(r)})``.
    """

    def __init__(
        self,
        world_size: int,
        rate_bits: int | None,
        *,
        burst: Optional[int] = None,
        rtt_s: float = 0.0,
        latency: str = "50ms",
        run_id: str | None = None,
        terminate_stragglers: bool = True,
    ) -> None:
        """Every worker's uplink and downlink are shaped to ``rate_bits`` (None: unshaped).

        burst: None (default) gives a *paced* link (:func:`lowband.netem.link.paced`): small
        packets and a bucket of a fraction of a millisecond, so a message after an idle period
        takes about its bytes / rate. A number of bytes gives a *bursting* link instead: the
        kernel's 64 KB packets and a bucket of that size, which passes at line speed once a
        compute step has refilled it (a policer that allows bursts).
        rtt_s: round-trip propagation delay between two workers, added with the netem qdisc on
        every hop; :class:`NetemError` with one line when the kernel has no netem.
        latency: tbf's queue bound (bufferbloat) in tc syntax; 50ms drops none of TCP's
        normal bursts.
        terminate_stragglers: on close, kill processes still inside the worker
        namespaces (they would hang in gloo without a network)."""
        if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int in 1..{MAX_WORLD_SIZE}, got {world_size!r}")
        if rate_bits is not None and (not isinstance(rate_bits, int) or rate_bits <= 0):
            raise ValueError(f"rate_bits must be a positive int (bits/s) or None, got {rate_bits!r}")
        run_id = run_id if run_id is not None else secrets.token_hex(3)
        if not _RUN_ID_RE.match(run_id):
            raise ValueError(f"run_id must be 1-8 ASCII letters/digits (it is part of interface names), got {run_id!r}")
        self.world_size = world_size
        self.rate_bits = rate_bits
        self.shape: LinkShape = (paced(rate_bits, rtt_s) if burst is None
                                 else bursting(rate_bits, burst, rtt_s))
        self.latency = latency
        self.run_id = run_id
        self.terminate_stragglers = terminate_stragglers
        self.owner_pid = os.getpid()
        base = f"{NS_PREFIX}-{self.owner_pid}-{run_id}"
        self.hub_ns = f"{base}-hub"
        self.worker_ns = [f"{base}-w{r}" for r in range(world_size)]
        self.bridge = f"lb{run_id}br"
        self.worker_if = [f"lb{run_id}w{r}" for r in range(world_size)]
        self.hub_if = [f"lb{run_id}h{r}" for r in range(world_size)]
        for name in [self.bridge, *self.worker_if, *self.hub_if]:
            if len(name) > IFNAME_MAX:
                raise ValueError(f"interface name {name!r} exceeds {IFNAME_MAX} chars; use a shorter run_id")
        self.addresses = [f"{SUBNET_PREFIX}.{r + 1}" for r in range(world_size)]
        self.master_addr = self.addresses[0]
        self.state_file = STATE_DIR / f"{base}.json"
        self._created: list[str] = []  # namespaces in creation order
        self._entered = False
        self._closed = False
        self._lock = threading.RLock()
        self._prev_handlers: dict[int, Any] = {}
        self._handler: Callable[[int, FrameType | None], None] | None = None

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> "EmulatedCluster":
        if self._entered:
            raise RuntimeError("EmulatedCluster can only be entered once")
        self._entered = True
        cleanup_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        # State file before any namespace exists, so a SIGKILL at any point leaves a
        # record cleanup_stale can verify against.
        self.state_file.write_text(json.dumps({
            "pid": self.owner_pid,
            "starttime": _proc_starttime(self.owner_pid),
            "run_id": self.run_id,
            "namespaces": [self.hub_ns, *self.worker_ns],
            "created": time.time(),
        }))
        if self.shape.rtt_s > 0 and not has_qdisc("netem"):
            raise NetemError(["tc", "qdisc", "add", "netem"], None,
                             "this kernel has no netem qdisc, so propagation delay cannot be emulated "
                             "(links are still shaped to their rate without it: use an rtt of 0)")
        self._install_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove everything; idempotent and tolerant of partial state.  Errors while
        tearing down are swallowed (teardown must not mask the original error), but
        anything left over is then found by cleanup_stale() once we are gone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._restore_handlers()
            try:
                existing = set(_list_netns())
            except NetemError:
                existing = set(self._created)
            for ns in [*self.worker_ns, self.hub_ns]:
                if ns not in existing:
                    continue
                try:
                    if self.terminate_stragglers and ns != self.hub_ns:
                        _terminate_pids(_netns_pids(ns))
                    _delete_netns(ns)
                except NetemError:
                    pass
            try:
                self.state_file.unlink()
            except OSError:
                pass

    def _install_handlers(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works in the main thread; atexit still covers normal exit

        def handler(signum: int, frame: FrameType | None) -> None:
            prev = self._prev_handlers.get(signum, signal.SIG_DFL)
            self.close()  # restores previous handlers
            if callable(prev):
                prev(signum, frame)  # e.g. default_int_handler -> KeyboardInterrupt
            elif prev == signal.SIG_DFL:
                os.kill(os.getpid(), signum)  # die the way the signal intended

        self._handler = handler
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:
                continue  # the process will not die from it, so nothing to clean up
            self._prev_handlers[sig] = prev
            signal.signal(sig, handler)

    def _restore_handlers(self) -> None:
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover - atexit never raises here in practice
            pass
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._prev_handlers.items():
            # Only restore if nobody replaced our handler in the meantime.
            if signal.getsignal(sig) is self._handler:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_handlers.clear()

    def _build(self) -> None:
        hub = self.hub_ns
        self._add_ns(hub)
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        _run(["ip", "-n", hub, "link", "add", "name", self.bridge, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", self.bridge, "up"])
        for r in range(self.world_size):
            ns, wif, hif = self.worker_ns[r], self.worker_if[r], self.hub_if[r]
            self._add_ns(ns)
            # lo must be up: gloo/TCPStore connect to their own address too, and some
            # code paths use 127.0.0.1; a fresh namespace has lo DOWN.
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Create the pair directly in its two namespaces: names never appear in
            # the host namespace, so concurrent runs cannot collide there.
            _run(["ip", "link", "add", wif, "netns", ns, "type", "veth", "peer", "name", hif, "netns", hub])
            # No IPv6 on the data link: keeps router solicitations/MLD out of the byte
            # counters and stops gloo from picking a link-local address.
            _run(["ip", "-n", ns, "link", "set", "dev", wif, "addrgenmode", "none"])
            _run(["ip", "-n", hub, "link", "set", "dev", hif, "addrgenmode", "none"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[r]}/{SUBNET_BITS}", "dev", wif])
            _run(["ip", "-n", hub, "link", "set", "dev", hif, "master", self.bridge])
            for n, dev in ((ns, wif), (hub, hif)):  # uplink, downlink
                for cmd in _shape_commands(n, dev, self.shape, self.latency):
                    _run(cmd)
            _run(["ip", "-n", hub, "link", "set", "dev", hif, "up"])
            _run(["ip", "-n", ns, "link", "set", "dev", wif, "up"])
            # cubic on the data link (see _data_route for why not the namespace's sysctl)
            _run(_data_route(ns, wif, self.addresses[r]))

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)

    # -- queries -------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """All namespace names of this run (hub first)."""
        return [self.hub_ns, *self.worker_ns]

    def worker_prefix(self, rank: int) -> list[str]:
        """argv prefix that runs a command inside rank's namespace."""
        self._check_rank(rank)
        return ["ip", "netns", "exec", self.worker_ns[rank]]

    def worker_env(self, rank: int) -> dict[str, str]:
        """Env vars gloo needs in rank's namespace: the interface to bind and where the
        TCPStore master (rank 0) listens.  MASTER_PORT is the launcher's choice."""
        self._check_rank(rank)
        return {"GLOO_SOCKET_IFNAME": self.worker_if[rank], "MASTER_ADDR": self.master_addr}

    def set_link(self, rank: int, up: bool) -> None:
        """Cut rank's link (``up=False``) or restore it (``up=True``), as a cable pulled out and
        plugged back in.

        Down: both ends of rank's veth go down, the worker's (the worker sees its interface
        down, as :func:`lowband.runtime.rendezvous.links_down` reads it, and its namespace
        loses the subnet's route, so a connection from it fails at once with "network is
        unreachable") and then the hub's (the bridge stops forwarding to it, and what its
        queue held for the worker is dropped). Established connections are not closed: they
        stall, and TCP retransmits until the link is back or the peer gives up.
        Up: the hub's end, then the worker's, then the subnet's route with
        :data:`CONGESTION_CONTROL` (:func:`_data_route`): the kernel deleted that route when
        the device went down and re-adds only its own connected one, without ``congctl``.
        The shaping (each end's qdiscs) stays as built. Setting a link to the state it is in
        changes nothing."""
        self._check_rank(rank)
        ns, wif, hif = self.worker_ns[rank], self.worker_if[rank], self.hub_if[rank]
        if up:
            _run(["ip", "-n", self.hub_ns, "link", "set", "dev", hif, "up"])
            _run(["ip", "-n", ns, "link", "set", "dev", wif, "up"])
            _run(_data_route(ns, wif, self.addresses[rank]))
        else:
            _run(["ip", "-n", ns, "link", "set", "dev", wif, "down"])
            _run(["ip", "-n", self.hub_ns, "link", "set", "dev", hif, "down"])

    def link_counters(self) -> dict[int, tuple[int, int]]:
        """Per rank (tx_bytes, rx_bytes) of the worker-side veth, straight from the
        kernel, so callers can check what really went over the wire (incl. headers)."""
        out: dict[int, tuple[int, int]] = {}
        for r in range(self.world_size):
            proc = _run(["ip", "-n", self.worker_ns[r], "-j", "-s", "link", "show", "dev", self.worker_if[r]])
            try:
                stats = json.loads(proc.stdout)[0]["stats64"]
                out[r] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
            except (ValueError, LookupError, TypeError) as e:
                raise NetemError(["ip", "-n", self.worker_ns[r], "-j", "-s", "link"], 0,
                                 f"unexpected output {proc.stdout[:200]!r}") from e
        return out

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for world_size {self.world_size}")
