"""Fixtures of the Harbor suite: a `sandman serve` on each provider, the tasks' image, and a way to
run the real `harbor run` CLI against it. Runs in the Python 3.12 virtualenv that
`scripts/test-harnesses harbor` makes (Harbor needs 3.12); see test_harbor.py.

`server` is parametrized by provider, and every test runs on both: `docker` (the static daemon
in the task's container) and `process` (the embedded default, isolated: the task's image is
found by its plain name in the local Docker engine, unpacked into the server's image store and
mounted as the sandbox's root; the server runs as root). `$SANDMAN_HARBOR_PROVIDERS=process`
runs one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandman_server import REPO, Server, serve  # noqa: E402


def _static_daemon() -> Path:
    env = os.environ.get("SANDMAND_STATIC")
    path = Path(env) if env else REPO / "target" / "static" / "x86_64-unknown-linux-gnu" / "daemon" / "sandmand"
    if not path.exists():
        raise RuntimeError(f"no static daemon at {path}: run ./scripts/build-daemon (or set SANDMAND_STATIC)")
    return path


PROVIDERS = [p for p in os.environ.get("SANDMAN_HARBOR_PROVIDERS", "docker,process").split(",") if p]


@pytest.fixture(scope="session", params=PROVIDERS)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """`sandman serve` on the provider: `--provider docker` with the static daemon, or the
    process provider, isolated. Docker must be running for both (the tasks' images are the
    engine's, and Dockerfile tasks are built with it)."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        raise RuntimeError("the docker engine is not running: start it (setsid dockerd >/var/log/dockerd.log 2>&1 &)")
    provider = request.param
    if provider == "docker":
        args = ["--provider", "docker", "--daemon", str(_static_daemon())]
    elif provider == "process":
        if os.geteuid() != 0:
            raise RuntimeError("the process provider runs task images isolated, which needs root: run as root")
        args = []
    else:
        raise RuntimeError(f"unknown provider `{provider}` in SANDMAN_HARBOR_PROVIDERS (docker, process)")
    yield from serve(f"harbor-{provider}", args)


@pytest.fixture(scope="session")
def image() -> str:
    """The tasks' base image, built locally by `scripts/test-harnesses` (busybox and bash): its
    plain name, as a task.toml names an image, on both providers."""
    image = os.environ.get("SANDMAN_HARBOR_IMAGE")
    if not image:
        raise RuntimeError("SANDMAN_HARBOR_IMAGE is not set: run this suite with `scripts/test-harnesses harbor`")
    return image


@dataclass
class Trial:
    task: str
    rewards: Dict[str, Any]
    exception: str
    result: Dict[str, Any]

    @property
    def reward(self) -> Any:
        return self.rewards.get("reward")


@dataclass
class Job:
    dir: Path
    trials: List[Trial]
    output: str

    def by_task(self) -> Dict[str, Trial]:
        return {t.task: t for t in self.trials}


@dataclass
class Harbor:
    server: Server
    jobs: Path

    def run(self, *args: str, name: str, timeout: float = 600) -> Job:
        """Runs `harbor run ARGS --env sandman.integrations.harbor:SandmanEnvironment` as a user
        would, the server given by SANDMAN_URL and SANDMAN_TOKEN, and reads the trials' results."""
        harbor = Path(sys.executable).parent / "harbor"
        env = dict(
            os.environ,
            SANDMAN_URL=self.server.url,
            SANDMAN_TOKEN=self.server.token,
            # No telemetry, and litellm's bundled cost map rather than a download: the tests send
            # nothing off this machine.
            HARBOR_TELEMETRY="0",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
        )
        cmd = [
            str(harbor), "run", *args, "--env", "sandman.integrations.harbor:SandmanEnvironment",
            "--jobs-dir", str(self.jobs), "--job-name", name, "--yes", "--quiet",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output}"
        job_dir = self.jobs / name
        trials = []
        for result in sorted(job_dir.glob("*/result.json")):
            data = json.loads(result.read_text())
            verifier = data.get("verifier_result") or {}
            exc = data.get("exception_info") or {}
            trials.append(Trial(data["task_name"], verifier.get("rewards") or {}, exc.get("exception_type", ""), data))
        assert trials, f"no trial results under {job_dir}:\n{output}"
        return Job(job_dir, trials, output)


@pytest.fixture(scope="session")
def harbor(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Harbor:
    return Harbor(server, tmp_path_factory.mktemp("jobs"))
