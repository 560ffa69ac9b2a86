"""Test utilities: compose the project's Hydra configs exactly as the entry scripts do; a run's logged
metrics; a free port."""
from __future__ import annotations

import csv
import socket
from pathlib import Path

from hydra import compose, initialize_config_dir

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [], return_hydra_config=False)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a port per launch: fixed ones collide between xdist workers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged(out: Path, key: str) -> list[float]:
    """Every value a run logged under `key`, in order (logger=csv writes out/metrics.csv)."""
    with open(Path(out) / "metrics.csv") as f:
        return [float(r["value"]) for r in csv.DictReader(f) if r["key"] == key]
