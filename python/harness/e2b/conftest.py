"""Fixtures of the E2B acceptance suite: a real `sandman serve` on each provider, and the three
environment variables that point the unmodified `e2b` SDK at it.

`e2b_server` is parametrized by run, and every test runs on each:

- `process-host`: the process provider, template `base` (this machine's root, isolated);
- `process-image`: the process provider, the task image of scripts/test-harnesses as the
  template, `docker-daemon:$SANDMAN_E2B_IMAGE` (taken from the local Docker engine into the
  server's image store and mounted as the sandbox's root; the server runs as root);
- `docker`: the docker provider with the static daemon in that image (`$SANDMAN_E2B_IMAGE`,
  `$SANDMAND_STATIC`).

The image has busybox and a static `bash`, which the SDK runs commands with.
`$SANDMAN_E2B_PROVIDERS=process` runs the process provider's two only.
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
#: (run, provider, template: `None` for the task image).
RUNS = [("process-host", "process", "base"), ("process-image", "process", None), ("docker", "docker", None)]


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


def _task_image() -> str:
    image = os.environ.get("SANDMAN_E2B_IMAGE", "")
    if not image:
        raise RuntimeError("the image runs need SANDMAN_E2B_IMAGE: an image with bash (scripts/test-harnesses)")
    return image


@pytest.fixture(scope="session", params=[r for r in RUNS if r[1] in PROVIDERS], ids=lambda r: r[0])
def e2b_server(request: pytest.FixtureRequest) -> Iterator[E2bServer]:
    run, provider, template = request.param
    if template is None:
        template = _task_image() if provider == "docker" else f"docker-daemon:{_task_image()}"
    gen = serve(f"e2b-{run}", _args(provider))
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
