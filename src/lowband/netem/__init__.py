"""Emulated bandwidth-limited links on one Linux machine (network namespaces, veth pairs, tc).

``cluster`` builds the namespaces and their links; ``link`` chooses how a link is shaped so that
every message pays its bytes / rate.
"""
from .cluster import (
    MAX_WORLD_SIZE,
    NS_PREFIX,
    EmulatedCluster,
    NetemError,
    check_available,
    check_burst,
    cleanup_stale,
    has_qdisc,
    parse_rate,
)
from .link import LinkShape, bursting, paced

__all__ = ["MAX_WORLD_SIZE", "NS_PREFIX", "EmulatedCluster", "NetemError", "check_available",
           "check_burst", "cleanup_stale", "has_qdisc", "parse_rate",
           "LinkShape", "paced", "bursting"]
