"""Performance model of one data-parallel training step, beyond one machine.

* :mod:`.profile` measures (or loads) a model's per-parameter backward times, forward and
  optimizer times, gradient sizes and codec throughputs: a small JSON *profile*.
* :mod:`.network` gives each collective's time on a link of given bandwidth and latency, from
  the byte formulas of :mod:`lowband.comm.wire`.
* :mod:`.simulate` is a small discrete-event simulator (tasks, dependencies, serial resources).
* :mod:`.model` turns a profile, an algorithm and a cluster into the task graph of a few
  consecutive steps and reports the steady-state step time.
* :mod:`.plan` projects step time, throughput, speedup and scaling efficiency over worker
  counts (``lowband plan``).
"""
from .network import Network
from .profile import Profile, load_profile

__all__ = ["Network", "Profile", "load_profile"]
