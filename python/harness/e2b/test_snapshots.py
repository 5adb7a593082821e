"""The real `e2b` SDK's snapshots and forks against `sandman serve` (docs/snapshots.md): a
filesystem snapshot, a create from it, the list and the delete, and a fork whose children each
keep their own writes. On the process provider's `base` template (this machine's root, with no
image to layer over) a snapshot is refused, saying why."""

from __future__ import annotations

import pytest
from e2b import Sandbox, SandboxException

from conftest import E2bServer


def test_snapshot_create_from_it_list_and_delete(e2b_env: E2bServer) -> None:
    src = Sandbox.create(e2b_env.template, timeout=120)
    try:
        src.files.write("/tmp/prepared.txt", "prepared\n")
        if e2b_env.template == "base":
            with pytest.raises(SandboxException, match="host"):
                src.create_snapshot()
            return
        with pytest.raises(SandboxException, match="memory snapshots are not supported"):
            src.create_snapshot(mode="full")
        snap = src.create_snapshot(name="e2b-prepared", mode="filesystem")
        assert snap.snapshot_id.startswith("snap-")
        assert "e2b-prepared" in snap.names
        listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id).next_items()]
        assert listed == [snap.snapshot_id]

        child = Sandbox.create(snap.snapshot_id, timeout=60)
        try:
            assert child.files.read("/tmp/prepared.txt") == "prepared\n"
            child.files.write("/tmp/own.txt", "child\n")
            assert not src.files.exists("/tmp/own.txt")
        finally:
            child.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        src.kill()


def test_fork_children_share_the_past_and_keep_their_own_writes(e2b_env: E2bServer) -> None:
    src = Sandbox.create(e2b_env.template, timeout=120)
    try:
        src.files.write("/tmp/base.txt", "base\n")
        if e2b_env.template == "base":
            with pytest.raises(SandboxException, match="host"):
                src.fork(count=1)
            return
        kids = src.fork(count=2, timeout=60)
        assert len(kids) == 2 and all(isinstance(k, Sandbox) for k in kids), kids
        try:
            for k in kids:
                assert k.files.read("/tmp/base.txt") == "base\n"
                k.files.write("/tmp/own.txt", k.sandbox_id)
            for k in kids:
                assert k.files.read("/tmp/own.txt") == k.sandbox_id
                assert k.commands.run("cat /tmp/base.txt").stdout == "base\n"
            assert not src.files.exists("/tmp/own.txt")
        finally:
            for k in kids:
                k.kill()
    finally:
        src.kill()
