"""The wandb backend of :class:`~rollplex_train.tracking.loggers.Tracker`: one run per training run.

- **Mode.** Online when ``WANDB_API_KEY`` is set *or* the user logged in with ``wandb login`` (an API
  key for the wandb host in the netrc file, the file wandb itself writes); offline otherwise, so a
  run needs no account. ``WANDB_MODE`` (``offline``/``dryrun``/``disabled``) wins.
- **Bounded start.** ``wandb.init`` waits at most ``init_timeout_s`` (wandb's ``Settings.init_timeout``,
  90 s by default in wandb 0.31). If an online start fails (server unreachable, bad key, timeout),
  the run logs offline in the run directory instead, with one warning naming the cause; ``wandb sync``
  uploads it later.
- **One run across resumes.** The run id is chosen here (8 base-36 characters, the form of wandb's
  own ids, ``wandb/sdk/lib/runid.py``) or passed in
  (the id saved with the checkpoint being resumed) and given to ``wandb.init(id=..., resume="allow")``,
  so a resumed training run continues the same wandb run.

All wandb files live in ``<output_dir>/wandb`` (``WANDB_DIR`` and friends are set in ``os.environ``:
wandb reads several of them only from the environment).
"""

from __future__ import annotations

import logging
import netrc
import os
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

__all__ = ["WandbBackend", "netrc_has_wandb_login", "new_run_id", "wandb_mode_from_env"]

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.wandb.ai"
_DIR_VARS = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")


def netrc_has_wandb_login(environ: Mapping[str, str] | None = None) -> bool:
    """True when the netrc file holds credentials for the wandb host (what ``wandb login`` writes).

    The file is ``$NETRC`` or ``~/.netrc`` and the host the netloc of ``$WANDB_BASE_URL`` (default
    ``api.wandb.ai``), as wandb 0.31 reads them (``wandb/sdk/lib/wbauth/wbnetrc.py``). An unreadable
    or malformed file, or an entry without a password (the API key), counts as no login.
    """
    env = os.environ if environ is None else environ
    path = Path(env.get("NETRC") or Path(env.get("HOME") or Path.home()) / ".netrc").expanduser()
    host = urlsplit(env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).netloc
    if not host or not path.is_file():
        return False
    try:
        creds = netrc.netrc(str(path)).authenticators(host)  # (login, account, password) or None
    except (netrc.NetrcParseError, OSError):
        return False
    return bool(creds and creds[2])  # the password is the API key


def wandb_mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The wandb mode this process will use: ``"online"``, ``"offline"`` or ``"disabled"``.

    ``WANDB_MODE`` of ``offline``/``dryrun`` -> offline, ``disabled`` -> disabled. Otherwise online
    when ``WANDB_API_KEY`` is set or :func:`netrc_has_wandb_login`; offline without credentials.
    """
    env = os.environ if environ is None else environ
    mode = env.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun"):
        return "offline"
    if mode == "disabled":
        return "disabled"
    return "online" if env.get("WANDB_API_KEY") or netrc_has_wandb_login(env) else "offline"


def new_run_id(length: int = 8) -> str:
    """A fresh wandb run id: ``length`` random characters of ``[a-z0-9]``."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


class WandbBackend:
    """A wandb run whose files all live in ``<output_dir>/wandb``.

    Args:
        output_dir: the run directory. project, experiment: wandb project and run name.
        config: the resolved run config (wandb config).
        run_id: the id of the run to continue (a resume); None starts a new run with a fresh id.
        init_timeout_s: most seconds ``wandb.init`` may take (> 0).

    Attributes:
        run_id: the wandb run id (save it with the checkpoint). mode: the mode finally used
        (``online`` falls back to ``offline`` when the online start fails).

    Raises:
        Exception: whatever wandb raises when even the offline start fails.
    """

    def __init__(self, output_dir: Path, project: str, experiment: str, config: Mapping[str, Any],
                 run_id: Optional[str] = None, init_timeout_s: float = 30.0) -> None:
        self.dir = Path(output_dir) / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        for var in _DIR_VARS:
            os.environ[var] = str(self.dir)
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.mode = wandb_mode_from_env()
        self.run_id = run_id or new_run_id()
        args = dict(project=project, name=experiment, config=dict(config), dir=str(self.dir), id=self.run_id,
                    resume="allow")
        try:
            self._run = self._init(wandb, self.mode, init_timeout_s, args)
        except Exception as err:  # noqa: BLE001 - wandb raises CommError, UsageError, TimeoutError, ...
            if self.mode != "online":
                raise
            cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            log.warning("wandb: the online start failed (%s); logging offline to %s instead (upload later with "
                        "`wandb sync %s`)", cause, self.dir, self.dir)
            self.mode = "offline"
            wandb.teardown()  # the failed start still holds the run id in wandb's service process
            self._run = self._init(wandb, "offline", init_timeout_s, args)
        log.info("wandb run %s id %s (%s) in %s", experiment, self.run_id, self.mode, self.dir)

    @staticmethod
    def _init(wandb, mode: str, timeout_s: float, args: dict):
        settings = wandb.Settings(silent=True, console="off", save_code=False, x_save_requirements=False,
                                  init_timeout=float(timeout_s))
        return wandb.init(mode=mode, settings=settings, **args)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()
