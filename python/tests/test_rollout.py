"""The rollout example (`examples/rollout.py`) at full size: 200 concurrent episodes, every one
rewarded 0 then 1, and every sandbox released by its episode at the end."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from conftest import REPO, Server, unique

from sandman import Sandman


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rollout_example", REPO / "examples" / "rollout.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rollout_example"] = module
    spec.loader.exec_module(module)
    return module


# The interpreter that runs each episode's test in its sandbox: the system's, which an isolated
# sandbox can run (one under a user's home, as a version manager installs it, is out of its
# reach), else this one by its real path (a version manager's shim costs more than an episode).
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(sys.executable)


def _check_all_released(server: Server, job: str, ids: list) -> None:
    with Sandman(server.url, server.token) as c:
        of_job = {s.id: s for s in c.list(job=job)}
        assert sorted(of_job) == sorted(ids)
        assert {(s.state, s.reason) for s in of_job.values()} == {("gone", "released")}
        assert [s.id for s in c.list() if s.live] == []  # the server holds no live sandbox at all


def test_200_concurrent_episodes(server: Server, capsys: object) -> None:
    rollout = _example()
    summary = rollout.run(200, url=server.url, token=server.token, python=PYTHON, job=unique("rollout"))
    report = summary.report()
    print("\n" + report)
    assert summary.failures == []
    assert len(summary.episodes) == 200
    assert all(e.rewards == [0, 1] for e in summary.episodes)
    assert "episodes/s" in report and "p99" in report
    _check_all_released(server, summary.job, summary.sandbox_ids)


def test_episodes_from_threads_with_the_sync_client(server: Server) -> None:
    rollout = _example()
    summary = rollout.run(
        40, 20, url=server.url, token=server.token, python=PYTHON, threads=True, job=unique("threads")
    )
    assert summary.failures == [] and len(summary.episodes) == 40
    _check_all_released(server, summary.job, summary.sandbox_ids)


def test_the_example_runs_as_a_script(server: Server, capsys: object) -> None:
    rollout = _example()
    code = rollout.main(["-n", "3", "--url", server.url, "--token", server.token, "--python", PYTHON])
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert code == 0, out
    assert "3 episodes (3 rewarded 0 then 1, 0 failed)" in out
