"""Entry points: ``rollplex-train`` (Hydra app: compose config, start the cluster, train)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def conf_dir() -> Path:
    """The Hydra config directory: ``$ROLLPLEX_CONF_DIR`` or the repository's ``conf/``.

    Raises:
        FileNotFoundError: neither exists (a non-editable install without the configs).
    """
    path = Path(os.environ.get("ROLLPLEX_CONF_DIR") or Path(__file__).resolve().parents[2] / "conf")
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"no config.yaml in {path}: set ROLLPLEX_CONF_DIR to the repository's conf/")
    return path


def _train(cfg) -> None:
    from rollplex_train.config import to_config
    from rollplex_train.trainer import Trainer

    import datasets
    import transformers

    config = to_config(cfg)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    Trainer(config, Path(config.trainer.output_dir)).fit()


def train_main() -> None:
    """``rollplex-train +experiment=<name> [key=value ...]``."""
    import hydra

    from rollplex_train.config import register_configs

    register_configs()
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_train)()
