"""SWE-ReX's deployment and runtime on Sandman, beyond SWE-ReX's own suite (which
`scripts/test-harnesses swe-rex` runs): called as SWE-agent calls them (a fresh event loop per
call), sessions found again by a new runtime, the deployment's lifecycle and lease, and the
exceptions SWE-ReX defines."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Server, unique

if sys.version_info < (3, 10):  # the only reason to skip: swe-rex needs Python 3.10+
    pytest.skip("swe-rex needs Python 3.10+", allow_module_level=True)

from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from sandman import Sandman  # noqa: E402
from sandman.integrations.swerex import SandmanDeployment, SandmanDeploymentConfig, SandmanRuntime  # noqa: E402


@pytest.fixture
def deployment(server: Server) -> Iterator[SandmanDeployment]:
    d = SandmanDeployment(url=server.url, token=server.token, lease=60, labels={"t": "swerex"})
    asyncio.run(d.start())
    try:
        yield d
    finally:
        asyncio.run(d.stop())


def run(action: Any, rt: SandmanRuntime) -> Any:
    """One call in a fresh event loop, as SWE-agent makes every call."""
    return asyncio.run(rt.run_in_session(action))


def test_every_call_in_a_fresh_event_loop_keeps_the_session(deployment: SandmanDeployment) -> None:
    rt = deployment.runtime
    asyncio.run(rt.create_session(CreateBashSessionRequest()))
    run(BashAction(command="mkdir -p /tmp/w && cd /tmp/w && export GREETING=hi", timeout=10), rt)
    obs = run(BashAction(command="pwd; echo $GREETING; echo err >&2", timeout=10), rt)
    # what a terminal shows: stderr interleaved with stdout
    assert (obs.output, obs.exit_code) == ("/tmp/w\nhi\nerr\n", 0)
    r = asyncio.run(rt.execute(Command(command="echo $0; pwd", shell=True, cwd="/tmp/w")))
    assert r.stdout == "/bin/sh\n/tmp/w\n"
    asyncio.run(rt.close_session(CloseBashSessionRequest()))


def open_sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # closed meanwhile (listdir's own fd, another thread's)
            pass
    return n


def test_calls_in_fresh_event_loops_leave_no_connection_open(deployment: SandmanDeployment) -> None:
    """Regression: a client kept across SWE-agent's per-call event loops stranded one socket per
    call (each loop's connections can only be closed in that loop)."""
    rt = deployment.runtime
    asyncio.run(rt.execute(Command(command=["true"])))
    before = open_sockets()
    for _ in range(50):
        asyncio.run(rt.execute(Command(command=["true"])))
    assert open_sockets() - before < 5


def test_a_timed_out_command_keeps_running_until_interrupted_and_the_shell_stays(
    deployment: SandmanDeployment,
) -> None:
    rt = deployment.runtime
    asyncio.run(rt.create_session(CreateBashSessionRequest()))
    run(BashAction(command="cd /tmp && X=kept", timeout=10), rt)
    with pytest.raises(CommandTimeoutError):
        run(BashAction(command="sleep 30", timeout=0.5), rt)
    run(BashInterruptAction(), rt)
    obs = run(BashAction(command="echo $X; pwd", timeout=10), rt)
    assert obs.output == "kept\n/tmp\n"


def test_a_new_runtime_finds_the_sessions_of_its_sandbox(deployment: SandmanDeployment, server: Server) -> None:
    rt = deployment.runtime
    asyncio.run(rt.create_session(CreateBashSessionRequest(session="s1")))
    run(BashAction(command="Y=from-the-first-runtime", session="s1", timeout=10), rt)
    again = SandmanRuntime(sandbox=rt.sandbox_id, url=server.url, token=server.token)
    obs = run(BashAction(command="echo $Y", session="s1", timeout=10), again)
    assert obs.output == "from-the-first-runtime\n"
    with pytest.raises(SessionExistsError):
        asyncio.run(again.create_session(CreateBashSessionRequest(session="s1")))
    asyncio.run(again.close_session(CloseBashSessionRequest(session="s1")))
    with pytest.raises(SessionDoesNotExistError):
        run(BashAction(command="true", session="s1", timeout=10), rt)


def test_swe_rex_exceptions(deployment: SandmanDeployment) -> None:
    rt = deployment.runtime
    asyncio.run(rt.create_session(CreateBashSessionRequest()))
    with pytest.raises(BashIncorrectSyntaxError) as syntax:
        run(BashAction(command="if then fi", timeout=10), rt)
    assert "syntax error" in syntax.value.extra_info["bash_stderr"]
    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        run(BashAction(command="(exit 3)", timeout=10), rt)
    assert run(BashAction(command="(exit 3)", check="silent", timeout=10), rt).exit_code == 3
    with pytest.raises(NonZeroExitCodeError, match="failed with exit code 1"):
        asyncio.run(rt.execute(Command(command=["false"], check=True)))
    with pytest.raises(CommandTimeoutError):
        asyncio.run(rt.execute(Command(command=["sleep", "30"], timeout=0.3)))
    with pytest.raises(FileNotFoundError):
        asyncio.run(rt.read_file(ReadFileRequest(path="/tmp/does-not-exist")))


def test_execute_env_cwd_signal_and_merged_streams(deployment: SandmanDeployment) -> None:
    rt = deployment.runtime
    r = asyncio.run(rt.execute(Command(command='echo "$V"; pwd', shell=True, env={"V": "set"}, cwd="/tmp")))
    assert (r.stdout, r.stderr, r.exit_code) == ("set\n/tmp\n", "", 0)
    r = asyncio.run(rt.execute(Command(command=["sh", "-c", "kill -9 $$"])))
    assert r.exit_code == -9
    r = asyncio.run(
        rt.execute(
            Command(command=["sh", "-c", "for i in 1 2 3; do echo o$i; echo e$i >&2; done"], merge_output_streams=True)
        )
    )
    assert (r.stdout, r.stderr) == ("o1\ne1\no2\ne2\no3\ne3\n", "")


def test_files_and_uploads(deployment: SandmanDeployment, tmp_path: Path) -> None:
    rt = deployment.runtime
    asyncio.run(rt.write_file(WriteFileRequest(path="/tmp/a/b/c.txt", content="héllo")))
    assert asyncio.run(rt.read_file(ReadFileRequest(path="/tmp/a/b/c.txt"))).content == "héllo"
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    asyncio.run(rt.upload(UploadRequest(source_path=str(script), target_path="/tmp/a")))  # into a directory
    assert asyncio.run(rt.execute(Command(command=["/tmp/a/run.sh"]))).stdout == "ran\n"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("f")
    asyncio.run(rt.upload(UploadRequest(source_path=str(tree), target_path="/tmp/copied")))
    assert asyncio.run(rt.read_file(ReadFileRequest(path="/tmp/copied/sub/f"))).content == "f"
    # relative paths are the sandbox's working directory's
    asyncio.run(rt.write_file(WriteFileRequest(path="rel.txt", content="r")))
    pwd = asyncio.run(rt.execute(Command(command=["pwd"]))).stdout.strip()
    assert asyncio.run(rt.read_file(ReadFileRequest(path=f"{pwd}/rel.txt"))).content == "r"


def test_the_deployment_creates_renews_and_releases_its_sandbox(server: Server) -> None:
    d = SandmanDeploymentConfig(url=server.url, token=server.token, lease=3, job=unique("rex")).get_deployment()
    with pytest.raises(DeploymentNotStartedError):
        d.runtime
    asyncio.run(d.start())
    sandbox = d.sandbox_id
    assert sandbox is not None and asyncio.run(d.is_alive())
    with Sandman(server.url, server.token) as c:
        first = c.get(sandbox).lease_expires_at_ms
        assert first is not None
        # the deployment renews the lease by itself (every lease/3, at least 1 s)
        deadline = time.monotonic() + 15
        while (c.get(sandbox).lease_expires_at_ms or 0) <= first:
            assert time.monotonic() < deadline, "the lease was not renewed"
            time.sleep(0.2)
        asyncio.run(d.stop())
        assert c.get(sandbox).reason == "released"
    with pytest.raises(DeploymentNotStartedError):
        asyncio.run(d.is_alive())


def test_an_adopted_sandbox_is_left_running(server: Server) -> None:
    with Sandman(server.url, server.token) as c, c.create(lease=60) as sb:
        d = SandmanDeployment(url=server.url, token=server.token, sandbox=sb.id)
        asyncio.run(d.start())
        assert asyncio.run(d.runtime.execute(Command(command=["echo", "adopted"]))).stdout == "adopted\n"
        asyncio.run(d.stop())
        assert sb.exec("true").ok


def test_the_example_script_drives_a_session(server: Server, capsys: Any) -> None:
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("swerex_example", REPO / "examples" / "swerex_session.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--url", server.url, "--token", server.token]) == 0
    out = capsys.readouterr().out
    assert "/tmp/demo\nstep 1\n" in out and "[exit 2]" in out and "timed out:" in out
    assert "$ print(6 * 7)\n42\n" in out and out.endswith("written by the runtime\nwritten by the runtime\nLinux\n")
    sandbox = out.split("sandbox ")[1].split()[0]
    with Sandman(server.url, server.token) as c:
        assert c.get(sandbox).reason == "released"
