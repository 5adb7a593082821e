#!/usr/bin/env python3
"""Harbor trials on Sandman: writes a small Harbor task, then runs it with the real `harbor run`
and Sandman as its environment, once with Harbor's `oracle` agent (runs the task's solution) and
once with `nop` (does nothing), and prints each trial's reward.

    pip install 'harbor>=0.26' ./python           # Python 3.12
    sudo sandman serve &                           # or: sandman serve --provider docker &
    python examples/harbor_trial.py --image python:3.12-slim

The image needs bash (Harbor runs commands with `bash -c`); it must be on the docker engine already
or pullable by the server (the process provider, the default, takes it from the engine or from its
registry). The same command line without this script:

    harbor run -p TASK_DIR -a oracle --env sandman.integrations.harbor:SandmanEnvironment

with the server in SANDMAN_URL and SANDMAN_TOKEN (or the server's token file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

TASK_TOML = """\
[environment]
docker_image = "{image}"
workdir = "/app"

[agent]
timeout_sec = 120

[verifier]
timeout_sec = 120
"""

SOLVE = """\
#!/bin/bash
echo 5 > /app/answer
"""

TEST = """\
#!/bin/bash
if [ "$(cat /app/answer 2>/dev/null)" = 5 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def write_task(root: Path, image: str) -> Path:
    """A Harbor task: task.toml, instruction.md, solution/solve.sh, tests/test.sh."""
    task = root / "add-two-and-three"
    for d in ("environment", "solution", "tests"):
        (task / d).mkdir(parents=True, exist_ok=True)
    (task / "task.toml").write_text(TASK_TOML.format(image=image))
    (task / "instruction.md").write_text("Write the sum of 2 and 3 into /app/answer.\n")
    (task / "solution" / "solve.sh").write_text(SOLVE)
    (task / "tests" / "test.sh").write_text(TEST)
    return task


def run_trial(task: Path, agent: str, jobs: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """`harbor run` of one task with `agent` on Sandman; answers the trial's result.json."""
    harbor = Path(sys.executable).parent / "harbor"
    cmd = [
        str(harbor) if harbor.exists() else "harbor", "run", "-p", str(task), "-a", agent,
        "--env", "sandman.integrations.harbor:SandmanEnvironment",
        "--jobs-dir", str(jobs), "--job-name", agent, "--yes", "--quiet",
    ]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)  # Harbor's progress; the rewards go to stdout
    [result] = list((jobs / agent).glob("*/result.json"))
    data: Dict[str, Any] = json.loads(result.read_text())
    return data


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Harbor's oracle and nop agents on a task, with Sandman as the environment")
    p.add_argument(
        "--image", required=True, help="the task's image (with bash), on the server's docker engine or in a registry"
    )
    p.add_argument("--url", default=None, help="server URL (default: $SANDMAN_URL)")
    p.add_argument("--token", default=None, help="server token (default: $SANDMAN_TOKEN or the token file)")
    p.add_argument("--agents", default="oracle,nop", help="comma-separated Harbor agents (default: oracle,nop)")
    args = p.parse_args(argv)
    env = dict(os.environ, HARBOR_TELEMETRY=os.environ.get("HARBOR_TELEMETRY", "0"))
    if args.url:
        env["SANDMAN_URL"] = args.url
    if args.token:
        env["SANDMAN_TOKEN"] = args.token
    with tempfile.TemporaryDirectory(prefix="harbor-example-") as tmp:
        task = write_task(Path(tmp) / "tasks", args.image)
        for agent in args.agents.split(","):
            result = run_trial(task, agent, Path(tmp) / "jobs", env)
            reward = ((result.get("verifier_result") or {}).get("rewards") or {}).get("reward")
            error = (result.get("exception_info") or {}).get("exception_type")
            print(f"{agent}: reward {reward}" + (f" ({error})" if error else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
