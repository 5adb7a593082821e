"""verl's SandboxFusion client module (`verl.utils.reward_score.sandbox_fusion.utils`), loaded from
the installed `verl` package as it is, for the verl suite and the SandboxFusion benchmark."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

NAME = "verl.utils.reward_score.sandbox_fusion.utils"


def load() -> ModuleType:
    """The module, loaded from its file under its own name.

    `import verl` runs `verl/__init__.py`, which imports verl's training stack (torch,
    tensordict, ray, transformers, through `verl.protocol` and `verl.utils`); the client module
    uses none of it: it imports only the standard library and `requests`. So it is loaded from its
    file without running its parent packages' `__init__`. Nothing is stubbed and no line of it is
    changed; `pip install verl --no-deps` is all it needs besides `requests`."""
    if NAME in sys.modules:
        return sys.modules[NAME]
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the `verl` package is not installed (pip install --no-deps verl; see scripts/test-harnesses)")
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / "utils" / "reward_score" / "sandbox_fusion" / "utils.py"
    module_spec = importlib.util.spec_from_file_location(NAME, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[NAME] = module
    module_spec.loader.exec_module(module)
    return module
