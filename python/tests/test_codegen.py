"""One design for both clients: the committed sync client is exactly what the generator makes from
the async one, and the two expose the same calls with the same signatures."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from conftest import REPO, TWINS

PYTHON = REPO / "python"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync_tool", PYTHON / "tools" / "unasync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["unasync_tool"] = module
    spec.loader.exec_module(module)
    return module


def test_the_committed_sync_client_is_generated_from_the_async_one() -> None:
    gen = _generator()
    for src, dst in gen.FILES:
        committed = (PYTHON / "sandman" / dst).read_text()
        assert committed == gen.generate(src), (
            f"sandman/{dst} is out of date with sandman/{src}: run `python python/tools/unasync.py`"
        )


def test_the_generator_removes_async_and_renames() -> None:
    gen = _generator()
    source = (
        "from ._async import _rt\n"
        "class AsyncThing:\n"
        '    """Use `async with await AsyncThing.open()` then `aclose()`."""\n'
        "    async def __aenter__(self) -> 'AsyncThing':\n"
        "        async for line in self.r.aiter_lines():  # an AsyncIterator\n"
        "            await  _rt.sleep(f'{line!r}')\n"
        "        raise StopAsyncIteration\n"
    )
    assert gen.unasync(source) == (
        "from ._sync import _rt\n"
        "class Thing:\n"
        '    """Use `with Thing.open()` then `close()`."""\n'
        "    def __enter__(self) -> 'Thing':\n"
        "        for line in self.r.iter_lines():  # an Iterator\n"
        "            _rt.sleep(f'{line!r}')\n"
        "        raise StopIteration\n"
    )


def _public(cls: type) -> dict:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") or name in ("__init__", "__enter__", "__aenter__", "__iter__", "__aiter__")
    }


def test_sync_and_async_classes_have_the_same_calls() -> None:
    renames = {"aclose": "close", "__aenter__": "__enter__", "__aiter__": "__iter__"}
    assert len(TWINS) == 9
    for sync_cls, async_cls in TWINS.items():
        a, s = _public(async_cls), _public(sync_cls)
        assert {renames.get(n, n) for n in a} == set(s), async_cls.__name__
        for name, member in a.items():
            twin = s[renames.get(name, name)]
            if inspect.isfunction(member):
                assert not inspect.iscoroutinefunction(twin)
                params_a = [(p.name, p.default, p.kind) for p in inspect.signature(member).parameters.values()]
                params_s = [(p.name, p.default, p.kind) for p in inspect.signature(twin).parameters.values()]
                assert params_a == params_s, f"{async_cls.__name__}.{name}"


def test_the_runtime_twins_keep_the_same_names() -> None:
    from sandman._async import _rt as a
    from sandman._sync import _rt as s

    names = {n for n in vars(a) if not n.startswith("_") and callable(getattr(a, n))}
    assert {"sleep", "run_blocking", "Ticker"} <= names
    for n in ("sleep", "run_blocking", "Ticker"):
        assert hasattr(s, n)
    assert [m for m in vars(a.Ticker) if not m.startswith("__")] == [m for m in vars(s.Ticker) if not m.startswith("__")]


def test_the_package_is_typed_and_3_9_compatible_in_syntax() -> None:
    import ast

    for path in (PYTHON / "sandman").rglob("*.py"):
        tree = ast.parse(path.read_text(), feature_version=(3, 9))
        text = path.read_text()
        assert "from __future__ import annotations" in text or not any(
            isinstance(n, (ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree)
        ), path
    assert (PYTHON / "sandman" / "py.typed").exists()
    _ = Path  # noqa
