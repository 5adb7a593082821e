#!/usr/bin/env python3
"""mini-swe-agent solving a small bug inside a Sandman sandbox.

The agent is mini-swe-agent's own `DefaultAgent` with its default config; its environment is
`sandman.integrations.mini_swe_agent.SandmanEnvironment`, so every command the agent runs goes to
a sandbox instead of the local machine or a docker container.

    pip install './python[mini-swe-agent]'
    python examples/mini_swe_agent.py                       # a scripted model: no API key, no network
    python examples/mini_swe_agent.py --model openai/gpt-5  # a real model through litellm (needs its key)

In a mini-swe-agent YAML config the same environment is one line:
`environment_class: sandman.integrations.mini_swe_agent.SandmanEnvironment`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "mini-swe-agent-config"))

import yaml  # noqa: E402  (a dependency of mini-swe-agent)
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import builtin_config_dir  # noqa: E402

from sandman.integrations.mini_swe_agent import SandmanEnvironment  # noqa: E402

TASK = "The test in /tmp/repo/test_calc.py fails. Fix the bug in /tmp/repo/calc.py so that it passes."

SETUP = (
    "mkdir -p /tmp/repo && cd /tmp/repo && "
    "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && "
    "printf 'from calc import add\\nassert add(2, 3) == 5, add(2, 3)\\nprint(\"passed\")\\n' > test_calc.py"
)

#: What the scripted model answers, turn by turn: a thought and one command.
SCRIPT = [
    ("Let me run the test to see the failure.", "cd /tmp/repo && python3 test_calc.py"),
    ("add() subtracts. Fix it and run the test again.", "cd /tmp/repo && sed -i 's/a - b/a + b/' calc.py && python3 test_calc.py"),
    ("The test passes. Submit.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /tmp/repo/calc.py"),
]


def scripted_model() -> Any:
    from minisweagent.models.test_models import DeterministicModel, make_output

    outputs = [make_output(f"THOUGHT: {t}\n\n```mswea_bash_command\n{c}\n```", [{"command": c}]) for t, c in SCRIPT]
    return DeterministicModel(outputs=outputs, cost_per_call=0.0)


def run(model_name: Optional[str] = None, url: Optional[str] = None, token: Optional[str] = None) -> Dict[str, Any]:
    config = yaml.safe_load((Path(builtin_config_dir) / "default.yaml").read_text())
    if model_name:
        from minisweagent.models import get_model

        model = get_model(model_name, config.get("model", {}))
    else:
        model = scripted_model()
    env_config = dict(config.get("environment", {}))
    env_config["env"] = {**env_config.get("env", {}), "PYTHONDONTWRITEBYTECODE": "1"}
    env = SandmanEnvironment(url=url, token=token, cwd="/tmp/repo", lease=300, **env_config)
    try:
        env.execute({"command": SETUP}, cwd="/")
        agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": 30})
        result = agent.run(TASK)
        result["steps"] = agent.n_calls
        result["sandbox"] = env.serialize()["info"]["sandbox"]
        result["messages"] = agent.messages
        return result
    finally:
        env.cleanup()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="mini-swe-agent fixing a bug in a Sandman sandbox")
    p.add_argument("--model", default=None, help="a litellm model name (default: a scripted model)")
    p.add_argument("--url", default=None, help="server URL (default: $SANDMAN_URL)")
    p.add_argument("--token", default=None, help="server token (default: $SANDMAN_TOKEN or the token file)")
    args = p.parse_args(argv)
    result = run(args.model, args.url, args.token)
    transcript: List[str] = []
    for m in result["messages"][2:]:
        content = m.get("content")
        if isinstance(content, str):
            transcript.append(f"--- {m.get('role')}\n{content.strip()}")
    print("\n".join(transcript))
    print(f"\nexit status: {result['exit_status']} after {result['steps']} steps in sandbox {result['sandbox']}")
    print(f"submission:\n{result['submission']}")
    return 0 if result["exit_status"] == "Submitted" else 1


if __name__ == "__main__":
    sys.exit(main())
