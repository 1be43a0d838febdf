"""Ray token authentication when the driver attaches to ``cluster.address`` (Ray 2.60)."""

from __future__ import annotations

import pytest

from rollplex_train.cluster import ray_auth


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No token anywhere, auth mode unset; afterwards the process's auth mode as it was."""
    import os

    from ray._raylet import Config

    before = os.environ.get("RAY_AUTH_MODE")
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    Config.initialize("")
    yield tmp_path
    monkeypatch.undo()
    os.environ.pop("RAY_AUTH_MODE", None)  # enable_auth_for_address sets it for the process
    if before is not None:
        os.environ["RAY_AUTH_MODE"] = before
    Config.initialize("")


def _mode():
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def test_no_token_leaves_auth_off(clean_env):
    assert ray_auth.find_auth_token_source() is None
    assert ray_auth.enable_auth_for_address("10.0.0.1:6379") == "disabled" and _mode() == "disabled"


@pytest.mark.parametrize("where", ["home", "path", "env"])
def test_a_token_turns_token_mode_on_for_an_explicit_address(clean_env, monkeypatch, where):
    if where == "home":
        (clean_env / ".ray").mkdir()
        (clean_env / ".ray" / "auth_token").write_text("abc\n")
        expected = str(clean_env / ".ray" / "auth_token")
    elif where == "path":
        (clean_env / "tok").write_text("abc")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(clean_env / "tok"))
        expected = str(clean_env / "tok")
    else:
        monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
        expected = "RAY_AUTH_TOKEN"
    assert ray_auth.find_auth_token_source() == expected
    assert _mode() == "disabled"  # what Ray 2.60's ray.init(address="host:port") would use
    assert ray_auth.enable_auth_for_address("10.0.0.1:6379") == "token"
    assert _mode() == "token"


def test_an_explicit_mode_and_auto_are_left_to_ray(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "abc")
    assert ray_auth.enable_auth_for_address("auto") == "auto" and _mode() == "disabled"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert ray_auth.enable_auth_for_address("10.0.0.1:6379") == "disabled"
    (clean_env / "empty").write_text("\n")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(clean_env / "empty"))
    assert ray_auth.find_auth_token_source() is None  # an empty file is no token


def test_an_address_with_no_cluster_is_one_line_naming_the_key_and_rays_reason(clean_env, monkeypatch):
    """``cluster.address=auto`` with no Ray cluster running: ``ClusterUnreachable`` (the CLI prints its
    one line, exit 2) carrying Ray's own reason, not a traceback about tokens."""
    from rollplex_train.cli import _run_errors
    from rollplex_train.cluster import ray_cluster
    from rollplex_train.config import ClusterConfig, Config

    def no_cluster(**kwargs):  # what ray.init(address="auto") raises with nothing running (Ray 2.60)
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(ray_cluster, "_ray_init", no_cluster)
    with pytest.raises(ray_cluster.ClusterUnreachable, match=r"^cluster.address=auto: cannot attach \(Ray auth mode "
                       r"\w+\): ConnectionError: Could not find any running Ray instance\. .*\(no Ray cluster there"):
        ray_cluster.start_ray(Config(cluster=ClusterConfig(address="auto")), clean_env)

    class Trainer:
        step = 0

    with pytest.raises(SystemExit) as stop, _run_errors(Trainer()):
        ray_cluster.start_ray(Config(cluster=ClusterConfig(address="auto")), clean_env)
    assert stop.value.code == 2
