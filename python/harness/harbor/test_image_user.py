"""A task whose image sets `USER`: as with Harbor's docker environment, the agent and the verifier
run as that user when the task names none, and as the one it names otherwise. The sandbox's
default user is the image's (each provider reads it from the image's config; the process
provider's image is the one the environment built, taken from the engine as `docker-daemon:`)."""

from __future__ import annotations

from pathlib import Path

from conftest import Harbor
from test_harbor import assert_nothing_left, write_task

from sandman_server import Server


def test_the_images_user_is_the_default_and_a_named_user_wins(
    harbor: Harbor, tmp_path: Path, image: str, server: Server
) -> None:
    write_task(
        tmp_path,
        "image-user",
        dockerfile=f"""
            FROM {image}
            RUN mkdir -p /home/agent/work && chown -R 1000:1000 /home/agent
            USER agent
            WORKDIR /home/agent/work
        """,
        toml="""
            [agent]
            timeout_sec = 60
            [verifier]
            timeout_sec = 60
        """,
        solve="""
            id -un > /tmp/agent-user
            pwd > /tmp/agent-pwd
        """,
        test="""
            ok() { if eval "$1"; then echo 1; else echo 0; fi; }
            agent=$(ok '[ "$(cat /tmp/agent-user)" = agent ]')
            verifier=$(ok '[ "$(id -un)" = agent ]')
            workdir=$(ok '[ "$(cat /tmp/agent-pwd)" = /home/agent/work ]')
            printf '{"reward": %s, "agent": %s, "verifier": %s, "workdir": %s}' \\
              $(( agent & verifier & workdir )) $agent $verifier $workdir > /logs/verifier/reward.json
        """,
    )
    job = harbor.run("-p", str(tmp_path / "image-user"), "-a", "oracle", name="image-user")
    [trial] = job.trials
    assert (trial.rewards, trial.exception) == ({"reward": 1, "agent": 1, "verifier": 1, "workdir": 1}, ""), trial.result
    assert_nothing_left(server)
