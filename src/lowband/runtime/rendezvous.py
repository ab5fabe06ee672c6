"""Joining the process group without exposing the rendezvous to the network.

``init_process_group("env://")`` with ``MASTER_ADDR=127.0.0.1`` does *not* keep the store
local: torch's TCPStore server (libuv backend, torch 2.x) listens on the wildcard address
(``ss -ltnp`` shows ``*:PORT``) whatever host name it is given, so any machine that can reach
this one could talk to the unauthenticated key-value store while a run is going. When the
master address is a loopback address, rank 0 therefore binds the listening socket itself,
to that address only, and hands it to the TCPStore (``master_listen_fd``); the other ranks
connect as plain clients. Any other master address is an explicit choice (``--master-addr``)
and keeps torch's default behaviour, as does torchrun (its agent hosts the store; start it
with ``--master-addr``/``--rdzv-endpoint`` on the interface you mean).

:func:`links_down` tells a worker that lost contact with its peers whether its own network
interface (``GLOO_SOCKET_IFNAME``) is down, so the cut-off rank can say so.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from datetime import timedelta
from typing import Mapping, Optional

import torch.distributed as dist

#: pending connections the store's listening socket queues (torch uses the same default)
LISTEN_BACKLOG = 2048
#: set by torchrun when its elastic agent hosts the store on MASTER_PORT (we must not bind it)
TORCHRUN_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: the interfaces gloo uses (comma-separated), when the launcher or the user names them
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
SIOCGIFFLAGS = 0x8913           # Linux ioctl: an interface's flags
IFF_UP, IFF_RUNNING = 0x1, 0x40  # administratively up; carrier (operationally up)
IFREQ = "16s24x"                 # struct ifreq: the name, then a union whose first short is the flags


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def loopback_store(addr: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore whose server (on rank 0) listens on ``addr`` only."""
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(LISTEN_BACKLOG)
    # the store owns the descriptor from here on (detach: Python must not close it on GC)
    return dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def init_process_group(backend: str, timeout: timedelta, env: Optional[dict] = None) -> None:
    """Join the world described by the torch.distributed environment variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), keeping a loopback rendezvous on loopback."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if not is_loopback(addr) or env.get(TORCHRUN_AGENT_STORE) == "True":
        # an explicit non-loopback address, or torchrun, whose agent already hosts the store
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = loopback_store(addr, int(env["MASTER_PORT"]), rank, world, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def links_down(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The interfaces named in ``GLOO_SOCKET_IFNAME`` that are down in this process's network
    namespace: set down, without carrier, or gone. A worker that lost contact with its peers
    asks this to tell whether it is the one cut off. Empty when no interface is named, or
    where the flags cannot be read (not Linux)."""
    names = [n.strip() for n in (os.environ if env is None else env).get(GLOO_IFNAME, "").split(",") if n.strip()]
    if not names:
        return []
    try:
        import fcntl
    except ImportError:
        return []
    down = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack(IFREQ, name.encode()[:15]))
            except OSError as e:
                if e.errno == errno.ENODEV:     # the interface is gone
                    down.append(name)
                continue
            flags = struct.unpack_from("H", reply, 16)[0]
            if not (flags & IFF_UP and flags & IFF_RUNNING):
                down.append(name)
    return down
