"""Ray token authentication for a driver that attaches to a running cluster (``cluster.address``).

Supported Ray: 2.60.x (pinned in ``pyproject.toml``); the environment variables are Ray's documented
ones (https://docs.ray.io/en/latest/ray-security/token-auth.html), the cached-config refresh is
Ray 2.60's own (``_private/authentication/authentication_token_setup.py::_enable_token_auth``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
"""Ray's token-authentication switch (``token`` or ``disabled``), read by every Ray process."""
TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
"""Where Ray looks for the token, in this order, then ``~/.ray/auth_token`` (Ray 2.60 C++
``AuthenticationTokenLoader``; https://docs.ray.io/en/latest/ray-security/token-auth.html)."""


def find_auth_token_source() -> Optional[str]:
    """Where a Ray authentication token is available to this process, as Ray would load it:
    ``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token`` (non-empty);
    None when there is none."""
    if os.environ.get(TOKEN_ENV, "").strip():
        return TOKEN_ENV
    for path in (os.environ.get(TOKEN_PATH_ENV), Path.home() / ".ray" / "auth_token"):
        try:
            if path and Path(path).read_text().strip():
                return str(path)
        except OSError:
            continue
    return None


def enable_auth_for_address(address: str) -> str:
    """Pick Ray's authentication mode for a driver that attaches to ``address`` and return it.

    Ray 2.60 (``_private/worker.py::init``) turns token authentication on for a driver only when it
    finds a *local* cluster (``address=None``/``"auto"``); with an explicit ``host:port`` it stays
    ``disabled`` unless ``RAY_AUTH_MODE`` says otherwise, so attaching to a cluster that ``ray start``
    ran in token mode (``RAY_AUTH_MODE=token``, or a token in ``~/.ray/auth_token``) fails with
    ``AuthenticationError: ... Authentication token is missing or incorrect``. Here: an explicit
    ``RAY_AUTH_MODE`` is respected; otherwise, when a token is available
    (:func:`find_auth_token_source`), token mode is switched on for this process (a token-mode driver
    also attaches to a cluster without authentication: measured with Ray 2.60.0). The cached Ray
    config is re-read as Ray's own ``authentication_token_setup._enable_token_auth`` does.
    """
    mode = os.environ.get(AUTH_MODE_ENV, "").lower()
    if mode or address == "auto":
        return mode or "auto"
    source = find_auth_token_source()
    if source is None:
        return "disabled"
    os.environ[AUTH_MODE_ENV] = "token"
    from ray._raylet import Config as RayConfig  # Ray 2.60: refreshes the cached RAY_AUTH_MODE

    RayConfig.initialize("")
    log.info("attaching to %s with Ray token authentication (token from %s)", address, source)
    return "token"
