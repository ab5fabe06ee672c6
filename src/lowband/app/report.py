"""Turn bench results files into markdown tables, plots, and generated sections of a document
(docs/results.md): each section between markers that name its results files, regenerated in
place from them by ``lowband report --doc`` and ``make results``."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .metrics import format_table

DEFAULT_SECTION = "bench"


def _legend(ax, **kw) -> None:
    """A legend where the axes drew something labelled (a run with only ``noop``, or only
    loopback rows, draws nothing there; matplotlib would warn)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


#: the columns that name a configuration, first in every table of runs
CONFIG_COLUMNS = [
    ("bandwidth", "bandwidth", "{}"),
    ("workers", "workers", "{}"),
    ("algorithm", "algorithm", "{}"),
]

COLUMNS = [
    *CONFIG_COLUMNS,
    ("steps", "steps", "{}"),
    ("test acc", "test_accuracy", "{:.2%}"),
    ("step ms", "median_step_ms", "{:.1f}"),
    ("mean step ms", "step_ms", "{:.1f}"),
    ("compute ms", "median_compute_ms", "{:.1f}"),
    ("comm wait ms", "median_comm_wait_ms", "{:.1f}"),
    ("CPU ms (all threads)", "median_cpu_ms", "{:.1f}"),
    ("step / noop", "step_over_noop", "{:.2f}"),
    ("samples/s", "throughput", "{:.0f}"),
    ("MB sent/step", "mb_sent_per_step", "{:.3f}"),
    ("wire ms/step at rate", "wire_ms_at_rate", "{:.1f}"),
    ("(step-noop)/wire", "comm_over_wire", "{:.2f}"),
    ("link/accounted", "link_over_accounted", "{:.3f}"),
]


#: what every row of a results file must hold (the rest is optional)
ROW_KEYS = ("algorithm", "bandwidth", "workers", "median_step_ms", "median_comm_wait_ms")


class ResultsFileError(ValueError):
    """A file that is not a readable ``lowband bench`` results file."""


def load(path: str) -> dict[str, Any]:
    """A results file written by ``lowband bench``; ResultsFileError says what is wrong."""
    try:
        with open(path) as f:
            results = json.load(f)
    except UnicodeDecodeError:
        raise ResultsFileError(f"{path} is not a lowband bench results file (not JSON text)") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{path} is not a lowband bench results file (not JSON: {e})") from None
    except OSError as e:
        raise ResultsFileError(f"cannot read results file {path}: {e.strerror}") from None
    rows = results.get("rows") if isinstance(results, dict) else None
    if not isinstance(rows, list):
        raise ResultsFileError(f"{path} is not a lowband bench results file (no list of 'rows')")
    _check_rows(path, rows, "row")
    runs = results.get("all_runs", [])     # every round of a --repeat bench
    if not isinstance(runs, list):
        raise ResultsFileError(f"{path} is not a lowband bench results file ('all_runs' is not a list)")
    _check_rows(path, runs, "all_runs entry")
    return results


def _check_rows(path: str, rows: list, what: str) -> None:
    for i, row in enumerate(rows):
        missing = [k for k in ROW_KEYS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ResultsFileError(f"{path} is not a lowband bench results file ({what} {i} lacks {', '.join(missing)})")


def derive(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ratios that need several rows: step time over the compute-only (noop) run of the
    same link and worker count, and measured communication time over bytes / rate."""
    noop = {(r["bandwidth"], r["workers"]): r["median_step_ms"] for r in rows if r["algorithm"] == "noop"}
    out = []
    for r in rows:
        r = dict(r)
        base = noop.get((r["bandwidth"], r["workers"]))
        if base:
            r["step_over_noop"] = r["median_step_ms"] / base
        if r.get("rate_bits"):
            r["wire_ms_at_rate"] = r["median_bytes_sent"] * 8 / r["rate_bits"] * 1e3
            if base and r["wire_ms_at_rate"] > 0 and r["algorithm"] != "noop":
                r["comm_over_wire"] = (r["median_step_ms"] - base) / r["wire_ms_at_rate"]
        out.append(r)
    return out


def round_ratios(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (bandwidth, workers, algorithm) of a ``--repeat`` bench, in its first
    run's order: its median step per round and, where the same link and worker count ran
    ``noop`` in that round, the ratio of the two (median step, and mean step: warm-ups and
    periodic corrections included), with the median of those per-round ratios. Rounds run one
    after another, minutes apart, so pairing each run with the ``noop`` of its own round
    cancels the machine's drift between rounds, which a ratio of the medians over all rounds
    does not."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["bandwidth"], r["workers"], r["algorithm"]), []).append(r)
    def round_of(r: dict[str, Any]) -> int:
        return r.get("repeat", 0)
    out = []
    for (bw, workers, algorithm), rs in groups.items():
        rs = sorted(rs, key=round_of)
        noop = {round_of(r): r for r in groups.get((bw, workers, "noop"), [])}
        row = {"bandwidth": bw, "workers": workers, "algorithm": algorithm,
               "step_ms_rounds": [r["median_step_ms"] for r in rs]}
        if algorithm != "noop":
            paired = [(r, noop[round_of(r)]) for r in rs if round_of(r) in noop]
            row["over_noop_rounds"] = [r["median_step_ms"] / n["median_step_ms"] for r, n in paired]
            row["mean_over_noop_rounds"] = [r["step_ms"] / n["step_ms"] for r, n in paired
                                            if r.get("step_ms") and n.get("step_ms")]
            for key, med in (("over_noop_rounds", "over_noop_median"), ("mean_over_noop_rounds", "mean_over_noop_median")):
                if row[key]:
                    row[med] = statistics.median(row[key])
        out.append(row)
    return out


#: the per-round table (:func:`rounds_table`)
ROUND_COLUMNS = [
    *CONFIG_COLUMNS,
    ("median step ms per round", "step_ms_text", "{}"),
    ("/ noop per round", "over_noop_text", "{}"),
    ("median of rounds", "over_noop_median", "{:.2f}"),
    ("mean step / noop, median of rounds", "mean_over_noop_median", "{:.2f}"),
]


def rounds_table(runs: Sequence[dict[str, Any]]) -> str:
    """:func:`round_ratios` as a markdown table ('' for a bench of one round)."""
    rows = round_ratios(runs)
    if not any(len(r["step_ms_rounds"]) > 1 for r in rows):
        return ""
    for r in rows:
        r["step_ms_text"] = ", ".join(f"{x:.1f}" for x in r["step_ms_rounds"])
        if r.get("over_noop_rounds"):
            r["over_noop_text"] = ", ".join(f"{x:.2f}" for x in r["over_noop_rounds"])
    return format_table(rows, ROUND_COLUMNS)


def markdown_table(rows: Sequence[dict[str, Any]], columns=COLUMNS) -> str:
    return format_table(rows, columns)


def plot(rows: Sequence[dict[str, Any]], out_dir: str) -> list[str]:
    """Three figures: accuracy against wall time, step time split into compute and exposed
    communication, throughput against bandwidth. Returns the written file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups = sorted({(r["bandwidth"], r["workers"]) for r in rows}, key=lambda g: (g[1], str(g[0])))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    colors = {a: f"C{i}" for i, a in enumerate(algorithms)}

    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (bw, w) in zip(axes[0], groups):
        for r in rows:
            if (r["bandwidth"], r["workers"]) == (bw, w) and r.get("curve") and r["algorithm"] != "noop":
                xs = [0.0] + [p[0] for p in r["curve"]]
                ys = [0.1] + [p[1] for p in r["curve"]]
                ax.plot(xs, ys, marker="o", color=colors[r["algorithm"]], label=r["algorithm"])
        ax.set_title(f"{w} workers, {bw}")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    _legend(axes[0][0], fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy_vs_time.png"), dpi=110)
    plt.close(fig)
    written.append("accuracy_vs_time.png")

    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (bw, w) in zip(axes[0], groups):
        sel = [r for r in rows if (r["bandwidth"], r["workers"]) == (bw, w)]
        names = [r["algorithm"] for r in sel]
        compute = [r["median_step_ms"] - r["median_comm_wait_ms"] for r in sel]
        wait = [r["median_comm_wait_ms"] for r in sel]
        ax.bar(names, compute, label="compute (incl. overlapped comm)")
        ax.bar(names, wait, bottom=compute, label="exposed comm wait")
        ax.set_title(f"{w} workers, {bw}")
        ax.set_ylabel("median step (ms)")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    _legend(axes[0][0], fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "step_time_split.png"), dpi=110)
    plt.close(fig)
    written.append("step_time_split.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for w in sorted({r["workers"] for r in rows}):
        for a in algorithms:
            sel = sorted((r for r in rows if r["workers"] == w and r["algorithm"] == a and r.get("rate_bits")),
                         key=lambda r: r["rate_bits"])
            if sel:
                ax.plot([r["rate_bits"] / 1e6 for r in sel], [r["throughput"] for r in sel], marker="o",
                        color=colors[a], linestyle="-" if w == min(r["workers"] for r in rows) else "--",
                        label=f"{a} x{w}")
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("samples/s (all workers)")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput_vs_bandwidth.png"), dpi=110)
    plt.close(fig)
    written.append("throughput_vs_bandwidth.png")
    written += plot_tau(rows, out_dir)
    written += plot_to_target(rows, out_dir)
    return written


# -- time to target: the headline ------------------------------------------------------------

#: accuracy target: this share of the final test accuracy of the ssgd run of the same model
ACCURACY_TARGET_SHARE = 0.95
#: loss target (language models): the loss ssgd has covered this share of the way from the
#: untrained loss, ln(vocabulary) = ln 256 nats per byte, to its final loss
LOSS_TARGET_SHARE = 0.95
UNTRAINED_LM_LOSS = math.log(256)
TARGET_COLUMNS = [
    ("model", "model", "{}"),
    *CONFIG_COLUMNS,
    ("final", "final_metric", "{:.4g}"),
    ("target", "target", "{:.4g}"),
    ("time to target s", "time_to_target_s", "{:.1f}"),
    ("steps to target", "steps_to_target", "{}"),
    ("step ms", "median_step_ms", "{:.1f}"),
    ("MB sent/step", "mb_sent_per_step", "{:.3f}"),
    ("first", "first", "{}"),
]


def eval_points(epochs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluations of one run (from its epochs.jsonl), reduced to what the time-to-target
    needs: step, training time (sum of step times, evaluation excluded), wall time, metrics."""
    keys = ("step", "train_s", "wall_s", "test_accuracy", "test_loss", "bits_per_byte")
    return [{k: e[k] for k in keys if k in e} for e in epochs]


def metric_of(row: dict[str, Any]) -> tuple[str, bool]:
    """The headline metric of a row's task and whether higher is better."""
    return ("test_loss", False) if row.get("task") == "lm" else ("test_accuracy", True)


def target_for(ssgd: dict[str, Any]) -> Optional[float]:
    """The target, from the final metric of the ssgd run (see the constants above)."""
    key, higher = metric_of(ssgd)
    final = ssgd.get(key)
    if final is None:
        return None
    if higher:
        return ACCURACY_TARGET_SHARE * final
    return final + (1.0 - LOSS_TARGET_SHARE) * (UNTRAINED_LM_LOSS - final)


def time_to_target(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its target (from the first ssgd row of the same model and worker count),
    the training time and step of its first evaluation that reached it (None: never), and,
    per model, link and worker count, ``first`` = "yes" on the method that got there soonest
    (the compute-only ``noop`` is not ranked). Resolution: the evaluation interval."""
    out = [dict(r) for r in rows]
    for r in out:
        key, higher = metric_of(r)
        ssgd = next((p for p in out if str(p["algorithm"]).split(":")[0] == "ssgd"
                     and (p.get("model"), p["workers"]) == (r.get("model"), r["workers"])), None)
        target = target_for(ssgd) if ssgd is not None else None
        r["final_metric"] = r.get(key)
        r["target_metric"] = key
        r["target"] = target
        r["time_to_target_s"] = r["steps_to_target"] = None
        if target is None:
            continue
        for e in r.get("evals", []):
            value = e.get(key)
            if value is not None and (value >= target if higher else value <= target):
                r["time_to_target_s"], r["steps_to_target"] = e["train_s"], e["step"]
                break
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in out:
        groups.setdefault((r.get("model"), r["bandwidth"], r["workers"]), []).append(r)
    for members in groups.values():
        ranked = [r for r in members if r["time_to_target_s"] is not None and r["algorithm"] != "noop"]
        for r in members:
            r["first"] = ""
        if ranked:
            min(ranked, key=lambda r: r["time_to_target_s"])["first"] = "yes"
    return out


def target_table(rows: Sequence[dict[str, Any]]) -> str:
    return markdown_table(time_to_target(rows), TARGET_COLUMNS)


def target_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One sentence per model, link and worker count: the target and who reached it first."""
    lines = []
    done = set()
    for r in time_to_target(rows):
        group = (r.get("model"), r["bandwidth"], r["workers"])
        if group in done or r["target"] is None:
            continue
        done.add(group)
        members = [m for m in time_to_target(rows) if (m.get("model"), m["bandwidth"], m["workers"]) == group]
        what = ("validation loss <= {:.3f} nats/byte".format(r["target"]) if r["target_metric"] == "test_loss"
                else "test accuracy >= {:.2%}".format(r["target"]))
        winner = next((m for m in members if m["first"] == "yes"), None)
        ssgd = next((m for m in members if str(m["algorithm"]).split(":")[0] == "ssgd"), None)
        missed = [m["algorithm"] for m in members if m["time_to_target_s"] is None and m["algorithm"] != "noop"]
        text = f"{group[0]}, {group[2]} workers, {group[1]}: target {what}; "
        if winner is None:
            text += "no method reached it"
        else:
            text += f"first: {winner['algorithm']} after {winner['time_to_target_s']:.1f} s of training"
            if ssgd is not None and ssgd is not winner and ssgd["time_to_target_s"] is not None:
                text += f" (ssgd {ssgd['time_to_target_s']:.1f} s)"
        if missed:
            text += f"; not reached within the run: {', '.join(missed)}"
        lines.append(text + ".")
    return lines


def plot_to_target(rows: Sequence[dict[str, Any]], out_dir: str) -> list[str]:
    """Per model: its headline metric against training time, one panel per link and worker
    count, the target as a dashed line. Returns the written file names."""
    sel = [r for r in time_to_target(rows) if r.get("evals")]
    if not sel:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    algorithms = list(dict.fromkeys(r["algorithm"] for r in sel))
    colors = {a: f"C{i % 10}" for i, a in enumerate(algorithms)}
    for model in dict.fromkeys(r.get("model") for r in sel):
        mine = [r for r in sel if r.get("model") == model]
        groups = sorted({(r["bandwidth"], r["workers"]) for r in mine}, key=lambda g: (g[1], str(g[0])))
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.8), squeeze=False)
        for ax, (bw, w) in zip(axes[0], groups):
            target = None
            for r in mine:
                if (r["bandwidth"], r["workers"]) != (bw, w):
                    continue
                key = r["target_metric"]
                points = [(e["train_s"], e[key]) for e in r["evals"] if e.get(key) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker=".", color=colors[r["algorithm"]], label=r["algorithm"],
                            linestyle=":" if r["algorithm"] == "noop" else "-")
                target = r["target"] if r["target"] is not None else target
            if target is not None:
                ax.axhline(target, color="k", linestyle="--", linewidth=0.8, label="target")
            ax.set_title(f"{model}, {w} workers, {bw}")
            ax.set_xlabel("training time (s, evaluation excluded)")
            ax.set_ylabel("validation loss (nats/byte)" if mine[0]["target_metric"] == "test_loss" else "test accuracy")
            ax.grid(alpha=0.3)
        _legend(axes[0][0], fontsize=7)
        fig.tight_layout()
        name = f"to_target_{model}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=110)
        plt.close(fig)
        written.append(name)
    return written


# -- the lazy update: tau and synced steps, next to ssgd --------------------------------------

TAU_PLOT = "tau_over_steps.png"
LAZY_COLUMNS = [
    *CONFIG_COLUMNS,
    ("synced steps", "synced_fraction", "{:.1%}"),
    ("mean tau", "mean_tau", "{:.2f}"),
    ("final tau", "final_tau", "{}"),
    ("step ms", "median_step_ms", "{:.1f}"),
    ("ssgd step ms", "ssgd_step_ms", "{:.1f}"),
    ("comm wait ms", "median_comm_wait_ms", "{:.1f}"),
    ("ssgd comm wait ms", "ssgd_comm_wait_ms", "{:.1f}"),
    ("wait / ssgd's", "comm_wait_over_ssgd", "{:.2f}"),
]


def lazy_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that logged tau, each with the first ``ssgd`` row of its link and worker count
    beside it (median step time and exposed communication wait, and the wait ratio)."""
    out = []
    for r in rows:
        if "synced_fraction" not in r:
            continue
        r = dict(r)
        peer = next((p for p in rows if (p["bandwidth"], p["workers"]) == (r["bandwidth"], r["workers"])
                     and str(p["algorithm"]).split(":")[0] == "ssgd"), None)
        if peer is not None:
            r["ssgd_step_ms"] = peer["median_step_ms"]
            r["ssgd_comm_wait_ms"] = peer["median_comm_wait_ms"]
            if peer["median_comm_wait_ms"] > 0:
                r["comm_wait_over_ssgd"] = r["median_comm_wait_ms"] / peer["median_comm_wait_ms"]
        out.append(r)
    return out


def lazy_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of the lazy-update rows (empty string when there are none)."""
    sel = lazy_rows(rows)
    return markdown_table(sel, LAZY_COLUMNS) if sel else ""


def plot_tau(rows: Sequence[dict[str, Any]], out_dir: str) -> list[str]:
    """tau over steps of every run that logged it, one panel per link and worker count, the
    fraction of synced steps in the legend. Returns the written file names (none without such runs)."""
    sel = [r for r in rows if r.get("tau_curve")]
    if not sel:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["bandwidth"], r["workers"]) for r in sel}, key=lambda g: (g[1], str(g[0])))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.4), squeeze=False)
    for ax, (bw, w) in zip(axes[0], groups):
        for r in sel:
            if (r["bandwidth"], r["workers"]) == (bw, w):
                steps, taus = zip(*r["tau_curve"])
                ax.step(steps, taus, where="post", label=f"{r['algorithm']} ({r['synced_fraction']:.0%} synced)")
        ax.set_title(f"{w} workers, {bw}")
        ax.set_xlabel("step")
        ax.set_ylabel("tau")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, TAU_PLOT), dpi=110)
    plt.close(fig)
    return [TAU_PLOT]


# -- generated sections of a markdown document -------------------------------------------------
#
# A generated section lies between two comment lines. The begin marker names the section and
# says where its text comes from, one "key: value" line each:
#
#   <!-- lowband:begin race-cnn-20
#   results: runs/race-cnn-20/results.json
#   command: lowband bench --algorithms noop,ssgd ... --out runs/race-cnn-20
#   tables: target runs
#   -->
#   (generated text)
#   <!-- lowband:end race-cnn-20 -->
#
# ``results`` and ``command`` repeat for a section drawn from several results files, in pairs:
# the i-th command writes the i-th file. ``tables`` picks parts (TABLE_PARTS), for a section
# whose surrounding prose says the rest; without it the section is the whole report
# (:func:`render_section`). ``images`` is the plots' directory of a whole report. Rendering reads
# only the results files: nothing is rerun. Writing replaces a section in place; a document
# without the section is an error (DocSectionError), never a place to append one.

#: the document ``make results`` regenerates
DEFAULT_DOC = "docs/results.md"
BEGIN = "<!-- lowband:begin "
MARKER_KEYS = ("results", "command", "tables", "images")
#: the parts a ``tables:`` line picks from, in the order they are written
TABLE_PARTS = ("target", "summary", "runs", "rounds", "lazy")
_NAME = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")


class DocSectionError(ValueError):
    """A document without the named section, or with malformed markers."""


def markers(section: str) -> tuple[str, str]:
    """The begin marker without metadata, and the end marker, of one generated section."""
    return f"{BEGIN}{section} -->", f"<!-- lowband:end {section} -->"


@dataclass
class Section:
    """One generated section of a document: its marker's fields and its place in the text."""
    name: str
    results: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    tables: Optional[list[str]] = None
    images: Optional[str] = None
    start: int = 0        # offset of the begin marker
    body_start: int = 0   # offset just after the begin marker
    body_end: int = 0     # offset of the end marker
    end: int = 0          # offset just after the end marker's line

    def command_for(self, i: int) -> str:
        return self.commands[i] if i < len(self.commands) else ""

    def begin_marker(self) -> str:
        fields = []
        for i, path in enumerate(self.results):
            fields.append(f"results: {path}")
            if self.command_for(i):
                fields.append(f"command: {self.command_for(i)}")
        fields += [f"command: {c}" for c in self.commands[len(self.results):]]
        if self.tables is not None:
            fields.append("tables: " + " ".join(self.tables))
        if self.images:
            fields.append(f"images: {self.images}")
        if not fields:
            return markers(self.name)[0]
        return "\n".join([f"{BEGIN}{self.name}", *fields, "-->"])

    def block(self, body: str) -> str:
        """The section as it is written: marker, body, a blank line (a table ends there), end marker."""
        body = body.strip("\n")
        return f"{self.begin_marker()}\n{body}\n\n{markers(self.name)[1]}\n"


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name or ""):
        raise DocSectionError(f"section name {name!r}: use letters, digits, '.', '_' and single '-' between them")


def _fence(line: str, fence: Optional[str]) -> Optional[str]:
    """The fenced code block open after ``line`` (markers inside one are examples, not sections)."""
    s = line.lstrip()
    if fence is None:
        return s[:3] if s.startswith(("```", "~~~")) else None
    return None if s.startswith(fence) else fence


def parse_sections(text: str, doc: str = "document") -> list[Section]:
    """Every generated section of ``text``, in order; DocSectionError on a begin marker without
    its end, an end marker without its begin, a repeated name or an unknown field."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    sections: list[Section] = []
    fence: Optional[str] = None
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _fence(line, fence)
        if fence is None and line.startswith("<!-- lowband:end "):
            raise DocSectionError(f"{doc}:{i + 1}: end marker without a begin marker: {line.strip()}")
        if fence is not None or not line.startswith(BEGIN):
            i += 1
            continue
        first = i
        m = _NAME.match(line[len(BEGIN):])
        if m is None:
            raise DocSectionError(f"{doc}:{i + 1}: begin marker without a section name")
        sec = Section(m.group(0), start=offsets[i])
        if any(s.name == sec.name for s in sections):
            raise DocSectionError(f"{doc}:{i + 1}: section {sec.name} appears twice")
        meta = [line[len(BEGIN) + m.end():]]
        while "-->" not in meta[-1]:
            i += 1
            if i == len(lines):
                raise DocSectionError(f"{doc}:{first + 1}: the begin marker of section {sec.name} has no closing -->")
            meta.append(lines[i])
        meta[-1] = meta[-1].split("-->", 1)[0]
        for entry in "".join(meta).splitlines():
            if not entry.strip():
                continue
            key, sep, value = entry.partition(":")
            key, value = key.strip(), value.strip()
            if not sep or key not in MARKER_KEYS:
                raise DocSectionError(f"{doc}:{first + 1}: section {sec.name}: {entry.strip()!r} is not one of "
                                      f"{', '.join(k + ': ...' for k in MARKER_KEYS)}")
            if key == "results":
                sec.results.append(value)
            elif key == "command":
                sec.commands.append(value)
            elif key == "tables":
                sec.tables = value.replace(",", " ").split()
                unknown = [t for t in sec.tables if t not in TABLE_PARTS]
                if unknown:
                    raise DocSectionError(f"{doc}:{first + 1}: section {sec.name}: unknown tables "
                                          f"{', '.join(unknown)} (known: {', '.join(TABLE_PARTS)})")
            else:
                sec.images = value
        sec.body_start = offsets[i + 1]
        end = markers(sec.name)[1]
        i += 1
        while i < len(lines) and lines[i].strip() != end:
            if lines[i].startswith(BEGIN):
                raise DocSectionError(f"{doc}:{i + 1}: section {sec.name} (line {first + 1}) has no end "
                                      f"marker before the next section begins")
            i += 1
        if i == len(lines):
            raise DocSectionError(f"{doc}:{first + 1}: section {sec.name} has no end marker ({end})")
        sec.body_end, sec.end = offsets[i], offsets[i + 1]
        sections.append(sec)
        i += 1
    return sections


def _read_doc(doc_path: str) -> str:
    try:
        with open(doc_path) as f:
            return f.read()
    except OSError as e:
        raise DocSectionError(f"cannot read {doc_path}: {e.strerror}") from None


def _write_doc(doc_path: str, text: str) -> None:
    tmp = f"{doc_path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, doc_path)


def find_section(doc_path: str, section: str) -> tuple[str, Section]:
    """The text of ``doc_path`` and its section named ``section``; DocSectionError (one line,
    naming the two marker lines to add) when the document or the section is not there."""
    _check_name(section)
    begin, end = markers(section)
    add = f"put the lines `{begin}` and `{end}` where the section belongs, then rerun"
    if not os.path.exists(doc_path):
        raise DocSectionError(f"{doc_path} does not exist; create it and {add}")
    text = _read_doc(doc_path)
    for sec in parse_sections(text, doc_path):
        if sec.name == section:
            return text, sec
    raise DocSectionError(f"{doc_path} has no generated section {section!r}: {add}")


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _recorded_path(path: str) -> str:
    """A path as a marker records it: relative to the current directory (the repository root
    when run from there), absolute when outside it."""
    rel = os.path.relpath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel


def _produced_by(commands: Sequence[str]) -> str:
    return "Produced by: " + " and ".join(f"`{c}`" for c in commands) + "."


def render_section(results: dict[str, Any] | Sequence[dict[str, Any]], results_path: str | Sequence[str],
                   images_dir: Optional[str], doc_path: str, section: str = DEFAULT_SECTION,
                   tables: Optional[Sequence[str]] = None) -> str:
    """The text of one generated section from one results file or several (their rows together).
    ``tables`` None: the whole report (commands, machine, every table, plots); else the command
    line and the named TABLE_PARTS only, for a section whose surrounding prose says the rest."""
    many = [results] if isinstance(results, dict) else list(results)
    paths = [results_path] if isinstance(results_path, str) else list(results_path)
    rows = derive([r for res in many for r in res["rows"]])
    runs = [r for res in many for r in res.get("all_runs") or ()]
    commands = [res.get("command", "?") for res in many]
    if tables is not None:
        parts = {"target": lambda: target_table(rows), "summary": lambda: "\n".join(target_summary(rows)),
                 "runs": lambda: markdown_table(rows), "rounds": lambda: rounds_table(runs),
                 "lazy": lambda: lazy_table(rows)}
        texts = [parts[t]() for t in TABLE_PARTS if t in tables]
        return "\n\n".join([_produced_by(commands), *(t for t in texts if t)])
    doc_dir = os.path.dirname(os.path.abspath(doc_path))
    if len(paths) == 1:
        regenerate = f"lowband report {paths[0]} --doc {os.path.relpath(doc_path)} --section {section}"
        if images_dir:
            regenerate += f" --images {os.path.relpath(images_dir)}"
    else:
        regenerate = f"python -m lowband.app.report {os.path.relpath(doc_path)}"
    machines = "; ".join(dict.fromkeys(str(res.get("machine", "?")) for res in many))
    links = "; ".join(dict.fromkeys(str(res.get("link", "?")) for res in many))
    parts = [
        _produced_by(commands),
        f"Regenerate this section: `{regenerate}`",
        f"Machine: {machines}. Link: {links}.",
        "",
        "Time to target (training time until the first evaluation that reached it; the target "
        "comes from the ssgd run of the same model, docs/workloads.md):",
        "",
        target_table(rows),
        "",
        *target_summary(rows),
        "",
        markdown_table(rows),
    ]
    if images_dir:
        rel = os.path.relpath(os.path.abspath(images_dir), doc_dir)
        models = dict.fromkeys(r.get("model") for r in rows if r.get("evals"))
        parts += ["", *(f"![{name}]({rel}/{name})" for name in
                       (*(f"to_target_{m}.png" for m in models),
                        "accuracy_vs_time.png", "step_time_split.png", "throughput_vs_bandwidth.png"))]
    rounds = rounds_table(runs)
    if rounds:
        parts += ["", "The table reports each configuration's median-step run of the rounds; per round, each run "
                      "over the `noop` of its own round (rounds run one after another, so the pairing cancels the "
                      "machine's drift between them):", "", rounds]
    lazy = lazy_table(rows)
    if lazy:
        parts += ["", "Lazy update: synchronized steps, tau, and exposed communication next to ssgd's:", "", lazy]
        if images_dir and any(r.get("tau_curve") for r in rows):
            parts += ["", f"![{TAU_PLOT}]({os.path.relpath(os.path.abspath(images_dir), doc_dir)}/{TAU_PLOT})"]
    for res in many:
        for note in res.get("notes", []):
            parts += ["", note]
    return "\n".join(parts)


def update_doc(doc_path: str, body: str, section: str = DEFAULT_SECTION, command: Optional[str] = None) -> None:
    """Replace the text of one generated section of ``doc_path`` with ``body``, keeping the rest of
    the document and the section's marker (``command``, when given, becomes the marker's
    command). DocSectionError when the section is not there: a section is never appended."""
    text, sec = find_section(doc_path, section)
    if command is not None:
        sec.commands = [command]
    _write_doc(doc_path, text[:sec.start] + sec.block(body) + text[sec.end:])


def write_section(doc_path: str, section: str, results_path: str, results: Optional[dict[str, Any]] = None,
                  images_dir: Optional[str] = None) -> None:
    """Render one section from ``results_path`` (``results``: that file, already loaded) and write
    it in place, its marker recording the file and the command that wrote it. A section whose
    marker names several files, this one among them, is rendered from all of them; one naming
    other files becomes this file's. ``tables`` comes from the marker; ``images_dir`` links the
    plots of a whole report. DocSectionError / ResultsFileError leave the document unchanged."""
    text, sec = find_section(doc_path, section)
    if not any(_same_file(p, results_path) for p in sec.results):
        sec.results, sec.commands = [_recorded_path(results_path)], []
    loaded = [results if results is not None and _same_file(p, results_path) else load(p) for p in sec.results]
    sec.commands = [res.get("command", "") for res in loaded]
    if sec.tables is None:
        sec.images = _recorded_path(images_dir) if images_dir else sec.images
    body = render_section(loaded, sec.results, sec.images, doc_path, section, sec.tables)
    _write_doc(doc_path, text[:sec.start] + sec.block(body) + text[sec.end:])


def regenerate(doc_path: str = DEFAULT_DOC, log=None) -> int:
    """Re-render every generated section of ``doc_path`` that names results files, from those
    files (nothing reruns), and write the document once. A section whose files are not all
    there stays as it is, with one line saying which command writes the missing one; a
    section that names no results file stays as it is. Returns 1 when a results file could
    not be read as one, else 0 (missing files included: they are the state of a fresh clone)."""
    say = log or (lambda line: print(line, file=sys.stderr))
    text = _read_doc(doc_path)
    out, pos, status = [], 0, 0
    for sec in parse_sections(text, doc_path):
        out.append(text[pos:sec.start])
        pos = sec.end
        block = text[sec.start:sec.end]
        where = f"{doc_path}: section {sec.name}"
        if not sec.results:
            how = f"; `{sec.commands[0]}` writes it" if sec.commands else ""
            say(f"{where} left unchanged: its marker names no results file{how}")
        elif missing := [(i, p) for i, p in enumerate(sec.results) if not os.path.exists(p)]:
            i, p = missing[0]
            how = f"`{sec.command_for(i)}` writes it" if sec.command_for(i) else "its marker records no command"
            say(f"{where} left unchanged: {p} is missing; {how}")
        else:
            try:
                loaded = [load(p) for p in sec.results]
            except ResultsFileError as e:
                say(f"{where} left unchanged: {e}")
                status = 1
            else:
                sec.commands = [res.get("command", "") for res in loaded]
                body = render_section(loaded, sec.results, sec.images, doc_path, sec.name, sec.tables)
                new = sec.block(body)
                # the text after the end marker keeps its own line ending (the document's last line may lack one)
                if not block.endswith("\n"):
                    new = new[:-1]
                say(f"{where} {'is up to date' if new == block else 'regenerated'} from {', '.join(sec.results)}")
                block = new
        out.append(block)
    out.append(text[pos:])
    new_text = "".join(out)
    if new_text != text:
        _write_doc(doc_path, new_text)
    return status


def print_tables(rows: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]] = ()) -> None:
    """What ``lowband bench`` and ``lowband report`` print: time to target, the per-run table,
    the lazy update's table where there are lazy runs (``rows`` already derived), and for a
    ``--repeat`` bench (``runs``: every round's run) the per-round ratios to ``noop``. A blank
    line ends every table: markdown continues a table through the next line that is not blank,
    so the next table's header and rule would read as rows of this one."""
    blocks = [target_table(rows), "\n".join(target_summary(rows)), markdown_table(rows), lazy_table(rows)]
    rounds = rounds_table(runs)
    if rounds:
        blocks.append("Per round (each run over the noop of its own round):\n\n" + rounds)
    print("\n\n".join(b for b in blocks if b))


def main_report(results_path: str, doc: Optional[str], images: Optional[str], section: str = DEFAULT_SECTION) -> int:
    """``lowband report``: print the tables, write the plots into ``images``, and with ``doc``
    replace that document's section ``section`` (DocSectionError when it has none)."""
    if doc:
        find_section(doc, section)        # before the plots: a missing section changes nothing
    results = load(results_path)
    rows = derive(results["rows"])
    print_tables(rows, results.get("all_runs") or ())
    if images:
        os.makedirs(images, exist_ok=True)
        plot(rows, images)
    if doc:
        write_section(doc, section, results_path, results, images)
        print(f"updated section {section} of {doc}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lowband.app.report [DOC ...]`` (``make results``): :func:`regenerate` each document."""
    ap = argparse.ArgumentParser(
        prog="python -m lowband.app.report",
        description="Regenerate every generated section of markdown documents from the results files their "
                    "markers name (<!-- lowband:begin NAME ... --> ... <!-- lowband:end NAME -->). Nothing is "
                    "rerun; a section whose results file is missing is left as it is.")
    ap.add_argument("docs", nargs="*", default=[DEFAULT_DOC], help="documents (default: %(default)s)")
    args = ap.parse_args(argv)
    status = 0
    for doc in args.docs:
        try:
            status = max(status, regenerate(doc))
        except DocSectionError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
