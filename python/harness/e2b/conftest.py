"""Fixtures of the E2B acceptance suite: a real `sandman serve` on each provider, and the three
environment variables that point the unmodified `e2b` SDK at it.

`e2b_server` is parametrized by provider: `process` (this machine, template `base`) and
`docker` (the static daemon in the task image of scripts/test-harnesses, whose `bash` the SDK
runs commands with; `$SANDMAN_E2B_IMAGE`, `$SANDMAND_STATIC`). Every test runs on both.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandman_server import REPO, Server, serve  # noqa: E402

PROVIDERS = [p for p in os.environ.get("SANDMAN_E2B_PROVIDERS", "process,docker").split(",") if p]


@dataclass
class E2bServer:
    server: Server
    provider: str
    template: str

    @property
    def api_url(self) -> str:
        return f"{self.server.url}/e2b"

    @property
    def sandbox_url(self) -> str:
        return f"{self.server.url}/e2b/envd"


def _args(provider: str) -> list:
    if provider == "process":
        return []
    daemon = os.environ.get("SANDMAND_STATIC") or str(
        REPO / "target" / "static" / "x86_64-unknown-linux-gnu" / "daemon" / "sandmand"
    )
    if not Path(daemon).exists():
        raise RuntimeError(f"no static sandmand at {daemon}: run ./scripts/build-daemon, or set SANDMAND_STATIC")
    return ["--provider", "docker", "--daemon", daemon]


@pytest.fixture(scope="session", params=PROVIDERS)
def e2b_server(request: pytest.FixtureRequest) -> Iterator[E2bServer]:
    provider = request.param
    if provider == "process":
        template = "base"
    else:
        template = os.environ.get("SANDMAN_E2B_IMAGE", "")
        if not template:
            raise RuntimeError("the docker run needs SANDMAN_E2B_IMAGE: an image with bash (scripts/test-harnesses)")
    gen = serve(f"e2b-{provider}", _args(provider))
    server = next(gen)
    try:
        yield E2bServer(server, provider, template)
    finally:
        gen.close()


@pytest.fixture
def e2b_env(e2b_server: E2bServer, monkeypatch: pytest.MonkeyPatch) -> E2bServer:
    """The three variables a user sets, and nothing else: the SDK finds the server by them."""
    monkeypatch.setenv("E2B_API_URL", e2b_server.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_server.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", e2b_server.server.token)
    for var in ("E2B_DOMAIN", "E2B_DEBUG", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return e2b_server
