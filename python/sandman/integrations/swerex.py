"""SWE-ReX on a Sandman sandbox: a deployment and a runtime.

SWE-ReX (https://github.com/SWE-agent/SWE-ReX, `pip install swe-rex`) is what SWE-agent runs its
commands through: a *deployment* (`AbstractDeployment`) starts somewhere to run things and hands
out a *runtime* (`AbstractRuntime`) with shell sessions, one-off commands and files.
`SandmanDeployment` creates a sandbox (or adopts one) and `SandmanRuntime` runs everything in it
through the server, with no SWE-ReX server inside the image::

    from sandman.integrations.swerex import SandmanDeployment
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

    deployment = SandmanDeployment(image="python:3.12", lease=600)
    await deployment.start()
    runtime = deployment.runtime
    await runtime.create_session(CreateBashSessionRequest())
    obs = await runtime.run_in_session(BashAction(command="cd /tmp && ls", timeout=30))
    await deployment.stop()

It behaves as SWE-ReX's own runtime (`swerex.runtime.local.LocalRuntime`, which its server runs
inside a container) does, and raises SWE-ReX's exceptions:

- a session is a `bash` on a pseudo-terminal in the sandbox, driven as SWE-ReX drives its
  own (a unique `PS1` to find the end of a command, the exit code echoed afterwards, `bash -n`
  first for `BashIncorrectSyntaxError`), so output is what a terminal shows, interactive programs
  (`python`, `gdb`, pagers) work with `is_interactive_command`/`is_interactive_quit`, and
  `BashInterruptAction` sends Ctrl-C (then Ctrl-Z and `kill -9 %1` when that is not enough);
- a command that runs past its `timeout` raises `CommandTimeoutError` and keeps running in the
  shell, as in SWE-ReX: interrupt it to get the shell back;
- `execute` runs a command to completion (`CommandTimeoutError` after its timeout, its tree
  killed; `NonZeroExitCodeError` with `check`), `merge_output_streams` giving one stream in the
  order written;
- `read_file` of a missing file raises `FileNotFoundError`; relative paths are relative to the
  sandbox's working directory.

The session's shell, its output and its state live in the sandbox, under the process tag
`swerex-<session>`: a runtime made again for the same sandbox finds its sessions there. Every call
opens its HTTP connections in the event loop it is awaited in, so SWE-agent's way of calling
(`asyncio.run(...)` around each call, a fresh loop each time) is safe.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import functools
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Concatenate, Coroutine, Dict, List, Literal, Optional, ParamSpec, Tuple, TypeVar

from pydantic import BaseModel, ConfigDict
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NoExitCodeError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    IsAliveResponse,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from swerex.runtime.local import _split_bash_command, _strip_control_chars

from .. import AsyncSandbox, AsyncSandman, NotFound, Sandman, SandmanError

__all__ = ["SandmanDeployment", "SandmanDeploymentConfig", "SandmanRuntime"]

log = logging.getLogger(__name__)

#: The client of the runtime call being served, with its runtime. Each call of the runtime's
#: methods opens its own client and closes it before it returns: an httpx client's connections
#: belong to the event loop that opened them, and SWE-agent awaits every call in a fresh loop
#: (`asyncio.run`), which would strand a client kept across calls, sockets and all.
_CLIENT: "ContextVar[Optional[Tuple[SandmanRuntime, AsyncSandman]]]" = ContextVar("sandman_swerex_client", default=None)

P = ParamSpec("P")
R = TypeVar("R")


def _serving(
    method: "Callable[Concatenate[SandmanRuntime, P], Coroutine[Any, Any, R]]",
) -> "Callable[Concatenate[SandmanRuntime, P], Coroutine[Any, Any, R]]":
    """Gives a runtime method a client of its own for the call (reused by the calls it makes)."""

    @functools.wraps(method)
    async def serve(self: "SandmanRuntime", /, *args: P.args, **kwargs: P.kwargs) -> R:
        current = _CLIENT.get()
        if current is not None and current[0] is self:
            return await method(self, *args, **kwargs)
        async with AsyncSandman(self._url, self._token, max_connections=8) as client:
            token = _CLIENT.set((self, client))
            try:
                return await method(self, *args, **kwargs)
            finally:
                _CLIENT.reset(token)

    return serve


#: The tag of a session's shell process: `swerex-<session name>`.
TAG_PREFIX = "swerex-"
#: The terminal of a session: pexpect's default size.
PTY_ROWS, PTY_COLS = 24, 80


class SandmanDeploymentConfig(BaseModel):
    """A `SandmanDeployment`'s settings, as SWE-ReX's deployment configs are (`get_deployment()`)."""

    image: str = "host"
    """The sandbox's image (`host` on the process provider)."""
    url: Optional[str] = None
    """The Sandman server (default: `$SANDMAN_URL`)."""
    token: Optional[str] = None
    """Its token (default: `$SANDMAN_TOKEN` or the server's token file)."""
    provider: Optional[str] = None
    job: Optional[str] = None
    resources: Dict[str, Any] = {}
    """`cpu`, `memory`, `disk`, `pids`."""
    profile: Optional[str] = None
    network: Optional[str] = None
    env: Dict[str, str] = {}
    labels: Dict[str, str] = {}
    pool: Optional[str] = None
    lease: int = 600
    """Lease of the sandbox in seconds, renewed by the deployment while it runs."""
    ttl: Optional[int] = None
    startup_timeout: float = 180.0
    """How long creating the sandbox may take, in seconds."""
    sandbox: Optional[str] = None
    """Adopt this existing sandbox instead of creating one (`stop()` then leaves it running)."""

    type: Literal["sandman"] = "sandman"
    """Discriminator, as SWE-ReX's deployment configs have. Do not change."""

    model_config = ConfigDict(extra="forbid")

    def get_deployment(self) -> "SandmanDeployment":
        return SandmanDeployment.from_config(self)


class SandmanDeployment(AbstractDeployment):
    """A SWE-ReX deployment on a Sandman sandbox (see the module's docstring); keyword arguments
    are `SandmanDeploymentConfig`'s fields."""

    def __init__(self, *, logger: Optional[logging.Logger] = None, **kwargs: Any) -> None:
        self._config = SandmanDeploymentConfig(**kwargs)
        self.logger = logger or logging.getLogger("rex-deploy")
        self._runtime: Optional[SandmanRuntime] = None
        self._hooks = CombinedDeploymentHook()
        self._keepalive: Optional[_Ticker] = None
        self._owns_sandbox = self._config.sandbox is None

    @classmethod
    def from_config(cls, config: SandmanDeploymentConfig) -> "SandmanDeployment":
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox_id(self) -> Optional[str]:
        """The sandbox's id, once started."""
        return self._runtime.sandbox_id if self._runtime is not None else None

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """Creates the sandbox (or adopts the configured one) and waits until it answers."""
        if self._runtime is not None:
            return
        c = self._config
        if c.sandbox is not None:
            sandbox_id = c.sandbox
        else:
            self._hooks.on_custom_step("Creating sandbox")
            async with AsyncSandman(c.url, c.token, max_connections=4) as client:
                try:
                    sb = await client.create(
                        c.image,
                        provider=c.provider,
                        job=c.job,
                        resources=c.resources or None,
                        profile=c.profile,
                        network=c.network,
                        env=c.env or None,
                        labels=c.labels or None,
                        pool=c.pool,
                        lease=c.lease,
                        ttl=c.ttl,
                        wait_timeout=max(1, int(c.startup_timeout)),
                    )
                except SandmanError as e:
                    raise DeploymentStartupError(f"could not create a sandbox of {c.image}: {e}") from e
            sandbox_id = sb.id
            self.logger.info(f"Created sandbox {sandbox_id} of {c.image}")
        self._runtime = SandmanRuntime(sandbox=sandbox_id, url=c.url, token=c.token, logger=self.logger)
        alive = await self._runtime.is_alive(timeout=c.startup_timeout)
        if not alive:
            await self.stop()
            raise DeploymentStartupError(f"sandbox {sandbox_id} does not answer: {alive.message}")
        # The lease is renewed from a thread: SWE-agent runs each call in a fresh event loop, so
        # no task of ours could outlive the call that started it.
        self._keepalive = _Ticker(c.lease / 3.0, sandbox_id, c.url, c.token, self.logger)
        self._keepalive.start()

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        """Closes the runtime's sessions and releases the sandbox (one it adopted is left)."""
        if self._keepalive is not None:
            self._keepalive.stop()
            self._keepalive = None
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            return
        try:
            await runtime.close()
        except SandmanError as e:
            self.logger.warning(f"could not close the sessions of sandbox {runtime.sandbox_id}: {e}")
        if self._owns_sandbox:
            async with AsyncSandman(self._config.url, self._config.token, max_connections=4) as client:
                try:
                    await client.release(runtime.sandbox_id)
                except SandmanError as e:  # its lease reclaims it anyway
                    self.logger.warning(f"could not release sandbox {runtime.sandbox_id}: {e}")

    async def is_alive(self, *, timeout: Optional[float] = None) -> IsAliveResponse:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return await self._runtime.is_alive(timeout=timeout)

    @property
    def runtime(self) -> "SandmanRuntime":
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime


class SandmanRuntime(AbstractRuntime):
    """A SWE-ReX runtime on the sandbox `sandbox` of the server at `url` (see the module's
    docstring). Each call opens its own connections and closes them before it returns, so
    it may be awaited from any event loop."""

    def __init__(
        self,
        *,
        sandbox: str,
        url: Optional[str] = None,
        token: Optional[str] = None,
        logger: Optional[logging.Logger] = None,
    ) -> None:
        self.sandbox_id = sandbox
        self._url = url
        self._token = token
        self.logger = logger or logging.getLogger("rex-runtime")
        # What this runtime has read of each session's terminal (see `_Terminal`); the shell
        # itself lives in the sandbox, found by its tag.
        self._terminals: Dict[str, _Terminal] = {}
        self._workdir: Optional[str] = None

    # ---- plumbing ----

    def _sandbox(self) -> AsyncSandbox:
        """The sandbox, through the client of the call being served (see `_serving`)."""
        current = _CLIENT.get()
        if current is None or current[0] is not self:
            raise RuntimeError("SandmanRuntime: a call to the server outside one of the runtime's methods")
        return current[1].sandbox(self.sandbox_id)

    # ---- AbstractRuntime ----

    @_serving
    async def is_alive(self, *, timeout: Optional[float] = None) -> IsAliveResponse:
        """Whether the sandbox is ready and its daemon answers (within `timeout` seconds)."""
        try:
            sb = self._sandbox()
            await asyncio.wait_for(sb.daemon_info(), timeout)
            return IsAliveResponse(is_alive=True)
        except asyncio.TimeoutError:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox_id} did not answer in {timeout} s")
        except SandmanError as e:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox_id}: {e}")

    @_serving
    async def execute(self, command: Command) -> CommandResponse:
        """Runs a command to completion, as `subprocess.run` (`shell=True`: a string for
        `/bin/sh -c`); `env` is added to the sandbox's environment."""
        cmd: Any = command.command
        if command.shell and not isinstance(cmd, str):
            cmd = " ".join(cmd)
        elif not command.shell and isinstance(cmd, str):
            cmd = [cmd]
        r = await self._sandbox().exec(
            cmd,
            timeout=command.timeout,
            env=command.env,
            cwd=command.cwd,
            merge_output=command.merge_output_streams,
        )
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        exit_code = r.exit_code if r.exit_code is not None else -(r.signal or 0)
        response = CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=exit_code)
        if command.check and exit_code != 0:
            msg = (
                f"Command {command.command!r} failed with exit code {exit_code}. "
                f"Stdout:\n{response.stdout!r}\nStderr:\n{response.stderr!r}"
            )
            if command.error_msg:
                msg = f"{command.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return response

    @_serving
    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        path = await self._absolute(request.path)
        try:
            data = await self._sandbox().read_file(path)
        except NotFound as e:
            raise FileNotFoundError(errno.ENOENT, f"No such file or directory: {e.message}", request.path) from e
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    @_serving
    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Writes the file, creating its parent directories."""
        await self._sandbox().write_file(await self._absolute(request.path), request.content)
        return WriteFileResponse()

    @_serving
    async def upload(self, request: UploadRequest) -> UploadResponse:
        """Copies a local file or directory to `target_path` in the sandbox, as `shutil.copy` and
        `copytree` would: a directory's contents become `target_path`; a file becomes
        `target_path`, or goes into it when it is a directory."""
        source = Path(request.source_path).resolve()
        target = await self._absolute(request.target_path)
        sb = self._sandbox()
        if source.is_dir():
            await sb.upload(source, target)
        elif source.is_file():
            try:
                if (await sb.stat(target)).kind == "dir":
                    target = str(PurePosixPath(target) / source.name)
            except NotFound:
                pass
            data = await asyncio.to_thread(source.read_bytes)
            await sb.write_file(target, data, mode=source.stat().st_mode & 0o7777)
        else:
            raise ValueError(f"Source path {source} is not a file or directory")
        return UploadResponse()

    @_serving
    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        """Starts `bash` on a terminal in the sandbox, sources `startup_source`, and sets the
        prompt the runtime finds the end of each command by."""
        sb = self._sandbox()
        tag = TAG_PREFIX + request.session
        try:
            info = await sb.process(tag).status()
        except NotFound:
            info = None
        if info is not None and info.running:
            raise SessionExistsError(f"session {request.session} already exists")
        if info is not None:  # a shell that exited: its tag is free once forgotten
            await sb.process(tag).kill()
        term = _Terminal(self, tag)
        # Echo off before bash starts, as pexpect's `echo=False`: readline then echoes nothing,
        # and the commands sent never show up in the output. What is typed before `stty` ran
        # would be echoed by the terminal itself, so nothing is sent before its marker.
        # TERM=dumb, as SWE-ReX's server has no TERM: no bracketed-paste escapes around prompts.
        process = await sb.start(
            ["/bin/sh", "-c", f"stty -echo 2>/dev/null; echo {_READY}; exec /usr/bin/env bash"],
            tag=tag,
            env={"PS1": _PS1, "PS2": "", "PS0": "", "TERM": "dumb"},
            pty=(PTY_ROWS, PTY_COLS),
        )
        term.process_id = process.id
        self._terminals[request.session] = term
        try:
            await term.expect([_READY + r"\r?\n"], timeout=max(request.startup_timeout, 5.0))
        except CommandTimeoutError as e:
            raise CommandTimeoutError(f"session {request.session} did not start: {e}") from e
        cmds: List[str] = []
        if request.startup_source:
            cmds += [f"source {path}" for path in request.startup_source] + ["sleep 0.3"]
        cmds += [f"export PS1='{_PS1}'", "export PS2=''", "export PS0=''"]
        await term.sendline(" ; ".join(cmds))
        try:
            _, before = await term.expect([_PS1], timeout=max(request.startup_timeout, 5.0))
        except CommandTimeoutError as e:
            raise CommandTimeoutError(f"session {request.session} did not start: {e}") from e
        return CreateBashSessionResponse(output=_strip_control_chars(before))

    @_serving
    async def run_in_session(self, action: Any) -> BashObservation:
        term = await self._terminal(action.session)
        if isinstance(action, BashInterruptAction):
            return await term.interrupt(action)
        if action.is_interactive_command or action.is_interactive_quit:
            return await term.run_interactive(action)
        r = await term.run_normal(action)
        if action.check == "raise" and r.exit_code != 0:
            msg = f"Command {action.command!r} failed with exit code {r.exit_code}. Here is the output:\n{r.output!r}"
            if action.error_msg:
                msg = f"{action.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return r

    @_serving
    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        self._terminals.pop(request.session, None)
        term = await self._terminal(request.session)
        await self._sandbox().process(term.tag).kill()
        self._terminals.pop(request.session, None)
        return CloseBashSessionResponse()

    @_serving
    async def close(self) -> CloseResponse:
        """Ends every session's shell (the sandbox stays; the deployment releases it)."""
        sb = self._sandbox()
        for p in await sb.processes():
            if p.tag and p.tag.startswith(TAG_PREFIX):
                await sb.process(p.id).kill()
        self._terminals.clear()
        return CloseResponse()

    # ---- helpers ----

    async def _terminal(self, session: str) -> "_Terminal":
        """The session's terminal: known here, else found in the sandbox by its tag (a runtime
        made again for the same sandbox reads on from where the output ends now)."""
        term = self._terminals.get(session)
        if term is not None:
            return term
        tag = TAG_PREFIX + session
        try:
            info = await self._sandbox().process(tag).status()
        except NotFound:
            info = None
        if info is None or not info.running:
            raise SessionDoesNotExistError(f"session {session!r} does not exist")
        term = _Terminal(self, tag, process_id=info.id, offset=info.stdout_bytes)
        self._terminals[session] = term
        return term

    async def _absolute(self, path: str) -> str:
        """`path`, relative ones taken from the sandbox's working directory (as SWE-ReX's own
        runtime takes them from its server's)."""
        if path.startswith("/"):
            return path
        if self._workdir is None:
            r = await self._sandbox().exec(["pwd"], timeout=30)
            self._workdir = r.stdout.strip() or "/"
        return str(PurePosixPath(self._workdir) / path)


# ---- a session's terminal, driven as pexpect drives SWE-ReX's own ----

#: The prompt (SWE-ReX's `BashSession._ps1`): the end of every command's output.
_PS1 = "SHELLPS1PREFIX"
_UNIQUE_STRING = "UNIQUESTRING29234"
#: What a session's terminal prints once its echo is off, before bash starts.
_READY = "SANDMANSHELLREADY"
#: How long an answer the shell gives at once (the exit code echoed, the prompt after it) may
#: take to arrive. SWE-ReX's own runtime, reading its terminal in the same machine, waits 0.1 to
#: 1 s; here the output crosses the server and the daemon, on a machine that may be loaded.
_FOLLOW_UP_TIMEOUT = 10.0


@dataclass
class _Terminal:
    """What the runtime has read of one session's terminal: `buffer` holds what arrived and
    no `expect` has consumed yet (as pexpect's buffer does), `offset` the byte offset in the
    terminal's output where the next read starts."""

    runtime: SandmanRuntime
    tag: str
    process_id: str = ""
    offset: int = 0
    buffer: str = ""
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("rex-session"))

    def _process(self) -> Any:
        return self.runtime._sandbox().process(self.tag)

    async def send(self, text: str) -> None:
        try:
            await self._process().write_stdin(text)
        except NotFound:
            self.runtime._terminals.pop(self.session, None)
            raise SessionDoesNotExistError(f"session {self.session!r} does not exist") from None

    @property
    def session(self) -> str:
        return self.tag[len(TAG_PREFIX) :]

    async def sendline(self, line: str) -> None:
        await self.send(line + "\n")

    async def expect(self, patterns: List[str], timeout: Optional[float]) -> Tuple[int, str]:
        """Waits until one of `patterns` (regular expressions, as pexpect takes them) shows up in
        the output; answers its index and the output before it, and keeps what follows it for
        the next `expect`. The earliest match wins, then the first pattern. Raises
        `CommandTimeoutError` after `timeout` seconds (None: no limit)."""
        compiled = [re.compile(p, re.DOTALL) for p in patterns]
        found = _first_match(compiled, self.buffer)
        if found is None:
            state = await self._read(lambda: _first_match(compiled, self.buffer) is not None, timeout)
            if state == "exited":
                raise SessionDoesNotExistError(f"the shell of session {self.session!r} has exited")
            if state == "timeout":
                raise CommandTimeoutError(f"timeout after {timeout} seconds")
            found = _first_match(compiled, self.buffer)
            assert found is not None
        index, m = found
        before, self.buffer = self.buffer[: m.start()], self.buffer[m.end() :]
        return index, before

    async def _read(self, done: Callable[[], bool], timeout: Optional[float]) -> str:
        """Follows the terminal's output into the buffer, on one stream, until `done()` holds
        (`done`), `timeout` seconds pass (`timeout`; None: no limit) or the shell exits
        (`exited`)."""
        stream = self._process().follow(offset=self.offset)

        async def pump() -> str:
            async for ev in stream:
                if ev.type == "data" and ev.data:
                    self.buffer += ev.data
                    # Where the event's bytes end (bytes that are not UTF-8 arrive as U+FFFD,
                    # whose length is not theirs): the next read starts there.
                    self.offset = ev.next_offset
                    if done():
                        return "done"
                elif ev.type == "dropped":
                    self.offset = ev.offset + ev.bytes
            return "exited"

        try:
            return await asyncio.wait_for(pump(), timeout)
        except asyncio.TimeoutError:
            return "timeout"
        except NotFound:
            return "exited"
        finally:
            await stream.aclose()

    async def _eat(self, seconds: float) -> str:
        """What arrives in the next `seconds`, consumed (SWE-ReX's `_eat_following_output`)."""
        await self._read(lambda: False, seconds)
        out, self.buffer = self.buffer, ""
        return _strip_control_chars(out)

    async def interrupt(self, action: BashInterruptAction) -> BashObservation:
        """Ctrl-C until the prompt comes back (`n_retry` times), else Ctrl-Z and `kill -9 %1`."""
        output = ""
        expect_strings = action.expect + [_PS1]
        for _ in range(action.n_retry):
            await self.send("\x03")
            try:
                index, before = await self.expect(expect_strings, timeout=action.timeout)
            except CommandTimeoutError:
                await asyncio.sleep(0.2)
                continue
            output += _strip_control_chars(before)
            output += await self._eat(0.5)
            return BashObservation(output=output.strip(), exit_code=0, expect_string=expect_strings[index])
        try:
            await self.send("\x1a")
            _, before = await self.expect(expect_strings, timeout=action.timeout)
            output += before
            await self.sendline("kill -9 %1")
            index, before = await self.expect(expect_strings, timeout=action.timeout)
            output += before
            output += await self._eat(0.5)
            return BashObservation(output=output.strip(), exit_code=0, expect_string=expect_strings[index])
        except CommandTimeoutError as e:
            raise CommandTimeoutError("Failed to interrupt session") from e

    async def run_interactive(self, action: BashAction) -> BashObservation:
        """A line for an interactive program (no prompt sought, no exit code)."""
        await self.sendline(action.command)
        expect_strings = action.expect + [_PS1]
        try:
            index, before = await self.expect(expect_strings, timeout=action.timeout)
        except CommandTimeoutError as e:
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command {action.command!r}"
            ) from e
        output = _strip_control_chars(before)
        if action.is_interactive_quit:
            assert not action.is_interactive_command
            await self.sendline(f"stty -echo; echo '{_UNIQUE_STRING}'")
            await self.expect([_UNIQUE_STRING], timeout=_FOLLOW_UP_TIMEOUT)
            await self.expect([_PS1], timeout=_FOLLOW_UP_TIMEOUT)
        else:
            output = output.lstrip().removeprefix(action.command).strip()
        return BashObservation(output=output, exit_code=0, expect_string=expect_strings[index])

    async def run_normal(self, action: BashAction) -> BashObservation:
        """A command to completion: checked by `bash -n`, sent, then its exit code asked for."""
        command = action.command
        await self._check_syntax(command)
        fallback_terminator = False
        try:
            individual_commands = _split_bash_command(command)
        except Exception as e:  # bashlex fails in many ways; SWE-ReX falls back the same way
            self.logger.error("Bashlex fail: %s", e)
            command += f"\n TMPEXITCODE=$? ; sleep 0.1; echo -n '{_UNIQUE_STRING}' ; (exit $TMPEXITCODE)"
            fallback_terminator = True
        else:
            command = " ; ".join(individual_commands)
        await self.sendline(command)
        expect_strings = action.expect + [_PS1] if not fallback_terminator else [_UNIQUE_STRING]
        try:
            index, before = await self.expect(expect_strings, timeout=action.timeout)
        except CommandTimeoutError as e:
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command {command!r}"
            ) from e
        matched = expect_strings[index]
        output = _strip_control_chars(before)
        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None, expect_string=matched)
        try:
            prefix, suffix = "EXITCODESTART", "EXITCODEEND"
            await self.sendline(f"\necho {prefix}$?{suffix}")
            try:
                _, raw = await self.expect([suffix], timeout=_FOLLOW_UP_TIMEOUT)
            except CommandTimeoutError:
                raise NoExitCodeError("timeout while getting exit code") from None
            exit_code_raw = _strip_control_chars(raw)
            codes = re.findall(f"{prefix}([0-9]+)", exit_code_raw)
            if len(codes) != 1:
                raise NoExitCodeError(
                    f"failed to parse exit code from output {exit_code_raw!r} (command: {command!r}, matches: {codes})"
                )
            output += exit_code_raw.split(prefix)[0]
            exit_code: Optional[int] = int(codes[0])
            try:
                await self.expect([_PS1], timeout=_FOLLOW_UP_TIMEOUT)
            except CommandTimeoutError:
                raise CommandTimeoutError("Timeout while getting PS1 after exit code extraction") from None
            output = output.replace(_UNIQUE_STRING, "").replace(_PS1, "")
        except Exception:
            if action.check == "raise":
                raise
            exit_code = None
        return BashObservation(output=output, exit_code=exit_code, expect_string=matched)

    async def _check_syntax(self, command: str) -> None:
        """`bash -n` of the command in the sandbox, as SWE-ReX checks it on its server."""
        eof = "SOUNIQUEEOF"
        r = await self.runtime._sandbox().exec(f"/usr/bin/env bash -n << '{eof}'\n{command}\n{eof}", timeout=30)
        if r.exit_code == 0:
            return
        msg = (
            f"Error (exit code {r.exit_code}) while checking bash command \n{command!r}\n"
            f"---- Stderr ----\n{r.stderr}\n---- Stdout ----\n{r.stdout}"
        )
        raise BashIncorrectSyntaxError(msg, extra_info={"bash_stdout": r.stdout, "bash_stderr": r.stderr})


def _first_match(patterns: List["re.Pattern[str]"], text: str) -> Optional[Tuple[int, "re.Match[str]"]]:
    best: Optional[Tuple[int, "re.Match[str]"]] = None
    for i, p in enumerate(patterns):
        m = p.search(text)
        if m is not None and (best is None or m.start() < best[1].start()):
            best = (i, m)
    return best


class _Ticker:
    """Renews a sandbox's lease every `interval` seconds from a daemon thread, until stopped."""

    def __init__(
        self, interval: float, sandbox_id: str, url: Optional[str], token: Optional[str], logger: logging.Logger
    ) -> None:
        self._interval = max(1.0, interval)
        self._sandbox_id = sandbox_id
        self._url, self._token = url, token
        self._logger = logger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sandman keepalive {sandbox_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with Sandman(self._url, self._token, max_connections=1) as client:
            while not self._stop.wait(self._interval):
                try:
                    client.keepalive(self._sandbox_id)
                except SandmanError as e:
                    self._logger.warning(f"could not renew the lease of sandbox {self._sandbox_id}: {e}")
