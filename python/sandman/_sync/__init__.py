# Generated from sandman/_async/__init__.py by python/tools/unasync.py: do not edit.
# Edit that file and run `python python/tools/unasync.py`.
"""The client (`sandman/_async` is written by hand; `sandman/_sync` is generated from it)."""

from .client import (
    ExecStream,
    Job,
    OutputStream,
    Process,
    Sandbox,
    Sandman,
    Session,
    Stream,
)

__all__ = [
    "Sandman",
    "Sandbox",
    "Process",
    "Session",
    "Job",
    "Stream",
    "ExecStream",
    "OutputStream",
]
