"""Tests for lowband.netem: rate parsing, a real shaped gloo all_reduce across
namespaces, and that nothing is left behind on exit, Ctrl-C, SIGTERM or SIGKILL."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lowband import netem
from lowband.netem import link
from lowband.comm.wire import allreduce_bytes
from lowband.netem import EmulatedCluster, check_burst, cleanup_stale, parse_rate

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
WORKER = HERE / "netem_worker.py"
MASTER_PORT = "29517"  # rank 0's namespace is fresh, so any port is free there

_WHY = netem.check_available()
needs_netns = pytest.mark.skipif(_WHY is not None, reason=f"netem unavailable: {_WHY}")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return env


def _leftovers(run_id: str) -> list[str]:
    """Any netns or link (in the host or any namespace) carrying this run's names."""
    found = [n for n in netem.cluster._list_netns() if f"-{run_id}-" in n]
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [line for line in host_links.splitlines() if f"lb{run_id}" in line]
    all_links = subprocess.run(["ip", "-all", "netns", "exec", "ip", "-o", "link"],
                               capture_output=True, text=True).stdout
    found += [line for line in all_links.splitlines() if f"lb{run_id}" in line]
    return found


# ---------------------------------------------------------------- parse_rate


@pytest.mark.parametrize("text,bits", [
    ("1gbit", 1_000_000_000), ("200mbit", 200_000_000), ("500kbit", 500_000),
    ("1.5gbit", 1_500_000_000), ("  100MBit ", 100_000_000), ("64bit", 64),
    ("none", None), ("None", None),
])
def test_parse_rate_ok(text: str, bits: int | None) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "100", "100mbps", "fast", "-1mbit", "0mbit", "1 gb", "mbit"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


def test_paced_link_shape_keeps_every_message_within_a_fraction_of_a_millisecond_of_its_wire_time() -> None:
    """The paced default: the lead any message can gain over bytes / rate (bucket / rate) stays
    under 0.75 ms at every rate the bench offers, and under 0.2 ms from 200 Mbit/s up; packets
    are whole MSS segments that fit the bucket."""
    for rate in (10**6, 20 * 10**6, 50 * 10**6, 200 * 10**6, 10**9, 10**10):
        shape = netem.paced(rate)
        assert shape.model == "paced" and 1 <= shape.segments <= 44
        assert shape.bucket_bytes >= shape.segments * 1514 + 86
        # ahead of the wire by at most one packet (a frame, or PACKET_S of the rate) and the slack
        frame_s = 1514 * 8 / rate
        assert shape.lead_s <= max(frame_s, link.PACKET_S) + link.SLACK_S + 86 * 8 / rate, (rate, shape)
        if rate >= 20 * 10**6:
            assert shape.lead_s <= 0.75e-3, (rate, shape)
    assert netem.paced(50 * 10**6).segments == 1 and netem.paced(200 * 10**6).segments == 4
    assert netem.paced(10**10).segments == 44
    assert EmulatedCluster(2, 10**9).shape == netem.paced(10**9)
    bursting = EmulatedCluster(2, 10**9, burst=1 << 20).shape
    assert bursting.model == "bursting" and bursting.bucket_bytes == 1 << 20 and bursting.segments is None
    assert "rtt 40 ms" in netem.paced(10**8, rtt_s=0.04).describe()
    assert netem.paced(None).model == "unshaped" and netem.paced(None).as_row()["link"] == "unshaped"
    with pytest.raises(ValueError, match="rtt"):
        netem.paced(10**8, rtt_s=-1)


def test_check_available_is_one_line_or_none() -> None:
    why = netem.check_available()
    assert why is None or ("\n" not in why and "--bandwidth none" in why)


def test_check_available_explains_missing_root_and_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in (netem.check_available() or "")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem.cluster.shutil, "which", lambda tool: None)
    assert "`ip`" in (netem.check_available() or "")


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        EmulatedCluster(0, None)
    with pytest.raises(ValueError):
        EmulatedCluster(2, None, run_id="has-dash")
    c = EmulatedCluster(3, 10**8, run_id="abc")
    assert all(len(n) <= 15 for n in [c.bridge, *c.worker_if, *c.hub_if])
    assert c.worker_prefix(2) == ["ip", "netns", "exec", c.worker_ns[2]]
    with pytest.raises(IndexError):
        c.worker_env(3)


# ---------------------------------------------------------------- real cluster


def _all_reduce_on(cluster: EmulatedCluster, size: int) -> list[dict]:
    """Each rank's JSON line from netem_worker.py: one all_reduce of ``size`` bytes, timed."""
    world, procs = cluster.world_size, []
    for r in range(world):
        env = {**_child_env(), **cluster.worker_env(r), "RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_PORT": MASTER_PORT}
        procs.append(subprocess.Popen(
            cluster.worker_prefix(r) + [sys.executable, str(WORKER), "--bytes", str(size)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=45)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_check_burst() -> None:
    assert check_burst(8192) == 8192 and check_burst(2048) == 2048
    with pytest.raises(ValueError, match="at least 2048 bytes"):
        check_burst(1500)


def _delivery_after_idle(burst: int | None, rate_text: str, size: int) -> float:
    """Median seconds for one ``size`` message after 60 ms idle over a warmed TCP connection
    between two workers (the probe of benchmarks/netem_link.py)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("netem_link", HERE.parent / "benchmarks" / "netem_link.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    # no bulk phase, and a warm-up of 4x the message instead of 4 MB (1.7 s each at 20 Mbit/s)
    result = probe.measure(rate_text, burst, [size], reps=3, idle_s=0.06, bulk_s=0, warm_bytes=4 * size)
    return result["times"][str(size)]


@needs_netns
def test_a_message_after_idle_pays_its_wire_time_on_the_default_link() -> None:
    """The default (paced) link charges a 96 KB message after idle at 20 Mbit/s at least 0.85x of
    bytes x 8 / rate; a bursting link with a 96 KB bucket (``--burst 96kb``) lets it through at
    line speed, far under its wire time."""
    size, rate = 96 * 1024, 20 * 10**6
    ideal = size * 8 / rate
    paced_s = _delivery_after_idle(None, "20mbit", size)
    assert 0.85 * ideal <= paced_s <= 1.6 * ideal, (paced_s, ideal)
    bursting_s = _delivery_after_idle(check_burst(192 * 1024), "20mbit", size)
    assert bursting_s < 0.5 * ideal, (bursting_s, ideal)


@needs_netns
def test_paced_link_sets_small_packets_on_both_ends() -> None:
    with EmulatedCluster(2, 50 * 10**6) as c:
        for ns, dev in ((c.worker_ns[0], c.worker_if[0]), (c.hub_ns, c.hub_if[0])):
            info = json.loads(subprocess.run(["ip", "-n", ns, "-j", "-d", "link", "show", "dev", dev],
                                             capture_output=True, text=True, check=True).stdout)[0]
            assert info["gso_max_segs"] == 1
            qd = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            bucket = int(re.search(r"burst (\d+)b", qd).group(1))   # tc shows it after rounding to time
            assert "tbf" in qd and abs(bucket - c.shape.bucket_bytes) <= 16, qd


def test_rtt_without_netem_is_one_line() -> None:
    if netem.check_available() is not None:
        pytest.skip("no network namespaces here")
    if netem.has_qdisc("netem"):
        pytest.skip("this kernel has netem; the refusal cannot be shown")
    with pytest.raises(netem.NetemError, match="no netem qdisc"):
        with EmulatedCluster(2, 10**7, rtt_s=0.04):
            pass


@needs_netns
def test_shaped_gloo_allreduce() -> None:
    world, rate, size = 2, parse_rate("100mbit"), 8 * 2**20
    assert rate is not None
    with EmulatedCluster(world, rate) as c:
        run_id = c.run_id
        assert _leftovers(run_id)  # sanity: the probe sees live state
        before = c.link_counters()
        results = _all_reduce_on(c, size)
        after = c.link_counters()
        # qdiscs really are on both ends
        qd = subprocess.run(["tc", "-n", c.hub_ns, "qdisc"], capture_output=True, text=True).stdout
        assert qd.count("tbf") == world
    assert all(res["ok"] for res in results)
    payload = allreduce_bytes(size, world)  # ring all_reduce bytes sent per rank
    expected_s = payload * 8 / rate
    measured_s = max(res["times"][0] for res in results)
    assert measured_s >= 0.7 * expected_s, (measured_s, expected_s)
    assert measured_s <= 5.0 * expected_s, (measured_s, expected_s)
    for r in range(world):
        assert after[r][0] - before[r][0] >= payload
        assert after[r][1] - before[r][1] >= payload
    assert _leftovers(run_id) == []


@needs_netns
def test_connections_over_the_emulated_link_use_the_linux_default_congestion_control() -> None:
    """Not the host's (BBR on this machine, which stalls small transfers behind tbf's burst),
    at both ends of a live connection, whatever the host's allowed list holds."""
    server = ("import socket, sys\n"
              "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              "s.bind((sys.argv[1], 29411)); s.listen(); print('ready', flush=True)\n"
              "c, _ = s.accept(); c.recv(1); sys.stdin.read()\n")
    with EmulatedCluster(2, 10_000_000) as c:
        srv = subprocess.Popen([*c.worker_prefix(1), sys.executable, "-c", server, c.addresses[1]],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "ready"
            client = subprocess.Popen([*c.worker_prefix(0), sys.executable, "-c",
                                       "import socket, sys; s = socket.create_connection((sys.argv[1], 29411)); "
                                       "s.sendall(b'x' * 20000); sys.stdin.read()", c.addresses[1]],
                                      stdin=subprocess.PIPE, text=True)
            try:
                seen = {}
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and len(seen) < 2:
                    for r in (0, 1):
                        out = subprocess.run([*c.worker_prefix(r), "ss", "-tin", "state", "established"],
                                             capture_output=True, text=True, check=True).stdout
                        algos = set(re.findall(r"\b(cubic|bbr|reno|htcp|vegas|dctcp)\b", out))
                        if algos:
                            seen[r] = algos
                    time.sleep(0.1)
                assert seen == {0: {netem.cluster.CONGESTION_CONTROL}, 1: {netem.cluster.CONGESTION_CONTROL}}
                assert netem.cluster.CONGESTION_CONTROL == "cubic"
            finally:
                client.communicate("", timeout=10)
        finally:
            srv.communicate("", timeout=10)


def _connect(c: EmulatedCluster, rank: int, to: int, port: int) -> str:
    """Open a TCP connection from ``rank``'s namespace to ``to``'s address: "ok", or the error."""
    probe = ("import socket, sys\n"
             "try:\n"
             "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close(); print('ok')\n"
             "except OSError as e:\n"
             "    print(type(e).__name__, e.errno)\n")
    return subprocess.run([*c.worker_prefix(rank), sys.executable, "-c", probe, c.addresses[to], str(port)],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()


@needs_netns
def test_set_link_cuts_a_worker_off_and_restores_its_route_with_cubic() -> None:
    """Down: the worker cannot open a connection (its namespace has no route to the subnet), and
    both ends of its veth are down. Up: connections go through again, over a route that carries
    the cluster's congestion control, and the shaping is still there."""
    server = ("import socket, sys\n"
              "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              "s.bind((sys.argv[1], 29412)); s.listen(); print('ready', flush=True)\n"
              "while True:\n"
              "    s.accept()[0].close()\n")

    def route(c: EmulatedCluster) -> str:
        return subprocess.run(["ip", "-n", c.worker_ns[1], "route", "show", f"{netem.cluster.SUBNET_PREFIX}.0/24"],
                              capture_output=True, text=True, check=True).stdout

    def state(ns: str, dev: str) -> str:
        info = subprocess.run(["ip", "-n", ns, "-j", "link", "show", "dev", dev],
                              capture_output=True, text=True, check=True).stdout
        return "UP" if "UP" in json.loads(info)[0]["flags"] else "DOWN"

    with EmulatedCluster(2, 50 * 10**6) as c:
        srv = subprocess.Popen([*c.worker_prefix(0), sys.executable, "-c", server, c.addresses[0]],
                               stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout.readline().strip() == "ready"
            assert _connect(c, 1, 0, 29412) == "ok"
            c.set_link(1, up=False)
            assert route(c) == ""
            assert _connect(c, 1, 0, 29412) == f"OSError {errno.ENETUNREACH}"
            assert (state(c.worker_ns[1], c.worker_if[1]), state(c.hub_ns, c.hub_if[1])) == ("DOWN", "DOWN")
            c.set_link(1, up=True)
            assert f"congctl {netem.cluster.CONGESTION_CONTROL}" in route(c), route(c)
            assert _connect(c, 1, 0, 29412) == "ok"
            assert (state(c.worker_ns[1], c.worker_if[1]), state(c.hub_ns, c.hub_if[1])) == ("UP", "UP")
            for ns, dev in ((c.worker_ns[1], c.worker_if[1]), (c.hub_ns, c.hub_if[1])):
                qd = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                                    text=True, check=True).stdout
                assert "tbf" in qd, qd
            with pytest.raises(IndexError):
                c.set_link(2, up=False)
        finally:
            srv.kill()
            srv.wait()


@needs_netns
def test_close_is_idempotent_and_tolerates_partial_state() -> None:
    c = EmulatedCluster(2, None)
    with c:
        subprocess.run(["ip", "netns", "delete", c.worker_ns[1]], check=True)  # simulate partial state
        with pytest.raises(netem.NetemError, match="ip -n"):
            c.link_counters()
    c.close()
    c.close()
    assert _leftovers(c.run_id) == []
    assert not c.state_file.exists()


@needs_netns
def test_error_inside_with_cleans_up() -> None:
    run_id = secrets.token_hex(3)
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, parse_rate("10mbit"), run_id=run_id):
            raise RuntimeError("boom")
    assert _leftovers(run_id) == []


_OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from lowband.netem import EmulatedCluster
    c = EmulatedCluster(2, 10_000_000, run_id=sys.argv[1]).__enter__()
    # a 'worker' living in rank 0's namespace, as a launcher would start it
    w = subprocess.Popen(c.worker_prefix(0) + ["sleep", "60"])
    print("READY", w.pid, flush=True)
    time.sleep(60)
""")


def _default_signals() -> None:
    """In the child before exec: SIGINT and SIGTERM at their defaults, as a terminal's job gets
    them, whatever the test process inherited (a signal ignored there stays ignored in every
    child, and Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _start_owner(run_id: str) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", _OWNER, run_id], env=_child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("READY"), p.stderr.read() if p.stderr else line
    return p, int(line.split()[1])


def _gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if netem.cluster._proc_starttime(pid) is None or netem.cluster._is_zombie(pid):
            return True
        time.sleep(0.05)
    return False


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_owner_leaves_nothing(sig: signal.Signals) -> None:
    run_id = secrets.token_hex(3)
    p, worker_pid = _start_owner(run_id)
    assert _leftovers(run_id)
    p.send_signal(sig)
    p.communicate(timeout=15)
    assert p.returncode != 0  # it died of the signal (or KeyboardInterrupt), after cleanup
    assert _leftovers(run_id) == []
    assert _gone(worker_pid)  # straggler in the namespace was terminated


@needs_netns
def test_sigkilled_owner_is_cleaned_by_cleanup_stale() -> None:
    run_id = secrets.token_hex(3)
    p, worker_pid = _start_owner(run_id)
    p.kill()
    p.wait(timeout=15)  # not communicate(): the orphaned worker still holds the pipes
    for f in (p.stdout, p.stderr):
        if f is not None:
            f.close()
    assert len([n for n in netem.cluster._list_netns() if f"-{run_id}-" in n]) == 3  # hub + 2 workers survive
    removed = cleanup_stale()
    assert sum(f"-{run_id}" in r for r in removed) == 4  # 3 namespaces + state file
    assert _leftovers(run_id) == []
    assert _gone(worker_pid)
