"""`check_determinism` against a real server, with both clients (the `api` fixture): a command run
in fresh sandboxes is flagged when its output varies, agrees when it does not, and leaves no
sandbox behind, also when a run fails or the caller is cancelled."""

from __future__ import annotations

import asyncio
from typing import Any, List

import pytest
from conftest import unique

import sandman
from sandman import AsyncSandman, DeterminismResult, ExecResult, Usage
from sandman._async import _rt


async def live_labelled(api: Any, label: str) -> List[str]:
    return [s.id for s in await api.list(label=label) if s.live]


async def check_all_released(api: Any, label: str, result: DeterminismResult) -> None:
    """Each run had a sandbox of its own, carrying the caller's label, and each was released."""
    made = await api.list(label=label)
    assert sorted(s.id for s in made) == sorted(r.sandbox for r in result.runs)
    assert len({r.sandbox for r in result.runs}) == len(result.runs)
    assert [(s.state, s.reason) for s in made] == [("gone", "released")] * len(made)


async def test_a_clock_is_flagged(api: Any) -> None:
    label = unique("det-clock")
    result = await api.check_determinism("host", "date +%s%N", runs=3, labels={"test": label}, lease=60)
    assert not result.agree
    assert result.differs_in == ["stdout"]
    assert result.distinct == 3 and [r.result for r in result.runs] == [0, 1, 2]
    assert all(r.exit_code == 0 and not r.timed_out and r.stdout_bytes > 10 for r in result.runs)
    assert [r.stdout for r in result.results] and len({r.stdout for r in result.results}) == 3
    await check_all_released(api, f"test={label}", result)


async def test_randomness_is_flagged_with_runs_in_parallel(api: Any) -> None:
    label = unique("det-random")
    result = await api.check_determinism(
        "host", "head -c 16 /dev/urandom | od -An -tx1", runs=4, parallel=4, labels={"test": label}, lease=60
    )
    assert not result.agree
    assert result.differs_in == ["stdout"] and result.distinct == 4
    assert len(result.runs) == 4
    await check_all_released(api, f"test={label}", result)


async def test_a_pure_command_agrees(api: Any) -> None:
    label = unique("det-pure")
    result = await api.check_determinism("host", "echo $((6*7))", runs=3, parallel=2, labels={"test": label})
    assert result.agree, result
    assert (result.distinct, result.differs_in) == (1, [])
    assert [r.result for r in result.runs] == [0, 0, 0]
    assert result.results[0].stdout == "42\n" and result.results[0].exit_code == 0
    assert all(r.stdout_bytes == 3 and r.stderr_bytes == 0 and r.duration_ms >= 0 for r in result.runs)
    await check_all_released(api, f"test={label}", result)


async def test_create_options_reach_every_sandbox(api: Any) -> None:
    label = unique("det-env")
    result = await api.check_determinism(
        "host", "echo $ANSWER; cat /tmp/setup", runs=2, env={"ANSWER": "42"}, setup=["echo ready > /tmp/setup"],
        labels={"test": label},
    )
    assert result.agree and result.results[0].stdout == "42\nready\n"
    await check_all_released(api, f"test={label}", result)


async def test_fewer_than_two_runs_are_refused_before_anything_is_made(api: Any) -> None:
    label = unique("det-one")
    for runs in (1, 0, -3):
        with pytest.raises(ValueError, match="at least 2"):
            await api.check_determinism("host", "true", runs=runs, labels={"test": label})
    assert await api.list(label=f"test={label}") == []


async def test_a_failing_run_is_raised_and_leaves_no_sandbox(api: Any) -> None:
    label = unique("det-fail")
    with pytest.raises(sandman.InvalidArgument) as e:
        await api.check_determinism("host", "true", runs=3, parallel=2, setup=["exit 3"], labels={"test": label})
    assert e.value.reason == "setup_failed"
    assert await live_labelled(api, f"test={label}") == []


async def test_a_cancelled_check_releases_its_sandboxes(aclient: AsyncSandman) -> None:
    label = unique("det-cancel")
    check = asyncio.ensure_future(
        aclient.check_determinism("host", "sleep 600", runs=4, parallel=2, labels={"test": label}, lease=600)
    )
    # Wait until both parallel runs have their sandbox and run the command.
    while len(await live_labelled(aclient, f"test={label}")) < 2:
        assert not check.done(), check
        await asyncio.sleep(0.05)
    check.cancel()
    with pytest.raises(asyncio.CancelledError):
        await check
    made = await aclient.list(label=f"test={label}")
    assert len(made) == 2
    assert [(s.state, s.reason) for s in made] == [("gone", "released")] * 2


async def test_a_cancelled_create_is_finished_then_undone() -> None:
    started, go = asyncio.Event(), asyncio.Event()
    undone: List[str] = []

    async def make() -> str:
        started.set()
        await go.wait()
        return "sb-1"

    async def undo(made: str) -> None:
        undone.append(made)

    call = asyncio.ensure_future(_rt.finish(make, undo))
    await started.wait()
    call.cancel()
    await asyncio.sleep(0)
    assert undone == [] and not call.done()  # it waits for `make` to end
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert undone == ["sb-1"]


def test_the_verdict_names_what_differs() -> None:
    def r(code: int, out: str, err: str = "") -> ExecResult:
        return ExecResult(exit_code=code, stdout=out, stderr=err, duration_ms=5, usage=Usage(3, 4, 1000))

    same = DeterminismResult.judge([("a", r(0, "x")), ("b", r(0, "x"))])
    assert (same.agree, same.distinct, same.differs_in) == (True, 1, [])
    assert (same.runs[0].cpu_ms, same.runs[0].max_rss_kib, same.runs[0].duration_ms) == (7, 1000, 5)
    varied = DeterminismResult.judge([("a", r(0, "1")), ("b", r(0, "2")), ("c", r(0, "1"))])
    assert (varied.agree, varied.distinct, varied.differs_in) == (False, 2, ["stdout"])
    assert [run.result for run in varied.runs] == [0, 1, 0]
    assert [x.stdout for x in varied.results] == ["1", "2"]
    exits = DeterminismResult.judge([("a", r(0, "x")), ("b", r(1, "x", "boom"))])
    assert exits.differs_in == ["exit", "stderr"]
    timed_out = ExecResult(exit_code=None, stdout="x", stderr="", signal=9, timed_out=True)
    assert DeterminismResult.judge([("a", r(0, "x")), ("b", timed_out)]).differs_in == ["exit"]

