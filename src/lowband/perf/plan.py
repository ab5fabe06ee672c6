"""``lowband plan``: project step time, throughput, speedup and scaling efficiency of several
algorithms over worker counts, from a profile and a network, and plot speedup vs workers.

Speedup over one worker is ``N * T1 / T_N`` with ``T1`` the profile's compute-only step
(forward + backward + optimizer of one worker, no communication): weak scaling at a fixed
per-worker batch, the same baseline for every algorithm. Scaling efficiency = speedup / N.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .model import MODEL_OPTIONS, MODELS, Cluster, StepEstimate, estimate, resolved_options
from .network import Network
from .profile import Profile


@dataclass
class PlanRow:
    label: str
    estimate: StepEstimate
    baseline_s: float
    batch_size: int
    #: knobs the model chose for this link, as the algorithm's own rule would (cp-diloco's
    #: ``sync_every="auto"``: "H = 5, apply_after = 1"); "" where nothing was chosen
    chosen: str = ""

    @property
    def workers(self) -> int:
        return self.estimate.workers

    @property
    def throughput(self) -> float:
        return self.workers * self.batch_size / self.estimate.step_s

    @property
    def speedup(self) -> float:
        return self.workers * self.baseline_s / self.estimate.step_s

    @property
    def efficiency(self) -> float:
        return self.speedup / self.workers


def parse_algorithm(spec: str) -> tuple[str, dict[str, Any]]:
    """``"cpsgd:correction_period=10:collective=ps"`` -> ("cpsgd", {...}); values are Python
    literals where they parse as one (``None``, numbers, booleans), strings otherwise."""
    name, *opts = spec.split(":")
    out: dict[str, Any] = {}
    for o in opts:
        if "=" not in o:
            raise ValueError(f"algorithm option {o!r} in {spec!r} is not KEY=VALUE")
        k, v = o.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k.strip().replace("-", "_")] = v
    return name.strip(), out


def check_algorithm(name: str, options: dict[str, Any]) -> None:
    """Unknown names and options fail here with one sentence: the algorithm's own knobs are
    checked by constructing it (as ``lowband train`` would), the model-only ones by name."""
    from ..algorithms import ALGORITHMS, make_algorithm
    if name not in MODELS:
        raise ValueError(f"no performance model for algorithm {name!r}; modelled: {', '.join(sorted(MODELS))}")
    model_only = {k.split("=")[0] for k in MODEL_OPTIONS.get(name, {})}
    real = {k: v for k, v in options.items() if k not in model_only and not (k == "collective" and v == "ps")}
    if name in ALGORITHMS:
        make_algorithm(name, **real)      # ValueError naming the bad knob
    elif real and name == "diloco":
        allowed = {"sync_every"}
        bad = sorted(set(real) - allowed)
        if bad:
            raise ValueError(f"bad options for algorithm 'diloco' (modelled only): {bad}; known: {sorted(allowed)}")


def run_plan(profile: Profile, algorithms: Sequence[str], workers: Sequence[int], network: Network,
             compute_scale: float = 1.0, codec_shares_compute: Optional[bool] = None) -> list[PlanRow]:
    parsed = [(spec, *parse_algorithm(spec)) for spec in algorithms]
    for _, name, opts in parsed:
        check_algorithm(name, opts)
    baseline = profile.compute_s * compute_scale
    rows = []
    for spec, name, opts in parsed:
        for n in workers:
            cl = Cluster(n, network, compute_scale, codec_shares_compute)
            rows.append(PlanRow(spec, estimate(profile, name, opts, cl), baseline, profile.batch_size,
                                _chosen(profile, name, opts, cl)))
    return rows


def _chosen(profile: Profile, name: str, opts: dict[str, Any], cluster: Cluster) -> str:
    """What the model resolved ``auto`` knobs to (cp-diloco's H and apply step)."""
    if name != "cp-diloco" or str(opts.get("sync_every", "auto")).strip().lower() != "auto":
        return ""
    o = resolved_options(profile, name, opts, cluster)
    a = o.get("apply_after")
    return f"H = {o['sync_every']}" + ("" if a is None or not o.get("pipelined", True) else f", apply_after = {a}")


def format_rows(rows: Sequence[PlanRow]) -> str:
    chosen = any(r.chosen for r in rows)
    head = "| algorithm | workers | step ms | exposed ms | samples/s | speedup | efficiency | MB sent/step |" + \
        (" auto chose |" if chosen else "")
    lines = [head, "|" + "---|" * (9 if chosen else 8)]
    for r in rows:
        e = r.estimate
        lines.append(f"| {r.label} | {r.workers} | {1e3 * e.step_s:.1f} | {1e3 * e.exposed_s:.1f} | "
                     f"{r.throughput:.0f} | {r.speedup:.1f} | {r.efficiency:.1%} | {e.bytes_sent / 1e6:.3f} |"
                     + (f" {r.chosen or '-'} |" if chosen else ""))
    return "\n".join(lines)


def plot_speedup(rows: Sequence[PlanRow], path: str, title: str = "",
                 marks: Sequence[tuple[float, float, str]] = ()) -> None:
    """Speedup against workers per algorithm; ``marks``: extra (workers, speedup, label)
    points, e.g. a paper's published figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    labels = list(dict.fromkeys(r.label for r in rows))
    ns = sorted({r.workers for r in rows})
    ax.plot(ns, ns, color="0.7", linestyle=":", label="linear")
    for i, lab in enumerate(labels):
        sel = sorted((r for r in rows if r.label == lab), key=lambda r: r.workers)
        ax.plot([r.workers for r in sel], [r.speedup for r in sel], marker="o", color=f"C{i}", label=lab)
    for x, y, lab in marks:
        ax.plot([x], [y], marker="x", color="k", markersize=9, linestyle="none")
        ax.annotate(lab, (x, y), textcoords="offset points", xytext=(-8, 6), ha="right", fontsize=7)
    if len(ns) > 1 and ns[-1] / max(1, ns[0]) >= 16:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("speedup over one worker")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
