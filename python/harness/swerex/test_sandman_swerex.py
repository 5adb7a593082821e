"""Deterministic counterparts of SWE-ReX's upstream tests that `conftest.py` marks as racy: the
same behaviour checked without depending on which of two bash outputs the scheduler lets come
first. Copied next to SWE-ReX's `tests/test_execution.py` by `scripts/test-harnesses`."""

from __future__ import annotations

import pytest
from swerex.exceptions import CommandTimeoutError
from swerex.runtime.abstract import BashInterruptAction

from .conftest import _Action as A


async def test_interrupt_pager_kills_it(runtime_with_default_session):
    runtime = runtime_with_default_session
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(A(command="echo 'blargh'|less -+F", timeout=0.1))
    # less ignores Ctrl-C: the interrupt falls back to Ctrl-Z and `kill -9 %1`.
    interrupted = await runtime.run_in_session(BashInterruptAction())
    r = await runtime.run_in_session(A(command="echo 'asdf'", check="raise"))
    assert "asdf" in r.output
    # bash's notice of the killed job comes with the interrupt, with the next command, or (when
    # the prompt after `kill` was matched before the kill took effect) with a later one: `jobs`
    # reports a job that ended unreported, then forgets it.
    seen = interrupted.output + r.output
    for _ in range(10):
        jobs = await runtime.run_in_session(A(command="jobs; echo end", check="raise"))
        seen += jobs.output
        if jobs.output.strip() == "end" and "killed" in seen.lower():
            break
    assert "killed" in seen.lower(), seen
    # The shell is back and no job is left.
    assert jobs.output.strip() == "end", jobs.output
