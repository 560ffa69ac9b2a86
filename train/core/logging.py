"""Metric trackers for accelerate: CSV (default), wandb, none. Chosen by `logger.name`."""
from __future__ import annotations

import csv
import os
from pathlib import Path

from accelerate.tracking import GeneralTracker

from draftsmith.models.errors import choose


class CSVTracker(GeneralTracker):
    """Long-format CSV (step, key, value) at `<output_dir>/metrics.csv`; appends across resumes."""

    name = "csv"
    requires_logging_directory = False

    def __init__(self, output_dir: str | Path):
        super().__init__()
        self.path = Path(output_dir) / "metrics.csv"

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values: dict):
        pass  # the resolved config is saved as config.yaml beside the checkpoints

    def log(self, values: dict, step: int | None = None, **kwargs):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "key", "value"])
            for key, value in values.items():
                writer.writerow([step, key, value])


def _csv(logger_cfg, output_dir):
    return [CSVTracker(output_dir)]


def _wandb(logger_cfg, output_dir):
    # Offline unless the user asks otherwise: online with no network blocks for minutes.
    os.environ.setdefault("WANDB_MODE", logger_cfg.get("mode") or "offline")
    return ["wandb", CSVTracker(output_dir)]


def _none(logger_cfg, output_dir):
    return []


LOGGERS = {"csv": _csv, "wandb": _wandb, "none": _none}


def trackers(logger_cfg, output_dir) -> list:
    """`log_with` for accelerate.Accelerator from the `logger` config group."""
    return choose(LOGGERS, logger_cfg.name, "logger")(logger_cfg, output_dir)


def init_trackers(accelerator, logger_cfg, run_name: str, config: dict, output_dir) -> None:
    init_kwargs = {}
    if logger_cfg.name == "wandb":  # wandb files go under output_dir/wandb unless WANDB_DIR says otherwise
        wandb_dir = os.environ.get("WANDB_DIR") or str(output_dir)
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        init_kwargs["wandb"] = {k: v for k, v in {"entity": logger_cfg.get("entity"), "name": run_name,
                                                  "dir": wandb_dir}.items() if v}
    accelerator.init_trackers(logger_cfg.get("project") or "draftsmith", config=config, init_kwargs=init_kwargs)
