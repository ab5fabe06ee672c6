"""Emulated bandwidth-limited links on one Linux machine (network namespaces, veth pairs, tc).

``cluster`` builds the namespaces and their links; ``link`` chooses how a link is shaped so that
every message pays its bytes / rate.
"""
from .cluster import (
    MAX_WORLD_SIZE,
    NS_PREFIX,
    EmulatedCluster,
    NetemError,
    auto_burst,
    check_available,
    check_burst,
    cleanup_stale,
    parse_rate,
)

__all__ = ["MAX_WORLD_SIZE", "NS_PREFIX", "EmulatedCluster", "NetemError", "auto_burst", "check_available",
           "check_burst", "cleanup_stale", "parse_rate"]
