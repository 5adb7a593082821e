"""A real `sandman serve` for the harness suites (`scripts/test-harnesses`): started on a free
loopback port with a state directory of its own, stopped (its sandboxes released first) when done.

The binary is `$SANDMAN_BIN`, else `target/debug/sandman` of this repository.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Sequence

from sandman import Sandman

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    token: str
    state: Path
    log: Path
    proc: "subprocess.Popen[bytes]"
    #: The provider it runs (`process`, `docker`, ...), as it says when it starts.
    provider: str

    def client(self) -> Sandman:
        return Sandman(self.url, self.token)

    def live_sandboxes(self) -> List[str]:
        with self.client() as c:
            return [sb.id for sb in c.list() if sb.live]


def binary() -> Path:
    path = Path(os.environ.get("SANDMAN_BIN") or REPO / "target" / "debug" / "sandman")
    if not path.exists():
        raise RuntimeError(f"no sandman binary at {path}: `cargo build -p sandman-cli -p sandmand`, or set SANDMAN_BIN")
    return path


def serve(name: str, args: Sequence[str] = ()) -> Iterator[Server]:
    """Runs `sandman serve ARGS` until the generator is closed. Its state directory is under
    `target/harness/<name>/` (not /tmp: an isolated process-provider sandbox has a /tmp of its
    own)."""
    base = REPO / "target" / "harness" / name
    base.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="s-", dir=base))
    log = state / "serve.log"
    token = secrets.token_hex(16)
    env = dict(os.environ, SANDMAN_TOKEN=token)
    env.pop("SANDMAN_URL", None)
    # A docker provider's egress sandboxes on a network (and bridge) of this server's own, removed
    # with it, rather than the default one a server leaves in place.
    tag = secrets.token_hex(4)
    env["SANDMAN_DOCKER_NETWORK"], env["SANDMAN_DOCKER_BRIDGE"] = f"sandman-test-{tag}", f"smt{tag}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(binary()), "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state), *args],
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
        )
    url = provider = None
    deadline = time.monotonic() + 60
    while url is None:
        m = re.search(r"sandman serving on (http://\S+) \(provider ([^,)]+)", log.read_text(errors="replace"))
        if m:
            url, provider = m.group(1), m.group(2)
        elif proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sandman serve did not start:\n{log.read_text(errors='replace')}")
        else:
            time.sleep(0.05)
    assert provider is not None
    server = Server(url, token, state, log, proc, provider)
    try:
        yield server
    finally:
        try:
            with server.client() as c:
                for sb in c.list():
                    if sb.live:
                        c.release(sb.id)
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.copy(log, base / "last-serve.log")
            _remove_docker_network(state, env["SANDMAN_DOCKER_NETWORK"])
            shutil.rmtree(state, ignore_errors=True)


def _remove_docker_network(state: Path, network: str) -> None:
    """The docker network of a server on `state`, and the host firewall table its provider
    installed (recorded in /run/sandman/tables under `<state>/docker`); nothing when it made none."""
    docker_dir = state / "docker"
    if not docker_dir.exists():
        return
    subprocess.run(["docker", "network", "rm", network], capture_output=True)
    tables = Path("/run/sandman/tables")
    owner = str(docker_dir.resolve())
    for record in tables.glob("*") if tables.is_dir() else []:
        if record.read_text(errors="replace") == owner:
            subprocess.run(["nft", "delete", "table", "inet", record.name], capture_output=True)
            record.unlink(missing_ok=True)
