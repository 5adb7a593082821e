"""The package is typed (`py.typed`): it type-checks under `mypy --strict`, examples included."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_sdk_and_the_examples_pass_mypy_strict() -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", "/dev/null",
            "sandman", str(REPO / "examples" / "rollout.py"), str(REPO / "examples" / "determinism.py"),
            str(REPO / "examples" / "harbor_trial.py"), str(REPO / "examples" / "swerex_session.py"),
        ],
        cwd=REPO / "python",
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
