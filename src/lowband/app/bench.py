"""Run training configurations side by side and reduce their metrics to comparable numbers.

Used by ``lowband bench`` and the scripts in ``benchmarks/``. Each configuration runs as a
real multi-process ``lowband train`` job; step times are medians over the steady steps: after the
first few (allocation and connection set-up) and after the algorithm's own warm-up (the fp32 steps
of ``compressed`` and ``cpsgd``, the synchronous ones of ``localsgd``, PowerSGD's
``start_powerSGD_iter``: the steps that log ``warmup: true`` in steps.jsonl).
"""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .config import TrainConfig
from .runner import launch
from .metrics import read_jsonl

WARMUP_STEPS = 5     # steps excluded from the medians


def steady_start(steps: Sequence[dict[str, Any]]) -> int:
    """Index of the first step the medians count: past the first ``WARMUP_STEPS`` steps and
    past the last step that logged the algorithm's own ``warmup``."""
    flagged = [k for k, s in enumerate(steps) if s.get("warmup")]
    return max(WARMUP_STEPS, flagged[-1] + 1 if flagged else 0)


@dataclass
class RunResult:
    config: TrainConfig
    summary: dict[str, Any]
    steps: list[dict[str, Any]]

    def median(self, key: str, skip: Optional[int] = None) -> float:
        """Median of ``key`` over the steady steps (:func:`steady_start`; all steps when the
        run has none past it)."""
        skip = steady_start(self.steps) if skip is None else skip
        values = [s[key] for s in self.steps[skip:]] or [s[key] for s in self.steps]
        return statistics.median(values)

    def row(self, **extra: Any) -> dict[str, Any]:
        """One flat record: the summary plus median step/compute/wait times in ms, and how many
        steps logged the algorithm's warm-up and how many the medians counted."""
        skip = steady_start(self.steps)
        return {
            **{k: v for k, v in self.summary.items() if not isinstance(v, dict)},
            "warmup_steps_logged": sum(1 for s in self.steps if s.get("warmup")),
            "steady_steps": max(0, len(self.steps) - skip),
            "median_step_ms": 1e3 * self.median("step_s", skip),
            "median_compute_ms": 1e3 * self.median("compute_s", skip),
            "median_comm_wait_ms": 1e3 * self.median("comm_wait_s", skip),
            "median_cpu_ms": 1e3 * self.median("cpu_s", skip),
            "median_thread_cpu_ms": 1e3 * self.median("thread_cpu_s", skip),
            "median_bytes_sent": self.median("bytes_sent", skip),
            **lazy_stats(self.steps),
            **extra,
        }


#: most points of a run's tau curve kept in a results row
TAU_CURVE_POINTS = 400


def lazy_stats(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """For runs whose steps log the lazy update's ``tau`` and ``lazy_synced``: the fraction of
    steps on which the lazy layers synchronized, mean and final tau, and tau over steps
    (every change kept; thinned to about TAU_CURVE_POINTS points). Empty for other runs."""
    logged = [s for s in steps if "tau" in s and "lazy_synced" in s]
    if not logged:
        return {}
    changes = [(s["step"], s["tau"]) for k, s in enumerate(logged)
               if k == 0 or k == len(logged) - 1 or s["tau"] != logged[k - 1]["tau"]]
    stride = max(1, len(changes) // TAU_CURVE_POINTS)
    curve = changes[::stride] + ([changes[-1]] if (len(changes) - 1) % stride else [])
    return {
        "synced_fraction": sum(bool(s["lazy_synced"]) for s in logged) / len(logged),
        "mean_tau": statistics.fmean(s["tau"] for s in logged),
        "final_tau": logged[-1]["tau"],
        "tau_curve": curve,
    }


def run_config(
    cfg: TrainConfig,
    *,
    prefix: Optional[Callable[[int], Sequence[str]]] = None,
    extra_env: Optional[Callable[[int], dict]] = None,
    master_addr: Optional[str] = None,
) -> RunResult:
    """Run one configuration to completion with ``cfg.workers`` local processes (raises
    :class:`~lowband.app.runner.RunFailed`, a RuntimeError, when a worker fails)."""
    launch(cfg, prefix=prefix, extra_env=extra_env, master_addr=master_addr)
    with open(os.path.join(cfg.run_dir, "summary.json")) as f:
        summary = json.load(f)
    return RunResult(cfg, summary, read_jsonl(os.path.join(cfg.run_dir, "steps.jsonl")))


# -- the side-by-side matrix -----------------------------------------------------------------

RESULTS_FILE = "results.json"


def rank_stats(run_dir: str, workers: int) -> list[dict[str, Any]]:
    """Each rank's own byte accounting, written by the worker at the end of its run."""
    out = []
    for r in range(workers):
        with open(os.path.join(run_dir, f"rank{r}.stats.json")) as f:
            out.append(json.load(f))
    return out


def run_on_link(cfg: TrainConfig, rate_bits: Optional[int], burst_bytes: Optional[int] = None,
                rtt_s: float = 0.0) -> dict[str, Any]:
    """Run ``cfg`` over an emulated link of ``rate_bits`` (None: plain loopback) and return
    its row, with the links' kernel byte counters beside lowband's own accounting and the link
    model it ran on (:meth:`lowband.netem.LinkShape.as_row`). ``burst_bytes``: None for a paced
    link, else a bursting one with that bucket; ``rtt_s``: added round-trip delay."""
    from .. import netem

    if rate_bits is None:
        result = run_config(cfg)
        return result.row(**_accounting(cfg, None), **netem.paced(None).as_row())
    with netem.EmulatedCluster(cfg.workers, rate_bits, burst=burst_bytes, rtt_s=rtt_s) as cluster:
        before = cluster.link_counters()
        def env(rank: int) -> dict:
            # c10d warns once per connection that a namespace address has no hostname: noise
            return {**cluster.worker_env(rank), "TORCH_CPP_LOG_LEVEL": "ERROR"}
        result = run_config(cfg, prefix=cluster.worker_prefix, extra_env=env, master_addr=cluster.master_addr)
        after = cluster.link_counters()
    link_tx = sum(after[r][0] - before[r][0] for r in range(cfg.workers))
    link_rx = sum(after[r][1] - before[r][1] for r in range(cfg.workers))
    return result.row(**_accounting(cfg, (link_tx, link_rx)), **cluster.shape.as_row())


def _accounting(cfg: TrainConfig, link: Optional[tuple[int, int]]) -> dict[str, Any]:
    ranks = rank_stats(cfg.run_dir, cfg.workers)
    sent = sum(s["bytes_sent"] + s.get("guard_bytes_sent", 0) + s.get("aux_bytes_sent", 0) for s in ranks)
    row: dict[str, Any] = {"lowband_bytes_sent_all_ranks": sent,
                           "payload_bytes_all_ranks": sum(s["payload_bytes"] for s in ranks)}
    if link is not None:
        row["link_tx_bytes_all_ranks"], row["link_rx_bytes_all_ranks"] = link
        row["link_over_accounted"] = link[0] / sent if sent else None
    return row
