"""Deterministic counterparts of SWE-ReX's upstream tests that `conftest.py` marks as racy: the
same behaviour checked without depending on which of two bash outputs the scheduler lets come
first. Copied next to SWE-ReX's `tests/test_execution.py` by `scripts/test-harnesses`."""

from __future__ import annotations

import pytest
from swerex.exceptions import CommandTimeoutError
from swerex.runtime.abstract import BashInterruptAction

from .conftest import _Action as A


async def test_interrupt_pager_gives_the_shell_back(runtime_with_default_session):
    runtime = runtime_with_default_session
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(A(command="echo 'blargh'|less -+F", timeout=0.1))
    # less ignores Ctrl-C: the interrupt falls back to Ctrl-Z (bash reports the job stopped) and
    # `kill -9 %1`. Whether bash's `Killed` notice comes with the interrupt or with a later
    # command is bash's timing, so it is not asserted here.
    interrupted = await runtime.run_in_session(BashInterruptAction())
    r = await runtime.run_in_session(A(command="echo 'asdf'", check="raise"))
    assert "asdf" in r.output
    # The interrupt gave the shell back, at its prompt.
    assert interrupted.expect_string == "SHELLPS1PREFIX", interrupted
