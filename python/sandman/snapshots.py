"""Snapshots and forks: what is sent and what comes back (the clients' `snapshot()`, `fork()`,
`snapshots()`, `get_snapshot()`, `delete_snapshot()` and `export_snapshot()` send these calls).

A snapshot is a sandbox's files as they were when it was taken (its changes over its image, as
one more layer of it); a create of `image="snapshot:<id>"` starts from it, with its files and
none of its processes. A fork is a snapshot and `count` creates from it in one call, with the
source's job, labels, resources, environment, lease and user unless given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ._core import Call, seg

__all__ = ["Snapshot", "snapshot_image"]

#: What a create names to start from snapshot `id`: `snapshot:<id>`.
IMAGE_PREFIX = "snapshot:"


def snapshot_image(snapshot_id: str) -> str:
    """The image a create names to start from a snapshot."""
    return f"{IMAGE_PREFIX}{snapshot_id}"


@dataclass(frozen=True)
class Snapshot:
    """A snapshot the server holds, until it is deleted or its job is."""

    id: str
    #: The sandbox it was taken of (which may be gone since).
    source: str
    #: The provider that holds it; only its sandboxes can start from it.
    provider: str
    #: What a create names to start from it: `snapshot:<id>`.
    image: str
    #: The image the source ran.
    base_image: str
    created_at_ms: int
    name: Optional[str] = None
    job: Optional[str] = None
    #: Bytes of its own layer (the source's changes), where the provider knows them.
    size: Optional[int] = None
    #: The directories it recorded when it recorded named ones only (kubernetes); empty: the
    #: whole file system.
    paths: List[str] = field(default_factory=list)
    #: Where the provider pushed it as an image, when it did (kubernetes).
    pushed: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Snapshot":
        return cls(
            id=str(d["id"]),
            source=str(d["source"]),
            provider=str(d["provider"]),
            image=str(d["image"]),
            base_image=str(d.get("base_image", "")),
            created_at_ms=int(d.get("created_at_ms", 0)),
            name=d.get("name"),
            job=d.get("job"),
            size=None if d.get("size") is None else int(d["size"]),
            paths=[str(p) for p in d.get("paths") or []],
            pushed=d.get("pushed"),
        )


def _path(snapshot_id: str, rest: str = "") -> str:
    return f"/v1/snapshots/{seg(snapshot_id)}{rest}"


def take_call(sandbox_id: str, name: Optional[str], paths: Optional[Sequence[str]] = None) -> Call:
    body: Dict[str, Any] = {} if name is None else {"name": name}
    if paths:
        body["paths"] = list(paths)
    return Call("POST", f"/v1/sandboxes/{seg(sandbox_id)}/snapshots", json=body, timeout=None, has_timeout=True)


def list_call(job: Optional[str]) -> Call:
    return Call("GET", "/v1/snapshots", params=None if job is None else {"job": job}, idempotent=True)


def get_call(snapshot_id: str) -> Call:
    return Call("GET", _path(snapshot_id), idempotent=True)


def delete_call(snapshot_id: str) -> Call:
    return Call("DELETE", _path(snapshot_id), idempotent=True)


def export_call(snapshot_id: str, reference: str) -> Call:
    return Call(
        "POST", _path(snapshot_id, "/export"), json={"reference": reference}, idempotent=True, timeout=None, has_timeout=True
    )


def fork_call(
    sandbox_id: str,
    count: int,
    *,
    name: Optional[str],
    job: Optional[str],
    labels: Optional[Mapping[str, str]],
    paths: Optional[Sequence[str]] = None,
    resources: Optional[Mapping[str, Any]],
    env: Optional[Mapping[str, str]],
    lease: Optional[int],
    ttl: Optional[int],
    idle_timeout: Optional[int],
    wait: bool,
    wait_timeout: Optional[int],
) -> Call:
    body: Dict[str, Any] = {"count": count, "wait": wait}
    for key, value in (
        ("name", name),
        ("paths", list(paths) if paths else None),
        ("job", job),
        ("labels", None if labels is None else dict(labels)),
        ("resources", None if resources is None else dict(resources)),
        ("env", None if not env else dict(env)),
        ("lease_s", lease),
        ("ttl_s", ttl),
        ("idle_timeout_s", idle_timeout),
        ("wait_timeout_s", wait_timeout),
    ):
        if value is not None:
            body[key] = value
    return Call("POST", f"/v1/sandboxes/{seg(sandbox_id)}/fork", json=body, timeout=None, has_timeout=True)


def snapshots_of(body: Any) -> List[Snapshot]:
    return [Snapshot.from_dict(d) for d in body.get("snapshots", [])]
