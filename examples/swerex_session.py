#!/usr/bin/env python3
"""SWE-ReX on Sandman: a `SandmanDeployment` makes a sandbox, and its runtime drives a bash
session there as SWE-agent would: commands whose state (cwd, variables) carries over, a command
that times out and is interrupted, an interactive Python, a file written and read back.

    pip install './python[swe-rex]'
    sandman serve &                                  # the process provider: image `host`
    python examples/swerex_session.py
    python examples/swerex_session.py --image python:3.12   # with the docker provider

Each call runs in a fresh event loop (`asyncio.run`), as SWE-agent makes its calls.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Optional, Sequence

from swerex.exceptions import CommandTimeoutError
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    WriteFileRequest,
)

from sandman.integrations.swerex import SandmanDeployment


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="a SWE-ReX session in a Sandman sandbox")
    p.add_argument("--image", default="host", help="the sandbox's image (default: host, the process provider's)")
    p.add_argument("--url", default=None, help="server URL (default: $SANDMAN_URL)")
    p.add_argument("--token", default=None, help="server token (default: $SANDMAN_TOKEN or the token file)")
    args = p.parse_args(argv)

    deployment = SandmanDeployment(image=args.image, url=args.url, token=args.token, lease=120)
    asyncio.run(deployment.start())
    rt = deployment.runtime
    print(f"sandbox {deployment.sandbox_id}")

    def run(action: Any) -> Any:
        obs = asyncio.run(rt.run_in_session(action))
        shown = action.command if isinstance(action, BashAction) else "<interrupt>"
        print(f"$ {shown}\n{obs.output.rstrip()}" + (f"\n[exit {obs.exit_code}]" if obs.exit_code else ""))
        return obs

    try:
        asyncio.run(rt.create_session(CreateBashSessionRequest()))
        run(BashAction(command="mkdir -p /tmp/demo && cd /tmp/demo && export STEP=1", timeout=10))
        run(BashAction(command="pwd; echo step $STEP; ls /nonexistent", check="silent", timeout=10))
        try:
            run(BashAction(command="sleep 60", timeout=1))
        except CommandTimeoutError as e:
            print(f"timed out: {e}")
        run(BashInterruptAction())
        run(BashAction(command="python3", is_interactive_command=True, expect=[">>> "], timeout=10))
        run(BashAction(command="print(6 * 7)", is_interactive_command=True, expect=[">>> "], timeout=10))
        run(BashAction(command="quit()", is_interactive_quit=True, timeout=10))
        asyncio.run(rt.write_file(WriteFileRequest(path="/tmp/demo/note.txt", content="written by the runtime\n")))
        run(BashAction(command="cat note.txt", timeout=10))
        print(asyncio.run(rt.read_file(ReadFileRequest(path="/tmp/demo/note.txt"))).content, end="")
        print(asyncio.run(rt.execute(Command(command=["uname", "-s"]))).stdout, end="")
    finally:
        asyncio.run(deployment.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
