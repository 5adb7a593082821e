"""`SandmanEnvironment` driven directly through Harbor's `BaseEnvironment` interface, for what the
trials in test_harbor.py do not reach: output streamed to Harbor's callbacks, a command's own
timeout, file transfers one by one and filtered, the default user, and what it refuses."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, List, Tuple

import pytest
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from sandman.integrations.harbor import SandmanEnvironment
from sandman_server import Server


def make(tmp_path: Path, server: Server, image: str, **kwargs: Any) -> SandmanEnvironment:
    env_dir = tmp_path / "environment"
    env_dir.mkdir(exist_ok=True)
    config = kwargs.pop("task_env_config", None) or EnvironmentConfig(docker_image=image, workdir="/work")
    return SandmanEnvironment(
        environment_dir=env_dir,
        environment_name="direct",
        session_id="direct__x__env",
        trial_paths=TrialPaths(tmp_path / "trial"),
        task_env_config=config,
        url=server.url,
        token=server.token,
        lease=60,
        **kwargs,
    )


def test_exec_streams_to_harbor_callbacks_times_out_and_transfers_files(
    tmp_path: Path, server: Server, image: str
) -> None:
    env = make(tmp_path, server, image, persistent_env={"PERSISTENT": "p"})

    async def scenario() -> None:
        await env.start(force_build=False)
        try:
            r = await env.exec("echo out; echo err >&2; pwd; echo $PERSISTENT $EXTRA; exit 3", env={"EXTRA": "e"})
            assert (r.stdout, r.stderr, r.return_code) == ("out\n/work\np e\n", "err\n", 3)

            seen: List[Tuple[str, str]] = []

            async def callback(text: str, stream: Any) -> None:
                seen.append((stream, text))

            with env.scoped_output_callback(callback):
                r = await env.exec("echo streamed; echo also >&2")
            assert r.stdout == "streamed\n" and sorted(seen) == [("stderr", "also\n"), ("stdout", "streamed\n")]

            with pytest.raises(RuntimeError, match="Command timed out after 1 seconds"):
                await env.exec("sleep 30", timeout_sec=1)

            with env.with_default_user(1000):
                assert (await env.exec("id -u")).stdout == "1000\n"
                assert (await env.exec("id -u", user="root")).stdout == "0\n"

            local = tmp_path / "run.sh"
            local.write_text("#!/bin/bash\necho ran\n")
            local.chmod(0o755)
            await env.upload_file(local, "/work/")  # into a directory
            await env.upload_file(local, "/work/renamed.sh")
            assert (await env.exec("/work/run.sh && /work/renamed.sh")).stdout == "ran\nran\n"

            await env.exec("mkdir -p /out/a/b && echo 1 > /out/keep.txt && echo 2 > /out/a/b/skip.log && echo 3 > /out/reward.txt")
            await env.download_file("/out/keep.txt", tmp_path / "got" / "keep.txt")
            assert (tmp_path / "got" / "keep.txt").read_text() == "1\n"
            await env.download_dir_filtered(
                source_dir="/out", target_dir=tmp_path / "filtered", exclude=["*.log", "*.txt"], protect=["reward.txt"]
            )
            got = sorted(str(p.relative_to(tmp_path / "filtered")) for p in (tmp_path / "filtered").rglob("*") if p.is_file())
            assert got == ["reward.txt"]
            assert await env.is_dir("/out/a") and await env.is_file("/out/keep.txt")
            sandbox = env.sandbox.id
        finally:
            await env.stop(delete=True)
        assert server.live_sandboxes() == [] and sandbox

    asyncio.run(scenario())


def test_what_it_refuses(tmp_path: Path, server: Server, image: str) -> None:
    with pytest.raises(ValueError, match="cannot mount host paths"):
        make(tmp_path, server, image, mounts=[{"type": "bind", "source": "/etc", "target": "/host-etc"}])
    with pytest.raises(ValueError, match="allowlist"):
        make(
            tmp_path,
            server,
            image,
            network_policy=NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["example.com"]),
        )
    (tmp_path / "environment").mkdir(exist_ok=True)
    (tmp_path / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(ValueError, match="docker compose tasks"):
        make(tmp_path, server, image)
    os.remove(tmp_path / "environment" / "docker-compose.yaml")
    with pytest.raises(ValueError, match="Unknown option 'no_such_option'"):
        make(tmp_path, server, image, no_such_option=1)


def test_cpus_and_memory_are_the_sandboxs_limits(tmp_path: Path, server: Server, image: str) -> None:
    config = EnvironmentConfig(docker_image=image, cpus=0.5, memory_mb=256)
    env = make(tmp_path, server, image, task_env_config=config)

    async def scenario() -> None:
        await env.start(force_build=False)
        try:
            with server.client() as c:
                resources = c.get(env.sandbox.id).resources
            # The process provider gives every sandbox a disk (its writable layer), the server's
            # --default-disk when the create names none; docker has no disk limit.
            default_disk = {"disk": "1Gi"} if server.provider == "process" else {}
            assert resources == {"cpu": 0.5, "memory": "256Mi", **default_disk}
            # what the kernel enforces, seen from inside (cgroup v2, else v1)
            r = await env.exec(
                "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
            )
            assert r.stdout == f"{256 << 20}\n", r
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())


def test_merge_output_gives_one_stream_in_the_order_written(tmp_path: Path, server: Server, image: str) -> None:
    env = make(tmp_path, server, image, merge_output=True)

    async def scenario() -> None:
        await env.start(force_build=False)
        try:
            r = await env.exec("for i in 1 2 3; do echo out$i; echo err$i >&2; done")
            assert (r.stdout, r.stderr) == ("out1\nerr1\nout2\nerr2\nout3\nerr3\n", None)
        finally:
            await env.stop(delete=True)

    asyncio.run(scenario())
