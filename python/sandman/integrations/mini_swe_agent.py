"""A mini-swe-agent environment on a Sandman sandbox.

mini-swe-agent (https://github.com/SWE-agent/mini-swe-agent, `pip install mini-swe-agent`) runs
every action of its agent through an *environment*: `execute(action, cwd="", *, timeout=None)`
answering `{"output", "returncode", "exception_info"}`, plus `get_template_vars()`,
`serialize()` and `cleanup()`. `SandmanEnvironment` implements that interface as
`minisweagent.environments.docker.DockerEnvironment` does, with the container replaced by a
sandbox: one sandbox per environment, created on construction, released by `cleanup()`.

In a mini-swe-agent config::

    environment:
      environment_class: sandman.integrations.mini_swe_agent.SandmanEnvironment
      image: host            # any image with the docker or kubernetes provider
      cwd: /testbed
      timeout: 60

or in code::

    env = SandmanEnvironment(image="host", timeout=60)
    agent = DefaultAgent(model, env, **agent_config)
    try:
        agent.run(task)
    finally:
        env.cleanup()
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any, Dict, List, Optional, Tuple

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from .. import ExitStatus, Sandbox, Sandman

__all__ = ["SandmanEnvironment", "SandmanEnvironmentConfig"]


class SandmanEnvironmentConfig(BaseModel):
    image: str = "host"
    """The sandbox's image (`host` on the process provider)."""
    cwd: str = ""
    """Working directory of commands; empty for the sandbox's default."""
    env: Dict[str, str] = {}
    """Environment variables of every command."""
    forward_env: List[str] = []
    """Variables passed on from this process's environment when set (`env` wins)."""
    timeout: int = 30
    """Timeout of one command, in seconds; a command that exceeds it has its tree killed."""
    interpreter: List[str] = ["bash", "-lc"]
    """What runs a command (the command is appended); empty for the sandbox's `/bin/sh -c`."""
    url: Optional[str] = None
    """The Sandman server (default: `$SANDMAN_URL`)."""
    token: Optional[str] = None
    """Its token (default: `$SANDMAN_TOKEN` or the server's token file)."""
    job: Optional[str] = None
    """The job the sandbox counts against (its quota and heartbeat)."""
    resources: Dict[str, Any] = {}
    """`cpu`, `memory`, `disk`, `pids`."""
    profile: Optional[str] = None
    network: Optional[str] = None
    labels: Dict[str, str] = {}
    ttl: Optional[int] = None
    """Longest lifetime of the sandbox, in seconds."""
    lease: Optional[int] = None
    """Lease of the sandbox, in seconds: it is reclaimed after this long without a call."""
    pool: Optional[str] = None


class SandmanEnvironment:
    def __init__(
        self,
        *,
        config_class: type = SandmanEnvironmentConfig,
        logger: Optional[logging.Logger] = None,
        client: Optional[Sandman] = None,
        sandbox: Optional[Sandbox] = None,
        **kwargs: Any,
    ):
        """Creates a sandbox (or adopts `sandbox`) to run the agent's commands in. See
        `SandmanEnvironmentConfig` for the keyword arguments. A given `client` or `sandbox`
        stays the caller's: `cleanup()` releases and closes only what this environment made."""
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._owns_client = client is None
        self._owns_sandbox = sandbox is None
        self.client: Optional[Sandman] = client
        self.sandbox: Optional[Sandbox] = sandbox
        self._uname: Optional[Dict[str, str]] = None
        if self.client is None:
            self.client = sandbox.client if sandbox is not None else Sandman(self.config.url, self.config.token)
            self._owns_client = sandbox is None
        if self.sandbox is None:
            c = self.config
            self.sandbox = self.client.create(
                c.image,
                job=c.job,
                resources=c.resources or None,
                profile=c.profile,
                network=c.network,
                labels=c.labels or None,
                ttl=c.ttl,
                lease=c.lease,
                pool=c.pool,
            )
            self.logger.info(f"Created sandbox {self.sandbox.id}")

    def execute(self, action: Dict[str, Any], cwd: str = "", *, timeout: Optional[int] = None) -> Dict[str, Any]:
        """Runs the action's command in the sandbox; answers its output (stdout and stderr
        interleaved as they came) and return code."""
        command = action.get("command", "")
        timeout = timeout or self.config.timeout
        try:
            text, status = self._run(command, cwd or self.config.cwd or None, timeout)
            if status.timed_out:
                message = f"Command '{command}' timed out after {timeout} seconds"
                output: Dict[str, Any] = {
                    "output": text,
                    "returncode": -1,
                    "exception_info": f"An error occurred while executing the command: {message}",
                    "extra": {"exception_type": "TimeoutExpired", "exception": message},
                }
            else:
                output = {"output": text, "returncode": _returncode(status), "exception_info": ""}
        except Exception as e:
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _run(self, command: str, cwd: Optional[str], timeout: int) -> Tuple[str, ExitStatus]:
        assert self.sandbox is not None, "the sandbox was cleaned up"
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        env.update(self.config.env)
        cmd: Any = [*self.config.interpreter, command] if self.config.interpreter else command
        parts: List[str] = []
        with self.sandbox.exec_stream(cmd, timeout=timeout, env=env or None, cwd=cwd) as stream:
            for event in stream:
                if event.type in ("stdout", "stderr"):
                    parts.append(event.data)
        assert stream.exit is not None
        return "".join(parts), stream.exit

    def _check_finished(self, output: Dict[str, Any]) -> None:
        """Raises `Submitted` when the output says the task is complete (as mini-swe-agent's own
        environments do)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> Dict[str, Any]:
        """The config, the sandbox's `uname` (`system`, `release`, `version`, `machine`), and
        `kwargs`."""
        return recursive_merge(self.config.model_dump(), self._sandbox_uname(), kwargs)

    def _sandbox_uname(self) -> Dict[str, str]:
        if self._uname is None:
            uname = platform.uname()._asdict()
            if self.sandbox is not None:
                try:
                    r = self.sandbox.exec(["uname", "-s", "-n", "-r", "-m"], timeout=10)
                    system, node, release, machine = r.stdout.split()
                    version = self.sandbox.exec(["uname", "-v"], timeout=10).stdout.strip()
                    uname = {
                        "system": system,
                        "node": node,
                        "release": release,
                        "version": version,
                        "machine": machine,
                    }
                except Exception as e:  # an image without uname: describe this machine
                    self.logger.debug(f"uname in the sandbox failed: {e}")
            self._uname = uname
        return self._uname

    def serialize(self) -> Dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json", exclude={"token"}),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                },
                "sandbox": self.sandbox.id if self.sandbox is not None else None,
            }
        }

    def cleanup(self) -> None:
        """Releases the sandbox (when this environment created it) and closes the client (when
        it made it). Safe to call more than once."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None and self._owns_sandbox:
            try:
                sandbox.release()
            except Exception as e:  # the lease reclaims it anyway
                self.logger.warning(f"could not release sandbox {sandbox.id}: {e}")
        client, self.client = self.client, None
        if client is not None and self._owns_client:
            client.close()

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:
            pass


def _returncode(status: ExitStatus) -> int:
    """The command's exit code; `-N` when signal N killed it (as `subprocess` reports it)."""
    if status.exit_code is not None:
        return status.exit_code
    if status.signal is not None:
        return -status.signal
    return -1
