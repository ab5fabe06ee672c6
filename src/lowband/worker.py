"""Entry point of one spawned worker: ``python -m lowband.worker RUN_DIR/config.json``."""
from __future__ import annotations

import sys

from .config import TrainConfig
from .train import run_worker


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lowband.worker CONFIG_JSON", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        cfg = TrainConfig.from_json(f.read())
    run_worker(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
