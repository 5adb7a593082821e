#!/usr/bin/env python3
"""Generates the sync client from the async one: `sandman/_async/X.py` -> `sandman/_sync/X.py`.

    python python/tools/unasync.py           # regenerate
    python python/tools/unasync.py --check   # exit 1 when a generated file is out of date

The same idea as the `unasync` package (used by httpcore), in one small file so that the build
needs nothing: the source is tokenized and written back token by token, with
- `async` and `await` removed (with the space after them);
- names renamed: `AsyncFoo` -> `Foo`, `__aenter__` -> `__enter__`, `aclose` -> `close`,
  `aiter_lines` -> `iter_lines`, `StopAsyncIteration` -> `StopIteration`, `_async` -> `_sync`, ...;
- in strings and comments, the same renames (but `_async`), and `async with`/`await` dropped, so
  docstrings and examples read right in the sync copy.
Everything else, whitespace and comments included, is copied byte for byte. What cannot be
written once for both (sleeping, background heartbeats) lives in the hand-written twins
`_async/_rt.py` and `_sync/_rt.py`, which keep the same names.
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Dict, List, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "sandman"

#: (source, generated), relative to the package.
FILES: List[Tuple[str, str]] = [
    ("_async/__init__.py", "_sync/__init__.py"),
    ("_async/client.py", "_sync/client.py"),
]

HEADER = (
    "# Generated from sandman/{src} by python/tools/unasync.py: do not edit.\n"
    "# Edit that file and run `python python/tools/unasync.py`.\n"
)

RENAMES: Dict[str, str] = {
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "aclose": "close",
    "aread": "read",
    "aiter_lines": "iter_lines",
    "aiter_bytes": "iter_bytes",
    "aiter_raw": "iter_raw",
    "StopAsyncIteration": "StopIteration",
}
# Renamed in code only: in prose, `sandman/_async/client.py` names the source file.
CODE_RENAMES: Dict[str, str] = {"_async": "_sync"}

_ASYNC_PREFIX = re.compile(r"\bAsync([A-Z]\w*)")
_WORDS = re.compile(r"\b(" + "|".join(re.escape(k) for k in RENAMES) + r")\b")
_PROSE_KEYWORDS = re.compile(r"\b(?:await|async(?= (?:with|for|def)\b)) ")


def rename(name: str) -> str:
    if name in RENAMES:
        return RENAMES[name]
    if name in CODE_RENAMES:
        return CODE_RENAMES[name]
    m = _ASYNC_PREFIX.fullmatch(name)
    return m.group(1) if m else name


def rewrite_prose(text: str) -> str:
    text = _ASYNC_PREFIX.sub(r"\1", text)
    text = _WORDS.sub(lambda m: RENAMES[m.group(1)], text)
    return _PROSE_KEYWORDS.sub("", text)


def unasync(source: str) -> str:
    """The sync twin of the async module `source`."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(pos: Tuple[int, int]) -> int:
        row, col = pos
        return starts[row - 1] + col if row - 1 < len(starts) else len(source)

    prose_types = {tokenize.STRING, tokenize.COMMENT}
    fstring_middle = getattr(tokenize, "FSTRING_MIDDLE", None)  # Python 3.12+
    if fstring_middle is not None:
        prose_types.add(fstring_middle)

    out: List[str] = []
    prev = 0
    skip_space = False
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        start, end = offset(tok.start), offset(tok.end)
        gap = source[prev:start]
        if skip_space and gap.strip(" ") == "":
            gap = ""
        skip_space = False
        text = source[start:end]
        if tok.type == tokenize.NAME and text in ("async", "await"):
            out.append(gap)
            skip_space = True
            prev = end
            continue
        if tok.type == tokenize.NAME:
            text = rename(text)
        elif tok.type in prose_types:
            text = rewrite_prose(text)
        out.append(gap)
        out.append(text)
        prev = end
    out.append(source[prev:])
    return "".join(out)


def generate(src: str) -> str:
    return HEADER.format(src=src) + unasync((PACKAGE / src).read_text())


def main(argv: List[str]) -> int:
    check = "--check" in argv
    stale = []
    for src, dst in FILES:
        want = generate(src)
        path = PACKAGE / dst
        have = path.read_text() if path.exists() else None
        if have == want:
            continue
        if check:
            stale.append(dst)
        else:
            path.write_text(want)
            print(f"wrote sandman/{dst}")
    if stale:
        print(
            "error: out of date: " + ", ".join(f"sandman/{d}" for d in stale) + "\n"
            "hint: run `python python/tools/unasync.py`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
