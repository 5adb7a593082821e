"""Our conftest for SWE-ReX's own `tests/test_execution.py` (from the swe-rex sdist; see
`scripts/test-harnesses swe-rex`): its `remote_runtime` fixture is a `SandmanRuntime` on a fresh
sandbox of a real `sandman serve` (the process provider), instead of SWE-ReX's own server.

The suite writes files through the runtime and reads them on this machine (and the other way
round) under pytest's `tmp_path`, as SWE-ReX's own runtime, which runs on the test machine,
allows. An isolated sandbox writes into a root of its own, so this suite's server runs with
`--isolation none`: its sandboxes share this machine's file system, as SWE-ReX's runtime does
(the script gives pytest a `--basetemp` outside `/tmp`, which a sandbox still has of its own).
What the adapter does is the same either way; `python/tests/test_swerex.py` runs it in isolated
sandboxes, and the attack suite (`crates/cli/tests/attack_isolation.rs`) checks the isolation.

One test (`test_server_dead`) points SWE-ReX's own client at a host name on the internet to see
it fail; the tests send nothing off this machine, so name lookups of anything but local names
fail here at once, as they would for a host that does not exist.
"""

from __future__ import annotations

import socket
from typing import Any, AsyncIterator, Iterator, List, Optional

import pytest
from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, Command, CreateBashSessionRequest

# python/harness, on PYTHONPATH (the script puts it there: this file runs from a copy).
from sandman_server import Server, serve

from sandman.integrations.swerex import SandmanDeployment, SandmanRuntime

_LOCAL = {"localhost", "127.0.0.1", "::1", "", None}
_getaddrinfo = socket.getaddrinfo


def _local_only(host: Any, *args: Any, **kwargs: Any) -> Any:
    name = host.decode() if isinstance(host, bytes) else host
    if name not in _LOCAL and not str(name).startswith("127."):
        raise socket.gaierror(socket.EAI_NONAME, f"{name}: name lookups off this machine are refused in tests")
    return _getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True)
def _no_lookups_off_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", _local_only)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    yield from serve("swe-rex", ["--isolation", "none"])


@pytest.fixture
async def remote_runtime(server: Server) -> AsyncIterator[SandmanRuntime]:
    """A `SandmanRuntime` on a sandbox of its own, made and released by a `SandmanDeployment`."""
    deployment = SandmanDeployment(url=server.url, token=server.token, lease=120, labels={"suite": "swe-rex"})
    await deployment.start()
    try:
        yield deployment.runtime
    finally:
        await deployment.stop()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: SandmanRuntime) -> AsyncIterator[SandmanRuntime]:
    await remote_runtime.create_session(CreateBashSessionRequest())
    yield remote_runtime
    await remote_runtime.close_session(CloseBashSessionRequest())


class _Action(BashAction):
    timeout: Optional[float] = 5


class _Command(Command):
    timeout: Optional[float] = 5


#: Upstream tests whose outcome turns on a race in bash itself, not on the runtime; each has a
#: counterpart in `test_sandman_swerex.py` that checks what does not turn on the race.
_RACY_UPSTREAM = {
    # After `kill -9 %1`, bash prints the job's "Killed" notice before its next prompt when the
    # pager is reaped before that prompt is printed, else before the prompt after the next
    # command; the test expects the latter. On a loaded machine either comes first (about one
    # run in ten here).
    "test_interrupt_pager": "bash prints the pager's `Killed` notice with the interrupt or with the next command, "
    "whichever the scheduler lets come first; see test_sandman_swerex.py::test_interrupt_pager_gives_the_shell_back",
}


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        reason = _RACY_UPSTREAM.get(item.name)
        if reason is not None and item.path.name == "test_execution.py":
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))
