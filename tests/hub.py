"""Compose the project's Hydra configs in tests exactly as the entry scripts do."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_config(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides or [], return_hydra_config=False)
