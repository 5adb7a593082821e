"""Real Harbor trials on Sandman: `harbor run` (the PyPI package, unmodified) with
`--env sandman.integrations.harbor:SandmanEnvironment`, Harbor's `oracle` and `nop` agents (no
model), on small tasks written here, against `sandman serve` on the docker provider and on the
process provider (the tasks' image unpacked into its image store).

Each task's test script writes Harbor's reward file; the oracle runs the task's solution. What
each checks is in its name; a task checks from inside the sandbox, so a reward of 1 means the
sandbox had the property.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from conftest import Harbor

from sandman_server import REPO, Server


def write_task(
    root: Path,
    name: str,
    *,
    toml: str,
    solve: str,
    test: str,
    dockerfile: Optional[str] = None,
    files: Optional[Dict[str, str]] = None,
) -> Path:
    """A Harbor task directory: task.toml, instruction.md, solution/solve.sh, tests/test.sh,
    environment/ (a Dockerfile, or files uploaded into a prebuilt image's workdir)."""
    task = root / name
    for d in ("environment", "solution", "tests"):
        (task / d).mkdir(parents=True, exist_ok=True)
    (task / "task.toml").write_text(textwrap.dedent(toml).lstrip())
    (task / "instruction.md").write_text(f"Solve {name}.\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\nset -eu\n" + textwrap.dedent(solve).lstrip())
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + textwrap.dedent(test).lstrip())
    if dockerfile is not None:
        (task / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile).lstrip())
    for rel, content in (files or {}).items():
        path = task / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return task


def score_task(root: Path, image: str) -> Path:
    """The oracle makes /app/answer; the test gives 1 when it holds 42, else 0."""
    return write_task(
        root,
        "score",
        toml=f"""
            [environment]
            docker_image = "{image}"
            workdir = "/app"
            [verifier]
            timeout_sec = 60
            [agent]
            timeout_sec = 60
        """,
        solve="echo 42 > /app/answer\n",
        test="""
            if [ "$(cat /app/answer 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
        """,
    )


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory, image: str) -> Path:
    root = tmp_path_factory.mktemp("tasks")
    score_task(root, image)
    # Users, env, workdir, uploads, a hostname of the sandbox's own that resolves (as a
    # container's does), and a reward of several keys. The image is built from the
    # task's Dockerfile (by the environment, with the local docker, as Harbor's docker backend
    # does); the agent runs as uid 1000, the verifier as root.
    write_task(
        root,
        "features",
        dockerfile=f"""
            FROM {image}
            ENV FROM_DOCKERFILE=yes
            RUN mkdir -p /srv/data && echo baked > /srv/data/baked.txt
            WORKDIR /srv
        """,
        toml="""
            [environment]
            workdir = "/srv/data"
            env = { TASK_VAR = "task value" }
            [agent]
            user = 1000
            timeout_sec = 60
            [verifier]
            user = "root"
            timeout_sec = 60
            env = { VERIFIER_VAR = "checked" }
        """,
        files={
            "solution/lib/helper.sh": "echo helper-ran\n",
            "solution/lib/nested/deep.txt": "deep\n",
            "tests/expected.txt": "helper-ran\n",
        },
        solve="""
            out=/tmp/agent
            mkdir -p "$out"
            id -u > "$out/uid"
            pwd > "$out/pwd"
            printf '%s|%s' "$TASK_VAR" "$FROM_DOCKERFILE" > "$out/env"
            bash /solution/lib/helper.sh > "$out/helper"
            cp /solution/lib/nested/deep.txt "$out/deep"
            touch /tmp/agent/written-by-agent
        """,
        test="""
            a=/tmp/agent
            ok() { if eval "$1"; then echo 1; else echo 0; fi; }
            agent_uid=$(ok '[ "$(cat $a/uid)" = 1000 ] && [ "$(stat -c %u $a/written-by-agent)" = 1000 ]')
            verifier_root=$(ok '[ "$(id -u)" = 0 ]')
            workdir=$(ok '[ "$(cat $a/pwd)" = /srv/data ] && [ "$(pwd)" = /srv/data ]')
            env=$(ok '[ "$(cat $a/env)" = "task value|yes" ] && [ "$VERIFIER_VAR" = checked ] && [ "$TASK_VAR" = "task value" ]')
            uploads=$(ok 'cmp -s $a/helper /tests/expected.txt && [ "$(cat $a/deep)" = deep ] && [ "$(cat /srv/data/baked.txt)" = baked ]')
            hostname=$(ok '[ "$(cat /etc/hostname)" = "$(hostname)" ] && hostname -i > /dev/null')
            all=$(( agent_uid & verifier_root & workdir & env & uploads & hostname ))
            printf '{"reward": %s, "agent_uid": %s, "verifier_root": %s, "workdir": %s, "env": %s, "uploads": %s, "hostname": %s}' \
              $all $agent_uid $verifier_root $workdir $env $uploads $hostname > /logs/verifier/reward.json
        """,
    )
    # No network: the sandbox has only `lo`.
    write_task(
        root,
        "offline",
        toml=f"""
            [environment]
            docker_image = "{image}"
            network_mode = "no-network"
            [agent]
            timeout_sec = 60
            [verifier]
            timeout_sec = 60
        """,
        solve="ls /sys/class/net > /tmp/interfaces\n",
        test="""
            if [ "$(cat /tmp/interfaces)" = lo ] && [ "$(ls /sys/class/net)" = lo ]; then echo 1; else echo 0; fi \\
              > /logs/verifier/reward.txt
        """,
    )
    # An agent that runs past its timeout: Harbor's AgentTimeoutError, then the verifier's 0.
    write_task(
        root,
        "slow",
        toml=f"""
            [environment]
            docker_image = "{image}"
            [agent]
            timeout_sec = 3
            [verifier]
            timeout_sec = 60
        """,
        solve="sleep 120\necho done > /tmp/done\n",
        test="if [ -f /tmp/done ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n",
    )
    return root


def docker_containers(server: Server) -> str:
    """The containers this server's docker provider made, running or not."""
    owner = (server.state / "docker").resolve()
    out = subprocess.run(
        ["docker", "ps", "-a", "--filter", f"label=sandman.dev/owner={owner}", "--format", "{{.Names}} {{.Status}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def process_sandboxes(server: Server) -> List[str]:
    """What the process provider keeps of sandboxes on disk: a directory each."""
    sandboxes = server.state / "sandboxes"
    return sorted(p.name for p in sandboxes.iterdir()) if sandboxes.exists() else []


def assert_nothing_left(server: Server) -> None:
    assert server.live_sandboxes() == []
    assert docker_containers(server) == ""
    assert process_sandboxes(server) == []


def test_oracle_trials_get_what_each_task_checks(harbor: Harbor, tasks: Path, server: Server) -> None:
    job = harbor.run("-p", str(tasks), "-a", "oracle", "-n", "4", name="oracle")
    trials = job.by_task()
    assert sorted(trials) == ["features", "offline", "score", "slow"], job.output

    assert (trials["score"].reward, trials["score"].exception) == (1.0, ""), trials["score"].result
    assert trials["features"].rewards == {
        "reward": 1,
        "agent_uid": 1,
        "verifier_root": 1,
        "workdir": 1,
        "env": 1,
        "uploads": 1,
        "hostname": 1,
    }, trials["features"].result
    assert trials["features"].exception == ""
    assert (trials["offline"].reward, trials["offline"].exception) == (1.0, ""), trials["offline"].result
    # The agent ran past its 3 s: Harbor's own timeout error, and the verifier still graded it 0.
    assert (trials["slow"].exception, trials["slow"].reward) == ("AgentTimeoutError", 0.0), trials["slow"].result
    assert_nothing_left(server)


def test_the_nop_agent_scores_zero(harbor: Harbor, tmp_path: Path, image: str, server: Server) -> None:
    task = score_task(tmp_path, image)
    job = harbor.run("-p", str(task), "-a", "nop", name="nop")
    [trial] = job.trials
    assert (trial.reward, trial.exception) == (0.0, ""), trial.result
    assert_nothing_left(server)


def test_sixteen_attempts_eight_at_a_time_all_pass_and_nothing_is_left(
    harbor: Harbor, tmp_path: Path, image: str, server: Server
) -> None:
    task = score_task(tmp_path, image)
    job = harbor.run("-p", str(task), "-a", "oracle", "-k", "16", "-n", "8", name="burst")
    assert len(job.trials) == 16
    assert [(t.reward, t.exception) for t in job.trials] == [(1.0, "")] * 16, [t.result for t in job.trials]
    assert_nothing_left(server)


def test_the_example_script_scores_the_oracle_one_and_nop_zero(image: str, server: Server) -> None:
    example = REPO / "examples" / "harbor_trial.py"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True")
    out = subprocess.run(
        [sys.executable, str(example), "--image", image, "--url", server.url, "--token", server.token],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["oracle: reward 1.0", "nop: reward 0.0"], out.stdout + out.stderr
    assert_nothing_left(server)
