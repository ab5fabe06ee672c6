"""How faithful lowband's emulated links are: delivery time after idle against bytes / rate.

For each rate, worker 0 of an :class:`lowband.netem.EmulatedCluster` holds a warmed TCP
connection to worker 1 (with ``--ring``, every one of ``--workers`` workers to the next at the
same time, so every uplink and downlink carries one stream, as in a ring all-reduce). A sender
waits ``--idle`` seconds (what a compute step leaves the link), sends one message and waits for a
1-byte answer; the slowest sender's median over ``--reps`` is divided by
the ideal ``bytes * 8 / rate``. Then a bulk phase streams 4 MB messages for ``--bulk-s`` seconds:
the slowest sender's payload rate over the configured rate (TCP/IP and Ethernet headers take about
4.5% on MTU frames), and the kernel CPU (system + irq + softirq in /proc/stat, less the same
machine's idle baseline measured just before) per GB of payload, which is where veth, bridge and
tbf spend their time. The row for rate ``none`` is the unshaped reference for that CPU.

    PYTHONPATH=src python benchmarks/netem_link.py --rates none,20mbit,50mbit,200mbit,1gbit
    PYTHONPATH=src python benchmarks/netem_link.py --rates 20mbit --burst 96kb    # a bursting link
    PYTHONPATH=src python benchmarks/netem_link.py --rates 20mbit,200mbit --workers 8 --ring

Needs root and network namespaces (the same as ``lowband bench --bandwidth``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PORT = 29611
SIZES = (16 << 10, 48 << 10, 96 << 10, 400 << 10, 2 << 20, 4 << 20)
BULK_MESSAGE = 4 << 20


def _kernel_cpu_s() -> float:
    """system + irq + softirq seconds of the whole machine so far."""
    fields = open("/proc/stat").readline().split()
    return sum(int(fields[i]) for i in (3, 6, 7)) / os.sysconf("SC_CLK_TCK")


def serve() -> None:
    """Receiver: read length-prefixed messages, answer each with one byte."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", PORT))
    srv.listen(1)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(1 << 22))
    while True:
        header = conn.recv(8, socket.MSG_WAITALL)
        n = int.from_bytes(header, "little") if len(header) == 8 else 0
        if n == 0:
            return
        got = 0
        while got < n:
            got += conn.recv_into(buf[: min(len(buf), n - got)])
        conn.sendall(b"a")


def send(address: str, sizes: list[int], reps: int, idle_s: float, bulk_s: float, warm_bytes: int = BULK_MESSAGE
         ) -> None:
    """Sender: delivery times after idle, then the bulk phase (none when ``bulk_s`` is 0);
    prints one JSON line."""
    conn = socket.socket()
    for _ in range(200):
        try:
            conn.connect((address, PORT))
            break
        except OSError:
            time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b"x" * max(max(sizes), BULK_MESSAGE)

    def exchange(n: int) -> float:
        t0 = time.perf_counter()
        conn.sendall(n.to_bytes(8, "little") + payload[:n])
        conn.recv(1)
        return time.perf_counter() - t0

    # Warm the connection as a long training run has: TCP grows its congestion window and the
    # receiver's buffer (autotuning) only as traffic needs them. After three 1 MB messages a
    # 1-3 MB message still took ~1.2x its wire time at 1 Gbit/s, and even unshaped 2 MB was
    # slower than 4 MB; after the largest message every size reads ~1.07x. A probe of small
    # messages alone may warm with less (``warm_bytes``).
    for _ in range(3):
        exchange(warm_bytes)
    times = {}
    for n in sizes:
        samples = []
        for _ in range(reps):
            time.sleep(idle_s)
            samples.append(exchange(n))
        times[n] = statistics.median(samples)
    if bulk_s <= 0:
        conn.sendall((0).to_bytes(8, "little"))
        print(json.dumps({"times": times, "bulk_bits_per_s": None, "kernel_cpu_s_per_gb": None}), flush=True)
        return
    c0 = _kernel_cpu_s()
    time.sleep(1.0)
    baseline = _kernel_cpu_s() - c0
    c0, t0, sent = _kernel_cpu_s(), time.perf_counter(), 0
    while time.perf_counter() - t0 < bulk_s:
        exchange(BULK_MESSAGE)
        sent += BULK_MESSAGE
    elapsed = time.perf_counter() - t0
    cpu = _kernel_cpu_s() - c0 - baseline * elapsed
    conn.sendall((0).to_bytes(8, "little"))
    print(json.dumps({"times": times, "bulk_bits_per_s": sent * 8 / elapsed,
                      "kernel_cpu_s_per_gb": cpu / (sent / 1e9)}), flush=True)


def measure(rate_text: str, burst: int | None, sizes: list[int], reps: int, idle_s: float, bulk_s: float,
            workers: int = 2, ring: bool = False, warm_bytes: int = BULK_MESSAGE) -> dict:
    """Worker 0 sends to worker 1; with ``ring`` every worker r sends to worker r+1 (mod workers)
    at the same time, so every uplink and every downlink carries one stream, as in a ring
    all-reduce. The slowest sender's median counts. ``bulk_s=0`` skips the bulk phase (its two
    results are then None); ``warm_bytes`` is the size of the three messages that warm the
    connection first."""
    from lowband.netem import EmulatedCluster, parse_rate

    rate = parse_rate(rate_text)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    me = [sys.executable, str(Path(__file__).resolve())]
    with EmulatedCluster(workers, rate, burst=burst) as cluster:
        servers = [subprocess.Popen(cluster.worker_prefix(r) + me + ["--serve"], env=env) for r in range(workers)]
        senders = [subprocess.Popen(cluster.worker_prefix(r) + me + [
            "--send", cluster.addresses[(r + 1) % workers], "--sizes", ",".join(map(str, sizes)),
            "--reps", str(reps), "--idle", str(idle_s), "--bulk-s", str(bulk_s), "--warm-bytes", str(warm_bytes)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(workers if ring else 1)]
        outs = []
        try:
            for p in senders:
                stdout, stderr = p.communicate(timeout=900)
                if p.returncode != 0:
                    raise SystemExit(f"sender failed: {stderr[-2000:]}")
                outs.append(json.loads(stdout.strip().splitlines()[-1]))
        finally:
            for p in senders + servers:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=60)
        link = cluster.shape.describe()
    bulk = bulk_s > 0
    return {"times": {n: max(o["times"][n] for o in outs) for n in outs[0]["times"]},
            "bulk_bits_per_s": min(o["bulk_bits_per_s"] for o in outs) if bulk else None,
            # every sender read the whole machine's kernel CPU over (about) the same window
            "kernel_cpu_s_per_gb": (statistics.median(o["kernel_cpu_s_per_gb"] for o in outs) / len(outs)
                                    if bulk else None),
            "link": link, "rate": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="none,20mbit,50mbit,200mbit,1gbit",
                    help="comma-separated tc rates; 'none' is the unshaped reference (default: %(default)s)")
    ap.add_argument("--burst", default=None, help="a bursting link with this bucket, e.g. 96kb (default: paced)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes")
    ap.add_argument("--reps", type=int, default=5, help="messages per size; the median is reported (default: 5)")
    ap.add_argument("--idle", type=float, default=0.06, help="seconds of idle before each message (default: 0.06)")
    ap.add_argument("--bulk-s", type=float, default=4.0, help="seconds of the bulk phase (default: 4)")
    ap.add_argument("--workers", type=int, default=2, help="workers in the cluster (default: 2)")
    ap.add_argument("--ring", action="store_true",
                    help="every worker sends to the next at the same time (default: only worker 0 sends)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--send", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm-bytes", type=int, default=BULK_MESSAGE, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.serve:
        serve()
        return
    if args.send:
        send(args.send, sizes, args.reps, args.idle, args.bulk_s, args.warm_bytes)
        return
    burst = None
    if args.burst:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        from lowband.perf.network import parse_bytes
        burst = int(parse_bytes(args.burst))
    heads = " | ".join(f"{n >> 10} KB" if n < 1 << 20 else f"{n >> 20} MB" for n in sizes)
    who = "each sending to the next at once" if args.ring else "worker 0 sending to worker 1"
    print(f"{args.workers} workers, {who}; "
          f"delivery after {args.idle * 1e3:g} ms idle, measured / ideal (ideal = bytes x 8 / rate), "
          f"median of {args.reps} (the slowest sender); bulk payload rate / rate (the slowest sender); kernel CPU-s per GB of payload\n")
    print(f"| rate | link | {heads} | bulk | CPU-s/GB |")
    print("|---|---|" + "---:|" * (len(sizes) + 2))
    for rate_text in [r.strip() for r in args.rates.split(",") if r.strip()]:
        r = measure(rate_text, burst, sizes, args.reps, args.idle, args.bulk_s, args.workers, args.ring)
        cells = []
        for n in sizes:
            t = r["times"][str(n)]
            if r["rate"] is None:
                cells.append(f"{t * 1e3:.2f} ms")
            else:
                ideal = n * 8 / r["rate"]
                cells.append(f"{t / ideal:.2f}" + ("" if ideal >= 1e-3 else "*"))
        bulk = (f"{r['bulk_bits_per_s'] / r['rate']:.2f}" if r["rate"] else f"{r['bulk_bits_per_s'] / 1e9:.1f} Gbit/s")
        print(f"| {rate_text} | {r['link']} | " + " | ".join(cells) + f" | {bulk} | {r['kernel_cpu_s_per_gb']:.1f} |",
              flush=True)
    print("\n* ideal under 1 ms: the fixed cost of a message (two syscalls, one answer) dominates")


if __name__ == "__main__":
    main()
