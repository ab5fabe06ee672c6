"""What torchrun's elastic agent tells a worker about its job.

torchrun sets ``TORCHELASTIC_RESTART_COUNT`` in every worker it starts: how many times this
node's agent has restarted its workers after a failure (``--max-restarts``). A node whose
workers are restarted only because another node rejoined the rendezvous reports 0 ("membership
changes do not count as retries"), so the ranks of one restarted job may read different counts:
a worker that acts on a restart takes the largest count over the ranks (:mod:`lowband.app.train`).

torch 2.13's agent also shares its rendezvous TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE``),
and that store outlives a restart: the workers' keys of the failed attempt are still there, so a
restarted gloo worker can read a peer's address from the failed attempt and fail to connect
(pytorch/pytorch#135712; seen here as "Gloo connectFullMesh failed ... Connection refused" after
a SIGKILL). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment gives every
attempt a store of its own; :func:`restart_hazard` says when it is missing.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

#: set by torchrun in every worker: restarts of this node's workers so far
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: torchrun's ``--max-restarts``
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
#: "True" when the workers share the agent's rendezvous store
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: "1" in torchrun's environment: every attempt gets a store of its own (read by torchrun, not here)
DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def under_agent(env: Optional[Mapping[str, str]] = None) -> bool:
    """True in a worker started by torchrun's elastic agent."""
    return RESTART_COUNT in (os.environ if env is None else env)


def restart_count(env: Optional[Mapping[str, str]] = None) -> int:
    """This node's restart count (0 outside torchrun, or for an unreadable value)."""
    try:
        return max(0, int((os.environ if env is None else env).get(RESTART_COUNT, "0")))
    except ValueError:
        return 0


def max_restarts(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """torchrun's ``--max-restarts``, when the agent says."""
    try:
        return int((os.environ if env is None else env)[MAX_RESTARTS])
    except (KeyError, ValueError):
        return None


def restart_hazard(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A one-line warning when torchrun may restart the workers (``--max-restarts`` > 0) while
    they share its agent's store, which keeps the failed attempt's keys; None otherwise."""
    env = os.environ if env is None else env
    limit = max_restarts(env)
    if env.get(AGENT_STORE) != "True" or not limit:
        return None
    return (f"torchrun --max-restarts {limit} with the workers on its agent's store: the store keeps a failed "
            "attempt's keys, so a restarted gloo worker can read a peer's old address and fail to connect "
            f"(pytorch/pytorch#135712); start torchrun with {DISABLE_SHARED_STORE}=1")
