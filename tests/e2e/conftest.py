"""Each test module starts one server (module-scoped fixture): a start costs ~5-10 s (Python
imports, the model read from its stored conversion, models/converted_cache.py; the first start
on a machine converts the GGUF, ~8 s more), so modules share what they can."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from e2e_server import ServerProcess, launch_server
from openai import OpenAI
from ray_cluster import ray_cluster


@pytest.fixture(scope="module")
def server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., ServerProcess]]:
    """Yields `launch`, which starts servers that are all stopped when the module ends."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("kvserve-e2e")

    def launch(*extra_args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = launch_server(log_dir, *extra_args, env=env)
        started.append(server)
        return server

    yield launch
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def http(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[httpx.Client]:
    """An HTTP client on the module's `server` fixture (a module defines `server`), with the
    module's HTTP_TIMEOUT_S (default 120 s)."""
    timeout = getattr(request.module, "HTTP_TIMEOUT_S", 120.0)
    with httpx.Client(base_url=server.base_url, timeout=timeout) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    """The official client on the module's `server` (its own fixture)."""
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    """The name the module's server serves its model under."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def ray_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One local Ray cluster (`ray start --head`) for every module that needs one, stopped at
    the end of the session; yields its clients' variables (RAY_ADDRESS, ...). 4 logical CPUs:
    two Serve replicas and a tensor-parallel rank."""
    with ray_cluster(tmp_path_factory.mktemp("ray"), num_cpus=4) as env:
        yield env
