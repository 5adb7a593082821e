"""Keyed creates from two jobs through the server's replicas while one replica is killed and the
Deployment is restarted: the check of `scripts/e2e-deploy --failover N`.

Each episode creates a sandbox under its own idempotency key (the SDK, with its retries), asks
for the same key again (it must answer the same sandbox: one sandbox per key), runs one exec, and
releases the sandbox. A third of the way in, the replica holding the Lease (the leader) is
deleted with `--grace-period=0 --force`; two thirds in, `kubectl rollout restart` replaces every
replica, one at a time. Meanwhile each job's live sandbox pods are sampled twice a second and
must never exceed its quota. An exec that fails is one in flight where a replica went away: it is
sent once more and must succeed. At the end every job is deleted and no sandbox pod may be left.

Before the burst it times exec calls through 1, 2 and 3 replicas (`throughput`): the same client
threads, spread over the leader alone, then over it and one follower, then over all three, with
the CPU each replica, the sandboxes' daemons and the client used, read from `/proc` (the local
cluster's node is this machine); and an exec's p50 through the leader and through a follower.

Clients reach the replicas through a small TCP balancer on 127.0.0.1 that sends each new
connection to the next ready endpoint of the Service `sandman` (as kube-proxy would; the local
cluster runs none). Prints one line of figures, and `FAILED: …` with exit status 1 on any miss.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

import sandman  # noqa: E402


def kubectl(args: argparse.Namespace, *cmd: str) -> str:
    return subprocess.run(
        ["kubectl", "--kubeconfig", args.kubeconfig, *cmd], check=True, capture_output=True, text=True
    ).stdout


class Balancer:
    """Each accepted connection goes to the next ready endpoint of the Service; one that refuses
    is skipped for the next (what a client behind kube-proxy sees as a retry)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.endpoints: List[str] = []
        self.turn = 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.refresh()
        threading.Thread(target=self._refresh_loop, daemon=True).start()
        threading.Thread(target=self._accept, daemon=True).start()

    def refresh(self) -> None:
        out = kubectl(
            self.args, "-n", "sandman-system", "get", "endpointslices",
            "-l", "kubernetes.io/service-name=sandman", "-o", "json",
        )  # fmt: skip
        ready = []
        for item in json.loads(out)["items"]:
            port = next((p["port"] for p in item.get("ports") or []), 7777)
            for ep in item.get("endpoints") or []:
                if ep.get("conditions", {}).get("ready"):
                    ready += [f"{a}:{port}" for a in ep["addresses"]]
        with self.lock:
            self.endpoints = sorted(ready)

    def _refresh_loop(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.refresh()
            except Exception as e:  # the API server is busy: keep the last list
                print(f"balancer: cannot list endpoints: {e}", file=sys.stderr)

    def _accept(self) -> None:
        while not self.stop.is_set():
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self.lock:
            candidates = list(self.endpoints)
            self.turn += 1
            start = self.turn
        upstream = None
        for i in range(len(candidates)):
            host, port = candidates[(start + i) % len(candidates)].rsplit(":", 1)
            try:
                upstream = socket.create_connection((host, int(port)), timeout=2)
                upstream.settimeout(None)
                break
            except OSError:
                continue
        if upstream is None:
            conn.close()
            return

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while True:
                    data = a.recv(65536)
                    if not data:
                        break
                    b.sendall(data)
            except OSError:
                pass
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
        pipe(conn, upstream)


def live_pods_by_job(args: argparse.Namespace) -> Dict[str, int]:
    out = kubectl(
        args, "-n", "sandman-sandboxes", "get", "pods", "-l", "app.kubernetes.io/managed-by=sandman",
        "-o", "jsonpath={range .items[*]}{.metadata.labels.sandman\\.dev/job}{' '}{.metadata.deletionTimestamp}{'\\n'}{end}",
    )  # fmt: skip
    counts: Dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 1:  # no deletionTimestamp: not being deleted
            counts[parts[0]] = counts.get(parts[0], 0) + 1
    return counts


def leader_pod(args: argparse.Namespace) -> Tuple[str, str]:
    holder = kubectl(args, "-n", "sandman-system", "get", "lease", "sandman-leader", "-o", "jsonpath={.spec.holderIdentity}")
    ip = holder.rsplit(":", 1)[0]
    out = kubectl(
        args, "-n", "sandman-system", "get", "pods", "-l", "app.kubernetes.io/name=sandman-server",
        "-o", "jsonpath={range .items[*]}{.metadata.name}{' '}{.status.podIP}{'\\n'}{end}",
    )  # fmt: skip
    for line in out.splitlines():
        name, _, pod_ip = line.partition(" ")
        if pod_ip == ip:
            return name, holder
    raise RuntimeError(f"no server pod has the leader's address {holder}")


def server_pods(args: argparse.Namespace) -> List[Tuple[str, str]]:
    out = kubectl(
        args, "-n", "sandman-system", "get", "pods", "-l", "app.kubernetes.io/name=sandman-server",
        "-o", "jsonpath={range .items[*]}{.metadata.name}{' '}{.status.podIP}{'\\n'}{end}",
    )  # fmt: skip
    return [tuple(line.split(" ", 1)) for line in out.splitlines() if " " in line]  # type: ignore[misc]


def hop_cost(args: argparse.Namespace, n: int = 200) -> str:
    """p50 of an exec sent to the leader's address and to a follower's (which calls the daemon
    itself, from the route the leader streamed to it), interleaved on one sandbox."""
    _, holder = leader_pod(args)
    follower = next(ip for _, ip in server_pods(args) if not holder.startswith(ip + ":"))
    port = holder.rsplit(":", 1)[1]
    leader_c = sandman.Sandman(f"http://{holder}", args.token, retries=0)
    follower_c = sandman.Sandman(f"http://{follower}:{port}", args.token, retries=0)
    sb = leader_c.create(args.image, resources={"cpu": "10m", "memory": "16Mi"})
    times: Dict[str, List[float]] = {"leader": [], "follower": []}
    try:
        for i in range(n + 10):
            for name, c in (("leader", leader_c), ("follower", follower_c)):
                t0 = time.perf_counter()
                c.sandbox(sb.id).exec(["true"])
                if i >= 10:
                    times[name].append(time.perf_counter() - t0)
    finally:
        sb.release()
        leader_c.close()
        follower_c.close()
    p50 = {k: sorted(v)[len(v) // 2] * 1000 for k, v in times.items()}
    return (
        f"exec p50 through the leader {p50['leader']:.2f} ms, through a follower {p50['follower']:.2f} ms "
        f"({p50['follower'] / p50['leader']:.2f}x, {n} each, interleaved)"
    )


def server_pids() -> Dict[str, int]:
    """The server replicas' processes on this machine (the local cluster's node), by pod IP."""
    pids: Dict[str, int] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"--leader-election" not in argv or b"serve" not in argv:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        ip = env.get(b"POD_IP", b"").decode()
        if ip:
            pids[ip] = int(pid)
    return pids


def daemon_pids() -> List[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "sandmand":
                    out.append(int(pid))
        except OSError:
            continue
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and of its children it waited for."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def throughput(args: argparse.Namespace, sandboxes: int = 12, threads: int = 24, seconds: float = 10.0) -> str:
    """Exec calls a second through 1, 2 and 3 replicas (the leader first), the same clients and
    sandboxes each time, with the CPU each replica, the daemons and this client used."""
    _, holder = leader_pod(args)
    leader_ip, port = holder.rsplit(":", 1)
    ips = [leader_ip] + [ip for _, ip in server_pods(args) if ip != leader_ip]
    pids = server_pids()
    missing = [ip for ip in ips if ip not in pids]
    if missing:
        raise RuntimeError(f"no server process on this machine for the replicas at {missing}")
    client = sandman.Sandman(f"http://{holder}", args.token, retries=0)
    made = [client.create(args.image, resources={"cpu": "10m", "memory": "16Mi"}) for _ in range(sandboxes)]
    ids = [sb.id for sb in made]
    # Each follower has every route before it is timed.
    deadline = time.monotonic() + 60
    for ip in ips[1:]:
        while True:
            metrics = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10).read().decode()
            routes = next((int(l.split()[1]) for l in metrics.splitlines() if l.startswith("sandman_replica_routes ")), 0)
            if routes >= sandboxes:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the follower {ip} has {routes} routes of {sandboxes}")
            time.sleep(0.2)
    body = json.dumps({"argv": ["true"]}).encode()
    headers = {"authorization": f"Bearer {args.token}", "content-type": "application/json"}
    rows = []
    try:
        for k in (1, 2, 3):
            stop = threading.Event()
            lat: List[List[float]] = [[] for _ in range(threads)]
            errors: List[str] = []

            def worker(t: int) -> None:
                conn = http.client.HTTPConnection(ips[t % k], int(port), timeout=30)
                path = f"/v1/sandboxes/{ids[t % sandboxes]}/exec"
                while not stop.is_set():
                    t0 = time.perf_counter()
                    conn.request("POST", path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    if resp.status != 200:
                        errors.append(f"{resp.status} {data[:200]!r}")
                        return
                    lat[t].append(time.perf_counter() - t0)
                conn.close()

            workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
            for w in workers:
                w.start()
            time.sleep(1.0)  # warm: connections made, daemons' pools filled
            n0 = sum(len(x) for x in lat)
            s0 = {ip: cpu_s(pids[ip]) for ip in ips}
            dpids = daemon_pids()
            d0 = sum(cpu_s(p) for p in dpids)
            c0 = sum(os.times()[:2])
            t0 = time.monotonic()
            time.sleep(seconds)
            n1 = sum(len(x) for x in lat)
            took = time.monotonic() - t0
            s1 = {ip: cpu_s(pids[ip]) for ip in ips}
            d1 = sum(cpu_s(p) for p in dpids)
            c1 = sum(os.times()[:2])
            stop.set()
            for w in workers:
                w.join()
            if errors:
                raise RuntimeError(f"through {k} replicas: {errors[0]}")
            calls = n1 - n0
            every = sorted(x for xs in lat for x in xs)
            server = {ip: s1[ip] - s0[ip] for ip in ips}
            rows.append(
                (k, calls / took, every[len(every) // 2] * 1000, [server[ip] / took for ip in ips],
                 sum(server.values()) / calls * 1e6, (d1 - d0) / took, (c1 - c0) / took)
            )  # fmt: skip
    finally:
        for sb in made:
            sb.release()
        client.close()
    base = rows[0][1]
    lines = [
        f"exec calls through 1, 2 and 3 replicas ({threads} client threads over {sandboxes} sandboxes, "
        f"{seconds:.0f} s each, the leader first; CPU in cores, of {os.cpu_count()}):"
    ]
    for k, rate, p50, per, us, daemons, me in rows:
        split = " ".join(f"{c:.2f}" for c in per)
        lines.append(
            f"  {k} replica(s): {rate:.0f} calls/s ({rate / base:.2f}x of 1), p50 {p50:.2f} ms; servers (leader first) "
            f"{split}; server CPU per call {us:.0f} us; daemons {daemons:.2f}; this client {me:.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("--creates", type=int, default=500)
    ap.add_argument("--quota", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--bench-only", action="store_true", help="only time exec calls through 1, 2 and 3 replicas")
    args = ap.parse_args()

    bench = throughput(args)
    print(bench, file=sys.stderr)
    if args.bench_only:
        return 0
    hop = hop_cost(args)
    print(hop, file=sys.stderr)
    balancer = Balancer(args)
    client = sandman.Sandman(balancer.url, args.token, retries=20, retry_deadline=120, timeout=300)
    jobs = {"failover-a": 1.0, "failover-b": 3.0}
    for name, weight in jobs.items():
        client.job(name, max_sandboxes=args.quota, weight=weight, heartbeat=False, release_on_exit=False)

    over: List[str] = []
    peak: Dict[str, int] = {j: 0 for j in jobs}
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.5):
            try:
                counts = live_pods_by_job(args)
            except subprocess.CalledProcessError:
                continue
            for job in jobs:
                n = counts.get(job, 0)
                peak[job] = max(peak[job], n)
                if n > args.quota:
                    over.append(f"{job}: {n} live pods > quota {args.quota}")

    threading.Thread(target=sample, daemon=True).start()

    done = 0
    done_lock = threading.Lock()
    killed_at: List[float] = []
    first_create_after_kill: List[float] = []
    failures: List[str] = []
    exec_retried = 0
    over_quota = 0

    def create(job: str, key: str) -> "sandman.Sandbox":
        nonlocal over_quota
        while True:
            try:
                return client.create(
                    args.image, job=job, idempotency_key=key, resources={"cpu": "10m", "memory": "16Mi"}, wait_timeout=300
                )
            except sandman.QuotaExceeded:
                # The job is at its quota (more episodes than it may hold at once): as a trainer
                # would, wait for one of its own to be released.
                over_quota += 1
                time.sleep(0.2)

    def episode(i: int) -> None:
        nonlocal done, exec_retried
        job = "failover-a" if i % 2 == 0 else "failover-b"
        key = f"{job}-{i}"
        started = time.monotonic()
        try:
            sb = create(job, key)
            if killed_at and started > killed_at[0]:
                first_create_after_kill.append(time.monotonic())
            again = create(job, key)
            if again.id != sb.id:
                failures.append(f"key {key}: {sb.id} then {again.id}")
            try:
                out = sb.exec(["echo", key])
            except sandman.SandmanError as e:
                # In flight where a replica went away: once more, and it must succeed.
                exec_retried += 1
                print(f"exec of {key} failed ({e}); sent again", file=sys.stderr)
                out = sb.exec(["echo", key])
            if out.stdout.strip() != key:
                failures.append(f"key {key}: exec answered {out.stdout!r}")
            sb.release()
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failures.append(f"key {key}: {type(e).__name__}: {e}")
        with done_lock:
            done += 1

    started = time.monotonic()
    killed = ""
    killed_holder = ""
    lease_taken: Optional[float] = None
    restarted_at: Optional[float] = None
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        futures = [pool.submit(episode, i) for i in range(args.creates)]
        while not all(f.done() for f in futures):
            time.sleep(0.2)
            if not killed and done >= args.creates // 3:
                pod, holder = leader_pod(args)
                killed_at.append(time.monotonic())
                kubectl(args, "-n", "sandman-system", "delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
                killed = f"{pod} ({holder})"
                killed_holder = holder
                print(f"killed the leader {killed} after {done} episodes", file=sys.stderr)
            if killed and lease_taken is None:
                try:
                    holder = leader_pod(args)[1]
                except (RuntimeError, subprocess.CalledProcessError):
                    holder = killed_holder
                if holder != killed_holder:
                    lease_taken = time.monotonic()
                    print(f"{holder} took the Lease", file=sys.stderr)
            if restarted_at is None and done >= 2 * args.creates // 3:
                restarted_at = time.monotonic()
                kubectl(args, "-n", "sandman-system", "rollout", "restart", "deploy/sandman-server")
                print(f"rollout restart after {done} episodes", file=sys.stderr)
    took = time.monotonic() - started
    # The rollout ends with three ready replicas.
    subprocess.run(
        ["kubectl", "--kubeconfig", args.kubeconfig, "-n", "sandman-system", "rollout", "status",
         "deploy/sandman-server", "--timeout=300s"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    new_leader = leader_pod(args)[1]
    for name in jobs:
        client.delete_job(name)
    deadline = time.monotonic() + 180
    while live_pods_by_job(args) and time.monotonic() < deadline:
        time.sleep(1)
    left = live_pods_by_job(args)
    sampling.set()
    balancer.stop.set()

    failover = (first_create_after_kill[0] - killed_at[0]) if first_create_after_kill and killed_at else None
    print(
        f"{hop}; replicas: {args.creates} keyed creates from 2 jobs in {took:.1f} s, {len(failures)} failed; "
        f"killed the leader {killed}; another replica took the Lease "
        f"{'%.1f s' % (lease_taken - killed_at[0]) if lease_taken and killed_at else 'never'} and the first create "
        f"started after the kill succeeded {'%.1f s' % failover if failover is not None else 'never'} after it; "
        f"rollout restart during the burst; creates refused at the quota and sent again: {over_quota}; "
        f"new leader {new_leader}; execs sent again after a replica went away: {exec_retried}; "
        f"peak live pods per job {peak} (quota {args.quota}); left after release-all: {left or 'none'}"
    )
    problems = failures[:10] + over[:10]
    if left:
        problems.append(f"sandbox pods left after the jobs were deleted: {left}")
    if not killed:
        problems.append("the leader was never killed")
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
