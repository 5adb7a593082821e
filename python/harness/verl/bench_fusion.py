"""The reward step of a code-RL run, side by side in one run (driven by scripts/bench-fusion).

N one-line Python programs (each reads stdin and prints) x M test cases, one call per case, K in
flight from threads, scored by verl's own client (`_process_single_case` of
`verl.utils.reward_score.sandbox_fusion.utils`, unchanged, which posts with `requests`) against:

- `floor`: no server; the same programs run by `python3 -c` from K threads (no isolation);
- `fusion-lite`: SandboxFusion's own server, isolation `lite` (its `ci` config: overlayfs +
  chroot, cgroups, a PID namespace and a network namespace per call);
- `fusion-none`: SandboxFusion's own server, isolation `none` (its `local` config);
- `sandman`: `sandman serve`'s SandboxFusion endpoint, through a job's capability URL;
- `baseline`: the same, of another build (`--baseline-bin`, `--baseline-daemon`): a change's
  effect, measured beside the build it changes in one run.

Each side runs alone, after a few warm-up calls that are not counted. Printed per side: calls a
second, p50/p99 latency of a call, how many were scored right (all must be) and the share of the
machine's time its hypervisor gave to others meanwhile (steal, which slows a side down without
showing in its CPU), then the ratios. With `--rounds N` the sides run N times, every other round
in the reverse order (floor, sandman, sandman, floor, ...), so that a machine that gets slower or
faster during the run weighs on every side alike; each round's ratios are printed, and the
summary gives each side's median round and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

import verl_client  # noqa: E402

verl = verl_client.load()
# verl's client logs every failed call at ERROR on stderr; the run counts and prints them itself.
logging.getLogger(verl_client.NAME).setLevel(logging.CRITICAL + 1)

#: verl's default per-case timeout (compile and run); its request timeout is 10 s more than both.
TIMEOUT = 10
MEMORY_MB = 1024


@dataclass
class Call:
    code: str
    stdin: str
    expected: str


def reward_step(programs: int, cases: int) -> List[Call]:
    """`programs` one-line programs x `cases` test cases, program-major (the order verl fans a
    batch's samples out in). Each answer depends on the program and the input, so a call
    answered with another's output scores wrong."""
    calls = []
    for j in range(programs):
        a, b = 2 + j % 17, j % 101
        template = j % 4
        for k in range(cases):
            x, y = 1000 * j + 37 * k, k + 1
            if template == 0:
                calls.append(Call(f"print(int(input()) * {a} + {b})", str(x), str(x * a + b)))
            elif template == 1:
                calls.append(Call(f"print(sum(map(int, input().split())) * {a})", f"{x} {y}", str((x + y) * a)))
            elif template == 2:
                calls.append(Call(f"print(input()[::-1] + '{b}')", str(x), str(x)[::-1] + str(b)))
            else:
                calls.append(Call(f"print(max(map(int, input().split())) - {b})", f"{y} {x}", str(max(x, y) - b)))
    return calls


@dataclass
class Result:
    side: str
    calls: int
    seconds: float
    latencies: List[float]
    correct: int
    failures: List[str]
    #: The share of the machine's time stolen by its hypervisor while the side ran (0 to 1).
    steal: float = 0.0

    @property
    def rate(self) -> float:
        """Calls answered a second, whatever the answer."""
        return self.calls / self.seconds

    @property
    def good_rate(self) -> float:
        """Calls scored right a second: the reward step's real throughput."""
        return self.correct / self.seconds

    def pct(self, p: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000


def cpu_times() -> Tuple[int, int]:
    """The machine's total and stolen time so far, in clock ticks (the first line of /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields[:8]), (fields[7] if len(fields) > 7 else 0)


def drive(side: str, calls: List[Call], in_flight: int, one: Callable[[int, Call], Tuple[bool, str]]) -> Result:
    """Runs every call through `one` from `in_flight` threads; each thread takes the next call."""
    latencies = [0.0] * len(calls)
    ok = [False] * len(calls)
    notes: List[str] = [""] * len(calls)
    it = iter(range(len(calls)))
    lock = threading.Lock()
    # Set on ^C: the threads finish the call they are in and take no other.
    stopping = threading.Event()

    def worker() -> None:
        while not stopping.is_set():
            with lock:
                i = next(it, None)
            if i is None:
                return
            begun = time.monotonic()
            ok[i], notes[i] = one(i, calls[i])
            latencies[i] = time.monotonic() - begun

    begun = time.monotonic()
    total0, steal0 = cpu_times()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        try:
            for f in [pool.submit(worker) for _ in range(in_flight)]:
                f.result()
        except BaseException:
            stopping.set()
            raise
    seconds = time.monotonic() - begun
    total1, steal1 = cpu_times()
    failures = [f"call {i}: {notes[i]}" for i in range(len(calls)) if not ok[i]]
    steal = (steal1 - steal0) / (total1 - total0) if total1 > total0 else 0.0
    return Result(side, len(calls), seconds, latencies, sum(ok), failures, steal)


def floor_call(python: str) -> Callable[[int, Call], Tuple[bool, str]]:
    def one(i: int, c: Call) -> Tuple[bool, str]:
        try:
            out = subprocess.run([python, "-c", c.code], input=c.stdin, capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return False, "timeout"
        good = out.returncode == 0 and out.stdout.rstrip("\n") == c.expected
        return good, "" if good else f"rc {out.returncode} stdout {out.stdout!r} stderr {out.stderr[-200:]!r}"

    return one


def verl_call(url: str) -> Callable[[int, Call], Tuple[bool, str]]:
    def one(i: int, c: Call) -> Tuple[bool, str]:
        score, meta = verl._process_single_case(i, c.stdin, c.expected, url, c.code, TIMEOUT, MEMORY_MB, "python")
        good = score is True
        detail = f"score {score!r} {meta.get('status')} {meta.get('api_request_error') or ''} {meta.get('stderr') or ''}"
        return good, "" if good else detail[:300]

    return one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ping(url: str, proc: subprocess.Popen, log: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no answer from {url} in {seconds:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (it was started in a session of its own), then
    SIGKILL after 15 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- SandboxFusion -------------------------------------------------------------------------------

def _netns() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _fusion_cgroups() -> set:
    found = set()
    for ctrl in ("memory", "cpu"):
        base = Path("/sys/fs/cgroup") / ctrl
        if base.is_dir():
            found |= {f"{ctrl}:{p.name}" for p in base.glob("sandbox_*_*") if p.is_dir()}
    return found


def _cleanup_lite(netns_before: set, cgroups_before: set) -> None:
    """What SandboxFusion's lite isolation leaves behind when its server stops: it keeps its
    network namespaces and cgroups in a pool for reuse and never removes them; an overlay of a
    call cut short stays mounted under /tmp/overlay_*."""
    for ns in _netns() - netns_before:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
    for cg in _fusion_cgroups() - cgroups_before:
        subprocess.run(["cgdelete", "-g", cg], capture_output=True)
    for base in Path("/tmp").glob("overlay_*"):
        merged = base / "merged"
        for sub in ("dev", "sys", "proc", ""):
            subprocess.run(["umount", "-l", str(merged / sub) if sub else str(merged)], capture_output=True)
        subprocess.run(["umount", "-l", str(base / "tmpfs")], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def fusion_server(args: argparse.Namespace, config: str) -> Iterator[str]:
    """SandboxFusion's server (`make run`'s uvicorn command) with config `config` (`ci`: lite,
    `local`: none); yields its `/run_code` URL.

    Its environment: PATH with the runtime's `python` first (SandboxFusion runs `python` from a
    conda env `sandbox-runtime`; scripts/bench-fusion makes one that is this machine's python3) and
    a HOME of its own: under uvloop a child's stdin is a socket, which makes bash read ~/.bashrc,
    and this machine's puts pyenv's shims first on PATH (0.5 s a call, another python)."""
    root = Path(args.fusion_dir)
    src, env_bin = root / "SandboxFusion", root / "conda" / "envs" / "sandbox" / "bin"
    port = free_port()
    log = root / f"server-{config}.log"
    env = dict(os.environ)
    env.update(
        SANDBOX_CONFIG=config,
        HOME=str(root / "home"),
        PATH=":".join([str(root / "shim"), str(root / "conda" / "envs" / "sandbox-runtime" / "bin"),
                       "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]),
    )
    netns_before, cgroups_before = _netns(), _fusion_cgroups()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(env_bin / "uvicorn"), "sandbox.server.server:app", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning"],
                                cwd=src, env=env, stdout=out, stderr=out, start_new_session=True)
    try:
        wait_ping(f"http://127.0.0.1:{port}/v1/ping", proc, log)
        yield f"http://127.0.0.1:{port}/run_code"
    finally:
        stop(proc)
        if config == "ci":
            _cleanup_lite(netns_before, cgroups_before)


# --- Sandman -------------------------------------------------------------------------------------

def sandman_server(args: argparse.Namespace, bin_path: str, daemon_path: Optional[str]) -> Iterator[str]:
    """`sandman serve` (`bin_path`, its sandboxes' daemon `daemon_path` or the one it finds) with a
    state directory of its own; yields the `/run_code` URL under the capability URL of job `bench`
    (`sandman job fusion-url bench`)."""
    binary = Path(bin_path)
    if not binary.exists():
        raise RuntimeError(f"no sandman binary at {binary}: cargo build --release -p sandman-cli -p sandmand")
    base = Path(args.fusion_dir)
    state = Path(tempfile.mkdtemp(prefix="sandman-", dir=base))
    log = state / "serve.log"
    token = secrets.token_hex(16)
    env = dict(os.environ, SANDMAN_TOKEN=token)
    env.pop("SANDMAN_URL", None)
    with open(log, "wb") as out:
        daemon = ["--daemon", daemon_path] if daemon_path else []
        proc = subprocess.Popen([str(binary), "serve", "--listen", "127.0.0.1:0", "--state-dir", str(state),
                                 *daemon, *args.sandman_arg], env=env, stdout=out, stderr=out, start_new_session=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None:
            m = re.search(r"sandman serving on (http://\S+)", log.read_text(errors="replace"))
            if m:
                url = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sandman serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
            else:
                time.sleep(0.05)
        cli_env = dict(os.environ, SANDMAN_URL=url, SANDMAN_TOKEN=token)

        def cli(*a: str) -> str:
            out = subprocess.run([str(binary), *a], env=cli_env, capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise RuntimeError(f"sandman {' '.join(a)}: {out.stderr}")
            return out.stdout

        cli("job", "put", "bench")
        lines = [line.strip() for line in cli("job", "fusion-url", "bench").splitlines() if line.strip()]
        capability = lines[-1].rstrip("/")
        wait_ping(f"{capability}/v1/ping", proc, log)
        yield f"{capability}/run_code"
    finally:
        stop(proc)
        shutil.copy(log, base / "sandman-last-serve.log")
        shutil.rmtree(state, ignore_errors=True)


# --- The run -------------------------------------------------------------------------------------

def run_side(args: argparse.Namespace, side: str, calls: List[Call], warmup: List[Call]) -> Result:
    def measure(one: Callable[[int, Call], Tuple[bool, str]]) -> Result:
        drive(side, warmup, min(args.in_flight, len(warmup)), one)
        return drive(side, calls, args.in_flight, one)

    if side == "floor":
        return measure(floor_call(args.python))
    gen = {
        "fusion-lite": lambda: fusion_server(args, "ci"),
        "fusion-none": lambda: fusion_server(args, "local"),
        "sandman": lambda: sandman_server(args, args.sandman_bin, args.sandman_daemon),
        "baseline": lambda: sandman_server(args, args.baseline_bin, args.baseline_daemon),
    }[side]()
    url = next(gen)
    try:
        return measure(verl_call(url))
    finally:
        gen.close()


def round_ratios(done: Dict[str, Result]) -> None:
    """Prints one round's ratios of Sandman to the other sides."""
    if "sandman" in done:
        others = [s for s in done if s != "sandman"]
        print("  this round: " + ", ".join(f"sandman/{s} {done['sandman'].rate / done[s].rate:.2f}x" for s in others),
              flush=True)


LABELS = {
    "floor": "floor (python3 -c, no server)",
    "fusion-lite": "SandboxFusion, isolation lite",
    "fusion-none": "SandboxFusion, isolation none",
    "sandman": "Sandman /fusion",
    "baseline": "Sandman /fusion, baseline build",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=512)
    p.add_argument("--cases", type=int, default=8)
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--warmup", type=int, default=16, help="calls before each side's timing, not counted")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the sides this many times, every other round in the reverse order; the summary "
                        "gives the median")
    p.add_argument("--sides", default="floor,fusion-lite,fusion-none",
                   help="comma-separated, run in this order: floor, fusion-lite, fusion-none, sandman, baseline")
    p.add_argument("--python", default="/usr/bin/python3", help="the floor's interpreter")
    p.add_argument("--fusion-dir", default="target/bench-fusion")
    p.add_argument("--sandman-bin", default="target/release/sandman")
    p.add_argument("--sandman-daemon", default=None,
                   help="the sandbox daemon `sandman serve` runs (its --daemon; default: the one it finds itself)")
    p.add_argument("--baseline-bin", default=None,
                   help="side `baseline`: another build's `sandman` (e.g. of the commit before a change)")
    p.add_argument("--baseline-daemon", default=None, help="side `baseline`: that build's sandbox daemon")
    p.add_argument("--sandman-arg", action="append", default=None,
                   help="an argument of `sandman serve` (repeat it; default: --create-rate 0, the one-machine "
                        "setting of docs/sandboxfusion.md)")
    args = p.parse_args()
    if args.sandman_arg is None:
        args.sandman_arg = ["--create-rate", "0"]
    for name, v in (("--programs", args.programs), ("--cases", args.cases), ("--in-flight", args.in_flight)):
        if not 1 <= v <= 100_000:
            p.error(f"{name} must be between 1 and 100000")
    if not 1 <= args.rounds <= 100:
        p.error("--rounds must be between 1 and 100")
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in LABELS]
    if unknown:
        p.error(f"unknown side(s) {unknown}: floor, fusion-lite, fusion-none, sandman, baseline")
    if "baseline" in sides and not args.baseline_bin:
        p.error("side baseline needs --baseline-bin (and --baseline-daemon for its daemon)")

    calls = reward_step(args.programs, args.cases)
    warmup = reward_step(max(1, args.warmup // args.cases + 1), args.cases)[: args.warmup] or calls[:1]
    print(f"reward step: {args.programs} programs x {args.cases} cases = {len(calls)} calls, {args.in_flight} "
          f"in flight, verl's client ({TIMEOUT} s timeout), on {os.cpu_count()} cores", flush=True)
    rounds: List[Dict[str, Result]] = []
    for n in range(args.rounds):
        if args.rounds > 1:
            print(f"round {n + 1} of {args.rounds}", flush=True)
        done: Dict[str, Result] = {}
        for side in sides if n % 2 == 0 else sides[::-1]:
            print(f"  running {LABELS[side]} ...", flush=True)
            r = done[side] = run_side(args, side, calls, warmup)
            print(f"  {LABELS[side]:32} {r.rate:8.1f} calls/s  p50 {r.pct(0.5):7.0f} ms  p99 {r.pct(0.99):7.0f} ms  "
                  f"correct {r.correct}/{r.calls}  steal {r.steal:.0%}", flush=True)
        rounds.append(done)
        if args.rounds > 1:
            round_ratios(done)

    # Each side's median round (by calls a second); one round: that round.
    results: Dict[str, Result] = {
        side: sorted((done[side] for done in rounds), key=lambda r: r.rate)[(len(rounds) - 1) // 2] for side in sides
    }
    print()
    print("calls/s: calls answered a second; right/s: calls scored right (1) a second; steal: the machine's time its "
          "hypervisor took")
    which = "median round" if len(rounds) > 1 else "side"
    print(f"{which:32} {'calls/s':>9} {'right/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'correct':>12} {'steal':>6}")
    for side, r in results.items():
        print(f"{LABELS[side]:32} {r.rate:9.1f} {r.good_rate:9.1f} {r.pct(0.5):8.0f} {r.pct(0.99):8.0f} "
              f"{f'{r.correct}/{r.calls}':>12} {r.steal:>6.0%}")
    print()

    def ratio(a: str, b: str, target: str = "") -> None:
        if a not in results or b not in results:
            return
        if len(rounds) == 1:
            ra, rb = results[a], results[b]
            good = f"{ra.good_rate / rb.good_rate:.2f}x" if rb.good_rate > 0 else "n/a (none scored right)"
            print(f"{a}/{b}: {ra.rate / rb.rate:.2f}x calls/s, {good} right/s{target}")
            return
        each = sorted(done[a].rate / done[b].rate for done in rounds)
        median = each[len(each) // 2] if len(each) % 2 else (each[len(each) // 2 - 1] + each[len(each) // 2]) / 2
        print(f"{a}/{b}: median {median:.2f}x calls/s over {len(each)} rounds (each: "
              f"{', '.join(f'{x:.2f}x' for x in each)}){target}")

    ratio("sandman", "floor", " (target >= 0.6)")
    ratio("sandman", "fusion-lite", " (target >= 8)")
    ratio("sandman", "fusion-none", " (target > 1)")
    ratio("sandman", "baseline")
    if "sandman" not in results:
        ratio("fusion-lite", "floor")
        ratio("fusion-none", "floor")

    bad = [r for done in rounds for r in done.values() if r.correct != r.calls]
    for r in bad:
        print(f"error: {LABELS[r.side]}: {r.calls - r.correct} of {r.calls} calls scored wrong, e.g.", file=sys.stderr)
        for f in r.failures[:5]:
            print(f"  {f}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
