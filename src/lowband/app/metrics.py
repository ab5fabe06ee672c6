"""Run-directory records: per-step and per-epoch JSON lines, the summary, the summary table."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence


class MetricsWriter:
    """Appends JSON lines to ``steps.jsonl`` and ``epochs.jsonl`` in the run directory.
    Only rank 0 writes (the others pass ``enabled=False``): records describe the global run."""

    def __init__(self, run_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = run_dir
        self._steps = self._epochs = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            self._steps = open(os.path.join(run_dir, "steps.jsonl"), "a", buffering=1)
            self._epochs = open(os.path.join(run_dir, "epochs.jsonl"), "a", buffering=1)

    def step(self, record: dict[str, Any]) -> None:
        if self._steps:
            self._steps.write(json.dumps(record) + "\n")

    def epoch(self, record: dict[str, Any]) -> None:
        if self._epochs:
            self._epochs.write(json.dumps(record) + "\n")

    def summary(self, record: dict[str, Any]) -> None:
        if self.enabled:
            write_json_atomic(os.path.join(self.run_dir, "summary.json"), record)

    def close(self) -> None:
        for f in (self._steps, self._epochs):
            if f:
                f.close()


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON so that a reader never sees a half-written file (temp file + rename)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


SUMMARY_COLUMNS = [
    ("algorithm", "algorithm", "{}"),
    ("workers", "workers", "{}"),
    ("model", "model", "{}"),
    ("steps", "steps", "{}"),
    ("skipped", "skipped_steps", "{}"),     # steps dropped on all ranks for a non-finite gradient
    ("test acc", "test_accuracy", "{:.2%}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("step ms", "step_ms", "{:.1f}"),
    ("samples/s", "throughput", "{:.0f}"),
    ("MB sent/step", "mb_sent_per_step", "{:.3f}"),
    ("comm wait", "comm_wait_share", "{:.0%}"),
]


def format_table(rows: Sequence[dict[str, Any]], columns=SUMMARY_COLUMNS) -> str:
    """A markdown table of summary records (missing values print as '-')."""
    def cell(row, key, fmt):
        v = row.get(key)
        return "-" if v is None else fmt.format(v)
    header = "| " + " | ".join(c[0] for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [header, rule]
    for r in rows:
        lines.append("| " + " | ".join(cell(r, k, f) for _, k, f in columns) + " |")
    return "\n".join(lines)
