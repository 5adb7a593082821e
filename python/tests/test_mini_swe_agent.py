"""The mini-swe-agent environment on a Sandman sandbox: its execute/cleanup interface directly, and
mini-swe-agent's own `DefaultAgent` driving it with a scripted (deterministic) model, no network."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from conftest import Server, unique

# mini-swe-agent prints a banner and writes a config dir on import unless told otherwise.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-"))

if sys.version_info < (3, 10):  # the only reason to skip: mini-swe-agent needs Python 3.10+
    pytest.skip("mini-swe-agent needs Python 3.10+", allow_module_level=True)

import yaml  # noqa: E402  (a dependency of mini-swe-agent)
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from sandman import Sandman  # noqa: E402
from sandman.integrations.mini_swe_agent import SandmanEnvironment  # noqa: E402


@pytest.fixture
def env(server: Server) -> Iterator[SandmanEnvironment]:
    e = SandmanEnvironment(
        url=server.url, token=server.token, timeout=5, lease=30, env={"MSWEA": "yes"}, labels={"t": "mswea"}
    )
    try:
        yield e
    finally:
        e.cleanup()


def test_execute_answers_output_and_returncode(env: SandmanEnvironment) -> None:
    out = env.execute({"command": "echo out; echo err >&2; echo $MSWEA; exit 3"})
    assert (out["returncode"], out["exception_info"]) == (3, "")
    # stdout and stderr are interleaved as they arrived (two pipes: no order between them)
    lines = out["output"].splitlines()
    assert sorted(lines) == ["err", "out", "yes"] and lines.index("out") < lines.index("yes")
    assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
    assert env.execute({"command": "[[ -n $BASH_VERSION ]] && echo bash"})["output"] == "bash\n"  # bash -lc


def test_execute_timeout_is_reported_like_mini_swe_agents_own_environments(env: SandmanEnvironment) -> None:
    out = env.execute({"command": "echo partial; sleep 30"}, timeout=1)
    assert out["returncode"] == -1 and out["output"] == "partial\n"
    assert "timed out after 1 seconds" in out["exception_info"]
    assert out["extra"]["exception_type"] == "TimeoutExpired"


def test_forward_env_and_interpreter(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORWARDED", "from-host")
    e = SandmanEnvironment(
        url=server.url, token=server.token, forward_env=["FORWARDED", "NOT_SET"], interpreter=[], cwd="/tmp"
    )
    try:
        out = e.execute({"command": 'echo "$FORWARDED ${NOT_SET-unset}"; pwd'})
        assert out["output"] == "from-host unset\n/tmp\n"
    finally:
        e.cleanup()


def test_submission_raises_submitted(env: SandmanEnvironment) -> None:
    with pytest.raises(Submitted) as e:
        env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch"})
    assert e.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "the patch\n"}


def test_template_vars_serialize_and_cleanup(env: SandmanEnvironment, server: Server) -> None:
    tv = env.get_template_vars(extra=1)
    assert tv["system"] == "Linux" and tv["machine"] and tv["release"] and tv["version"]
    assert tv["timeout"] == 5 and tv["extra"] == 1
    data = env.serialize()
    sandbox_id = data["info"]["sandbox"]
    assert data["info"]["config"]["environment_type"].endswith("mini_swe_agent.SandmanEnvironment")
    assert "token" not in data["info"]["config"]["environment"]
    env.cleanup()
    env.cleanup()  # twice is fine
    with Sandman(server.url, server.token) as c:
        assert c.get(sandbox_id).reason == "released"
    out = env.execute({"command": "true"})
    assert out["returncode"] == -1 and "cleaned up" in out["exception_info"]


def test_an_adopted_sandbox_stays_the_callers(server: Server) -> None:
    with Sandman(server.url, server.token) as c, c.create(lease=30) as sb:
        e = SandmanEnvironment(sandbox=sb)
        assert e.execute({"command": "echo adopted"})["output"] == "adopted\n"
        e.cleanup()
        assert sb.exec("true").ok  # not released by the environment


def test_mini_swe_agent_loads_it_by_dotted_path_and_its_agent_fixes_a_bug(server: Server, tmp_path: Path) -> None:
    env = get_environment(
        {
            "environment_class": "sandman.integrations.mini_swe_agent.SandmanEnvironment",
            "url": server.url,
            "token": server.token,
            "cwd": "/tmp/repo",
            "job": unique("mswea"),
            "lease": 30,
            # calc.py is edited within a second of its first import: no stale bytecode
            "env": {"PYTHONDONTWRITEBYTECODE": "1"},
        }
    )
    assert isinstance(env, SandmanEnvironment)
    project = (
        "mkdir -p /tmp/repo && cd /tmp/repo && "
        "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && "
        "printf 'from calc import add\\nassert add(2, 3) == 5, add(2, 3)\\nprint(\"passed\")\\n' > test_calc.py"
    )
    assert env.execute({"command": project}, cwd="/")["returncode"] == 0

    steps = [
        ("Run the test first.", "python3 test_calc.py"),
        ("add subtracts; fix it.", "sed -i 's/a - b/a + b/' calc.py && python3 test_calc.py"),
        ("Tests pass; submit.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"),
    ]
    model = DeterministicModel(
        outputs=[make_output(f"THOUGHT: {t}\n\n```mswea_bash_command\n{c}\n```", [{"command": c}]) for t, c in steps]
    )
    import minisweagent

    config: Any = yaml.safe_load((Path(minisweagent.__file__).parent / "config" / "default.yaml").read_text())
    agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": 10, "cost_limit": 0})
    try:
        result = agent.run("make test_calc.py pass")
    finally:
        env.cleanup()
    assert result["exit_status"] == "Submitted"
    assert result["submission"] == "def add(a, b):\n    return a + b\n"
    observations = [m["content"] for m in agent.messages if m.get("role") == "user"][1:]
    assert "AssertionError: -1" in observations[0] and "<returncode>1</returncode>" in observations[0]
    assert "passed" in observations[1] and "<returncode>0</returncode>" in observations[1]


def test_the_example_script_runs_the_agent_to_a_submission(server: Server, capsys: Any) -> None:
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("mswea_example", REPO / "examples" / "mini_swe_agent.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--url", server.url, "--token", server.token]) == 0
    out = capsys.readouterr().out
    assert "exit status: Submitted after 3 steps" in out and "return a + b" in out
    with Sandman(server.url, server.token) as c:
        sandbox = out.split("in sandbox ")[1].split()[0]
        assert c.get(sandbox).reason == "released"
