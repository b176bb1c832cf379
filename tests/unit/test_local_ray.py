"""The embedded local Ray's settings (`service.cluster.LocalRay`), without starting it."""

from __future__ import annotations

from pathlib import Path

from service.cluster import _PORT_FLAGS, LOCAL_RAY_ENV, free_ports, local_ray_env, local_ray_temp_dir


def test_ray_temp_dir_stays_short_enough_for_unix_sockets(tmp_path: Path) -> None:
    assert local_ray_temp_dir(Path("/srv/apiary")) == Path("/srv/apiary/ray")
    deep = tmp_path / ("x" * 80)
    short = local_ray_temp_dir(deep)
    assert len(str(short)) < 40 and short == local_ray_temp_dir(deep)  # stable, so a restart finds it
    assert short.parent != Path("/tmp")  # Ray makes its folder 0777: Apiary's 0700 one holds it


def test_local_ray_env_tunes_for_one_machine_unless_the_operator_says_otherwise(tmp_path: Path) -> None:
    token = tmp_path / "ray_auth_token"
    env = local_ray_env({"PATH": "/bin", "RAY_AUTH_TOKEN": "stale"}, auth_token_path=token)
    for key, value in LOCAL_RAY_ENV.items():
        assert env[key] == value
    assert env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    assert env["PATH"] == "/bin"
    # Token auth with this data dir's token file, never a token from the service's own environment.
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert "RAY_AUTH_TOKEN" not in env

    operator = local_ray_env({"RAY_enable_metrics_collection": "1"}, auth_token_path=token)
    assert operator["RAY_enable_metrics_collection"] == "1"


def test_the_serve_command_gives_ray_its_token_auth_before_ray_is_first_imported(tmp_path: Path) -> None:
    """Ray fixes its auth mode at its first import, which `apiary serve` does early (to route Ray's
    loggers): without this, every Jobs API call went without a token (401)."""
    from service.runtime import ray_client_env
    from service.settings import Settings

    local = ray_client_env(Settings(data_dir=tmp_path))
    assert local == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "ray_auth_token")}
    external = Settings(ray_address="http://ray:8265", ray_auth_token="secret")
    assert ray_client_env(external) == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "secret"}
    assert ray_client_env(Settings(ray_address="http://ray:8265")) == {}
    source = (Path(__file__).parents[2] / "api" / "cli.py").read_text()
    for command in ("def serve(", "def demo("):
        body = source[source.index(command) :]
        assert body.index("ray_client_env(settings)") < body.index("route_ray_logs("), command


def test_the_local_rays_ports_are_distinct() -> None:
    # Chosen one at a time, two of them once named the same port and Ray refused to start ("port
    # number 59891 that is used by other components"): the service could not come up.
    for _ in range(50):
        ports = free_ports(len(_PORT_FLAGS))
        assert len(set(ports)) == len(_PORT_FLAGS)
