"""The Harbor environment type-checks under `mypy --strict` against the real Harbor: its
overrides match `BaseEnvironment`'s signatures (the SDK's own mypy run, without Harbor, cannot
see them)."""

from __future__ import annotations

import subprocess
import sys

from sandman_server import REPO


def test_the_harbor_environment_passes_mypy_strict_against_harbor() -> None:
    result = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", "/dev/null",
            # Harbor's own modules are followed for their types, not checked themselves.
            "--follow-imports=silent", "sandman/integrations/harbor.py",
        ],
        cwd=REPO / "python",
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
