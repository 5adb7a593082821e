"""A Harbor environment on a Sandman sandbox.

Harbor (https://github.com/harbor-framework/harbor, `pip install harbor`, Python 3.12+) runs a
task's agent and verifier in an *environment*, a `harbor.environments.base.BaseEnvironment`.
`SandmanEnvironment` is one whose container is a Sandman sandbox: each trial creates one sandbox
of the task's image when Harbor starts the environment and releases it when Harbor stops it.
Every exec, upload and download goes through the server, so the trial runs on whatever provider
the server has (process, docker, kubernetes).

    harbor run -p ./tasks -a oracle --env sandman.integrations.harbor:SandmanEnvironment \\
        --ek job=my-eval --ek lease=900

The server and its token come from `SANDMAN_URL` and `SANDMAN_TOKEN` (or the server's token
file), as for the SDK; `--ek url=...` works too, but Harbor writes every `--ek` into the job's
`config.json`, so keep the token out of it. The options (`--ek key=value`) are
`SandmanOptions`'s fields.

What it does as Harbor's own docker environment does:

- the image: the task's `docker_image` (a prebuilt image), else its `environment/Dockerfile`
  built with the local `docker build` when the server runs the docker provider, or the process
  provider, which takes it from the same engine as `docker-daemon:<tag>` (tagged
  `hb__<content hash>` as Harbor tags it; an unchanged definition reuses the image);
- commands run as `bash -c <command>` (`shell` option), as the caller's `user` else the
  environment's default user (Harbor sets it to the task's agent or verifier user) else the
  sandbox's default (the image's `USER`), in `cwd` else the task's `workdir` else the image's
  `WORKDIR`, with the task's and the trial's environment variables;
- a command that runs past its `timeout_sec` has its process tree killed and raises
  `RuntimeError("Command timed out after N seconds")`;
- `network_mode = "no-network"` is a sandbox with `network: none` (only `lo`); allowlists are
  refused, since a sandbox has no egress filter;
- `cpus` and `memory_mb` are the sandbox's `cpu` and `memory` limits (`--cpus`/`--memory`
  enforcement policies apply); `storage_mb` is sent as `disk` only with `enforce_storage`, since
  the docker provider cannot limit disk (Harbor's docker environment ignores it too);
- uploads and downloads are tar archives through the daemon, modes and symlinks kept, so the
  image needs no `tar`.

Compose tasks (`environment/docker-compose.yaml`), GPUs, TPUs, Windows and mounts from the host are
refused with an error saying so.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Dict, List, Literal, Optional, Union

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import (
    DOCKERFILE_NAME,
    require_agent_environment_definition,
    should_use_prebuilt_docker_image,
)
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode, TaskOS
from harbor.models.trial.config import ResourceMode
from harbor.utils.path_filter import filter_paths_by_patterns
from pydantic import Field

from .. import AsyncSandbox, AsyncSandman, SandmanError

__all__ = ["SandmanEnvironment", "SandmanOptions"]

#: The providers that run images of the Docker engine on the server's machine: an image built
#: here with `docker build` reaches their sandboxes when the server runs on this machine.
_LOCAL_ENGINE_PROVIDERS = ("docker", "process")

log = logging.getLogger(__name__)


class SandmanOptions(EnvironmentOptions):
    """The environment's options: Harbor's `--ek key=value` (or `environment.kwargs`)."""

    url: Optional[str] = Field(default=None, description="The Sandman server (default: $SANDMAN_URL).")
    token: Optional[str] = Field(
        default=None,
        description="Its token (default: $SANDMAN_TOKEN or the server's token file). Harbor saves "
        "environment kwargs in the job's config.json: prefer the environment variable.",
    )
    provider: Optional[str] = Field(default=None, description="The server's provider to ask for.")
    image: Optional[str] = Field(default=None, description="Use this image instead of the task's.")
    build: Literal["auto", "docker", "never"] = Field(
        default="auto",
        description="How a task with only an environment/Dockerfile gets its image: `docker` builds "
        "it with the local docker CLI; `auto` does so when the server runs the docker or the process "
        "provider (on this machine: they take images from its Docker engine); `never` refuses such tasks.",
    )
    merge_output: bool = Field(
        default=False,
        description="Give a command's stdout and stderr one pipe: all of it in `stdout`, in the order "
        "written, as Harbor's docker environment returns it (default: apart, as its cloud environments do).",
    )
    shell: List[str] = Field(
        default_factory=lambda: ["bash", "-c"],
        description="What runs a command (the command is appended), as Harbor's docker environment does.",
    )
    job: Optional[str] = Field(default=None, description="The Sandman job the sandboxes count against.")
    labels: Dict[str, str] = Field(default_factory=dict, description="Labels added to each sandbox.")
    profile: Optional[str] = Field(default=None, description="`default` or `eval`.")
    pool: Optional[str] = Field(default=None, description="Claim sandboxes from this warm pool.")
    lease: int = Field(
        default=600,
        ge=10,
        description="Lease of the sandbox in seconds, renewed by the environment while it runs: a "
        "Harbor process that dies leaves its sandboxes for at most this long.",
    )
    ttl: Optional[int] = Field(default=None, ge=1, description="Longest lifetime of a sandbox, in seconds.")
    create_timeout: Optional[int] = Field(
        default=None, ge=1, description="How long a create may wait (admission queue, image pull), in seconds."
    )
    enforce_storage: bool = Field(
        default=False, description="Send the task's storage_mb as the sandbox's `disk` limit."
    )
    keep_sandbox: bool = Field(
        default=False, description="Leave the sandbox running when the trial stops (its lease still ends it)."
    )


class SandmanEnvironment(BaseEnvironment):
    """A Harbor environment whose container is a Sandman sandbox (see the module's docstring)."""

    options_model: ClassVar[Any] = SandmanOptions
    options: SandmanOptions

    #: One lock per image tag, so that trials of one task build its image once.
    _build_locks: ClassVar[Dict[str, asyncio.Lock]] = {}

    def __init__(self, *args: Any, mounts: Optional[List[Any]] = None, **kwargs: Any) -> None:
        if mounts:
            raise ValueError(
                "the sandman environment cannot mount host paths into a sandbox "
                f"(mounts {[m.get('target') for m in mounts]}): upload the files instead"
            )
        super().__init__(*args, mounts=mounts, **kwargs)
        self._client: Optional[AsyncSandman] = None
        self._sandbox: Optional[AsyncSandbox] = None
        self._keepalive: Optional[asyncio.Task[None]] = None
        self._image: Optional[str] = None

    # ---- what Harbor asks of an environment class ----

    @staticmethod
    def type() -> str:
        return "sandman"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    def _validate_definition(self) -> None:
        if self.os == TaskOS.WINDOWS:
            raise RuntimeError("the sandman environment runs Linux images only; this task targets Windows")
        require_agent_environment_definition(
            self.environment_dir,
            docker_image=self.task_env_config.docker_image,
            extra_docker_compose_paths=self.extra_docker_compose_paths,
        )
        if self.extra_docker_compose_paths or (self.environment_dir / "docker-compose.yaml").exists():
            raise ValueError(
                "the sandman environment runs one container per trial: docker compose tasks "
                f"({self.environment_dir / 'docker-compose.yaml'}) are not supported"
            )

    @property
    def sandbox(self) -> AsyncSandbox:
        """The trial's sandbox, once started."""
        if self._sandbox is None:
            raise RuntimeError("the sandman environment is not started")
        return self._sandbox

    # ---- lifecycle ----

    async def start(self, force_build: bool) -> None:
        o = self.options
        self._client = AsyncSandman(o.url, o.token, max_connections=32)
        image = await self._resolve_image(force_build)
        resources: Dict[str, Any] = {}
        cpu = self._resource_limit_value("cpu", auto_mode=ResourceMode.LIMIT)
        if cpu is not None:
            resources["cpu"] = cpu
        memory_mb = self._resource_limit_value("memory", auto_mode=ResourceMode.LIMIT)
        if memory_mb is not None:
            resources["memory"] = f"{memory_mb}Mi"
        if o.enforce_storage and self.task_env_config.storage_mb:
            resources["disk"] = f"{self.task_env_config.storage_mb}Mi"
        labels = {
            **o.labels,
            "harbor.task": _label_value(self.environment_name),
            "harbor.session": _label_value(self.session_id),
        }
        network = "none" if self.network_policy.network_mode == NetworkMode.NO_NETWORK else None
        self.logger.debug(f"creating a sandbox of {image} for {self.session_id}")
        self._sandbox = await self._client.create(
            image,
            provider=o.provider,
            job=o.job,
            resources=resources or None,
            profile=o.profile,
            network=network,
            env=self._startup_env() or None,
            labels=labels,
            lease=o.lease,
            ttl=o.ttl,
            pool=o.pool,
            wait_timeout=o.create_timeout,
        )
        self.logger.debug(f"sandbox {self._sandbox.id} is ready for {self.session_id}")
        self._keepalive = asyncio.ensure_future(self._renew_lease(self._sandbox, o.lease / 3.0))
        workdir = self.task_env_config.workdir
        if workdir:  # commands start there: make it, as Harbor's cloud environments do
            await self._sandbox.mkdir(workdir)
        await self._upload_environment_dir_after_start()
        await self.ensure_dirs(self._mount_targets(writable_only=True))

    async def stop(self, delete: bool) -> None:
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None:
            keepalive.cancel()
            try:
                await keepalive
            except asyncio.CancelledError:
                pass
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None and not self.options.keep_sandbox:
                try:
                    await sandbox.release()
                except SandmanError as e:  # its lease reclaims it anyway
                    self.logger.warning(f"could not release sandbox {sandbox.id}: {e}")
        finally:
            client, self._client = self._client, None
            if client is not None:
                await client.aclose()

    async def _renew_lease(self, sandbox: AsyncSandbox, interval: float) -> None:
        """Renews the sandbox's lease while the environment runs: a call can last longer than
        the lease (an agent's command, a verifier), and only calls that start renew it."""
        while True:
            await asyncio.sleep(interval)
            try:
                await sandbox.keepalive()
            except SandmanError as e:
                self.logger.warning(f"could not renew the lease of sandbox {sandbox.id}: {e}")

    async def _resolve_image(self, force_build: bool) -> str:
        o = self.options
        if o.image:
            return o.image
        docker_image = self.task_env_config.docker_image
        if should_use_prebuilt_docker_image(self.environment_dir, docker_image=docker_image, force_build=force_build):
            return str(docker_image)
        dockerfile = self.environment_dir / DOCKERFILE_NAME
        if not dockerfile.exists():
            raise FileNotFoundError(f"the task has neither docker_image nor {dockerfile}")
        build = o.build
        assert self._client is not None
        provider = o.provider or (await self._client.health()).provider
        if build == "auto":
            build = "docker" if provider in _LOCAL_ENGINE_PROVIDERS else "never"
            if build == "never":
                raise RuntimeError(
                    f"the task {self.environment_name} has only {dockerfile}, and the sandman server runs the "
                    f"`{provider}` provider, which cannot use an image built here: push the image and set "
                    "docker_image in task.toml (or pass --ek image=...)"
                )
        if build == "never":
            raise RuntimeError(
                f"the task {self.environment_name} has only {dockerfile} and build=never: set docker_image "
                "in task.toml or pass --ek image=..."
            )
        tag = await self._docker_build(force_build)
        # The process provider takes the engine's image by id each time it is asked by
        # `docker-daemon:` (a plain name, once in its store, stays what it was: a rebuild under
        # the same tag would not reach it).
        return f"docker-daemon:{tag}" if provider == "process" else tag

    async def _docker_build(self, force_build: bool) -> str:
        """Builds the task's Dockerfile with the local docker CLI, tagged as Harbor's docker
        environment tags it (`hb__<content hash>`): the server's docker provider then finds it,
        and its process provider by `docker-daemon:<tag>`."""
        if shutil.which("docker") is None:
            raise RuntimeError("building the task's Dockerfile needs the docker CLI, which is not on PATH")
        tag = _image_name(f"hb__{self.environment_id}")
        lock = self._build_locks.setdefault(tag, asyncio.Lock())
        async with lock:
            if not force_build and await _docker_ok("image", "inspect", tag):
                return tag
            self.logger.debug(f"building {tag} from {self.environment_dir}")
            proc = await asyncio.create_subprocess_exec(
                "docker",
                "build",
                "--tag",
                tag,
                str(self.environment_dir.resolve()),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await proc.communicate()
            if proc.returncode != 0:
                text = out.decode(errors="replace")
                raise RuntimeError(f"docker build of {self.environment_dir} failed ({proc.returncode}):\n{text[-4000:]}")
        return tag

    # ---- commands ----

    async def exec(
        self,
        command: str,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout_sec: Optional[int] = None,
        user: Union[str, int, None] = None,
    ) -> ExecResult:
        argv = [*self.options.shell, command]
        user = self._resolve_user(user)
        kwargs: Dict[str, Any] = {
            "timeout": timeout_sec or None,
            "env": self._merge_env(env),
            "cwd": cwd or self.task_env_config.workdir or None,
            "user": None if user is None else str(user),
            "merge_output": self.options.merge_output,
        }
        callback = self._output_callback()
        status: Any
        if callback is None:
            r = await self.sandbox.exec(argv, **kwargs)
            status, stdout, stderr = r, r.stdout, r.stderr
        else:
            out: List[str] = []
            err: List[str] = []
            async with self.sandbox.exec_stream(argv, **kwargs) as stream:
                async for ev in stream:
                    if ev.type in ("stdout", "stderr"):
                        (out if ev.type == "stdout" else err).append(ev.data)
                        await callback(ev.data, ev.type)
            assert stream.exit is not None
            status, stdout, stderr = stream.exit, "".join(out), "".join(err)
        if status.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=stdout or None, stderr=stderr or None, return_code=_return_code(status))

    # ---- an interactive shell ----

    async def attach(self) -> None:
        """An interactive `bash` in the sandbox on this terminal (`harbor task start-env -i`),
        until it exits: keystrokes go to a terminal in the sandbox, its screen comes back, and
        a resized window resizes it. As the environment's default user, in its workdir."""
        import signal
        import sys
        import termios
        import tty

        fd = sys.stdin.fileno()
        if not os.isatty(fd):
            raise RuntimeError("attaching to the sandbox needs a terminal on stdin")
        # The terminal's own size (shutil's would prefer $COLUMNS and $LINES).
        cols, rows = os.get_terminal_size(fd)
        user = self._resolve_user(None)
        env = {**(self._merge_env(None) or {}), "TERM": os.environ.get("TERM", "xterm-256color")}
        process = await self.sandbox.start(
            [self.options.shell[0]] if self.options.shell else ["bash"],
            env=env,
            cwd=self.task_env_config.workdir or None,
            user=None if user is None else str(user),
            pty=(rows, cols),
        )
        loop = asyncio.get_running_loop()
        keys: "asyncio.Queue[bytes]" = asyncio.Queue()
        loop.add_reader(fd, lambda: keys.put_nowait(os.read(fd, 4096)))

        resizes: "set[asyncio.Future[Any]]" = set()

        def resized(task: "asyncio.Future[Any]") -> None:
            resizes.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self.logger.warning(f"could not resize the sandbox's terminal: {task.exception()}")

        def on_resize() -> None:
            c, r = os.get_terminal_size(fd)
            task = asyncio.ensure_future(process.resize(r, c))
            resizes.add(task)
            task.add_done_callback(resized)

        loop.add_signal_handler(signal.SIGWINCH, on_resize)
        saved = termios.tcgetattr(fd)
        tty.setraw(fd)

        async def forward_keys() -> None:
            while True:
                keystrokes = await keys.get()
                if keystrokes:  # bytes go to the terminal as they are
                    await process.write_stdin(keystrokes)

        typing = asyncio.ensure_future(forward_keys())
        try:
            async with process.follow() as screen:
                async for ev in screen:
                    if ev.type == "data":
                        os.write(sys.stdout.fileno(), ev.data.encode("utf-8"))
        finally:
            typing.cancel()
            loop.remove_reader(fd)
            loop.remove_signal_handler(signal.SIGWINCH)
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
            await process.kill()

    # ---- files ----

    async def upload_file(self, source_path: Union[Path, str], target_path: str) -> None:
        source = Path(source_path)
        data = await asyncio.to_thread(source.read_bytes)
        target = target_path
        if target.endswith("/") or await self._is_dir(target):
            target = str(PurePosixPath(target) / source.name)
        await self.sandbox.write_file(target, data, mode=source.stat().st_mode & 0o7777)

    async def upload_dir(self, source_dir: Union[Path, str], target_dir: str) -> None:
        await self.sandbox.upload(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Union[Path, str]) -> None:
        data = await self.sandbox.read_file(source_path)
        target = Path(target_path)
        await asyncio.to_thread(_write_local, target, data)

    async def download_dir(self, source_dir: str, target_dir: Union[Path, str]) -> None:
        await self.sandbox.download(source_dir, target_dir)

    async def download_dir_filtered(
        self,
        *,
        source_dir: str,
        target_dir: Union[Path, str],
        include: Optional[Sequence[str]] = None,
        exclude: Optional[Sequence[str]] = None,
        protect: Optional[Sequence[str]] = None,
    ) -> None:
        """Harbor's filtered download, with the filtering done here on the directory's tar (no
        `find` or `tar` needed in the image): regular files selected by Harbor's own
        `filter_paths_by_patterns`, plus the `protect`ed paths."""
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        data = await self.sandbox.download_tar(source_dir)
        await asyncio.to_thread(_extract_selected, data, target, include, exclude, protect, self.logger)

    async def _is_dir(self, path: str) -> bool:
        try:
            return (await self.sandbox.stat(path)).kind == "dir"
        except SandmanError:
            return False


# ---- helpers ----


def _return_code(status: Any) -> int:
    """The command's exit code; 128+N when signal N killed it, as a shell and `docker exec` say."""
    if status.exit_code is not None:
        return int(status.exit_code)
    if status.signal is not None:
        return 128 + int(status.signal)
    return -1


def _label_value(value: str) -> str:
    """A label value every provider accepts (Kubernetes' rules: 63 characters of
    `[A-Za-z0-9._-]`, alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", value)[:63].strip("._-")
    return value or "x"


def _image_name(name: str) -> str:
    """Harbor's docker environment's image naming (`_sanitize_docker_image_name`)."""
    name = name.lower()
    if not re.match(r"^[a-z0-9]", name):
        name = "0" + name
    return re.sub(r"[^a-z0-9._-]", "-", name)


async def _docker_ok(*args: str) -> bool:
    proc = await asyncio.create_subprocess_exec(
        "docker", *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return await proc.wait() == 0


def _write_local(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as f:
        f.write(data)
    os.replace(f.name, target)


def _extract_selected(
    data: bytes,
    target: Path,
    include: Optional[Sequence[str]],
    exclude: Optional[Sequence[str]],
    protect: Optional[Sequence[str]],
    logger: logging.Logger,
) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        files = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        selected = filter_paths_by_patterns(list(files), include=include, exclude=exclude)
        selected += [p for p in files if p in (protect or ()) and p not in selected]
        if not selected:
            logger.warning(f"No files matched include={include} exclude={exclude}; downloading nothing")
            return
        tar.extractall(target, members=[files[p] for p in selected], filter="data")
