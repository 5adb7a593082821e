#!/usr/bin/env python3
"""A rollout on Sandman: N concurrent episodes, each one sandbox.

Each episode creates a sandbox, writes a small Python project whose test fails, runs the test
(reward 0), applies the fix, runs the test again (reward 1), and releases the sandbox. At the end
it prints throughput and latency percentiles.

    cargo run --release -p sandman-cli -- serve      # in another terminal
    pip install ./python
    python examples/rollout.py                       # 200 episodes at once
    python examples/rollout.py -n 1000 -c 250        # 1000 episodes, 250 at a time
    python examples/rollout.py --threads             # the sync client, one thread per episode

The server and token come from SANDMAN_URL / SANDMAN_TOKEN (or the server's token file), as for
every Sandman client. All episodes belong to one job, whose heartbeat keeps their sandboxes alive
while they run; a sandbox that a crashed episode leaves behind is reclaimed once its lease lapses.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from sandman import AsyncSandbox, AsyncSandman, Sandbox, Sandman

CALC = '''\
def add(a, b):
    return a - b  # the bug: subtracts


def mul(a, b):
    return a * b
'''

CALC_FIXED = CALC.replace("return a - b  # the bug: subtracts", "return a + b")

TEST = '''\
import unittest

from calc import add, mul


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)


if __name__ == "__main__":
    unittest.main()
'''

#: What runs the test in the project directory; its exit code is the reward signal.
TEST_COMMAND = "cd {dir} && {python} -B -m unittest -q test_calc"


@dataclass
class Episode:
    sandbox: str
    rewards: List[int]
    #: Seconds spent in each step.
    steps: Dict[str, float]
    total: float


@dataclass
class Summary:
    episodes: List[Episode]
    failures: List[str]
    wall: float
    job: str
    sandbox_ids: List[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return len(self.episodes) / self.wall if self.wall > 0 else 0.0

    def report(self) -> str:
        ok = sum(1 for e in self.episodes if e.rewards == [0, 1])
        lines = [
            f"{len(self.episodes)} episodes ({ok} rewarded 0 then 1, {len(self.failures)} failed) "
            f"in {self.wall:.2f} s: {self.throughput:.1f} episodes/s",
            f"{'latency (ms)':<16}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}",
        ]
        rows = ["episode", "create", "write", "test", "release"]
        for name in rows:
            values = [e.total if name == "episode" else e.steps[name] for e in self.episodes]
            if not values:
                continue
            cells = "".join(f"{1000 * percentile(values, q):>9.1f}" for q in (50, 90, 99, 100))
            lines.append(f"{name:<16}{cells}")
        for f in self.failures[:5]:
            lines.append(f"failure: {f}")
        return "\n".join(lines)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile `q` (0-100) of `values`."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


# ---- asyncio: one task per episode ----


async def episode_async(client: AsyncSandman, job: str, lease: int, python: str) -> Episode:
    steps = dict.fromkeys(["create", "write", "test", "release"], 0.0)
    start = time.perf_counter()
    t = time.perf_counter()
    sb: AsyncSandbox
    async with await client.create("host", job=job, lease=lease) as sb:
        steps["create"] = time.perf_counter() - t
        project = f"/tmp/rollout/{sb.id}"
        test = TEST_COMMAND.format(dir=project, python=python)
        rewards = []

        t = time.perf_counter()
        await sb.write_file(f"{project}/calc.py", CALC)
        await sb.write_file(f"{project}/test_calc.py", TEST)
        steps["write"] += time.perf_counter() - t

        t = time.perf_counter()
        rewards.append(int((await sb.exec(test, timeout=60)).ok))
        steps["test"] += time.perf_counter() - t

        t = time.perf_counter()
        await sb.write_file(f"{project}/calc.py", CALC_FIXED)  # the agent's fix
        steps["write"] += time.perf_counter() - t

        t = time.perf_counter()
        rewards.append(int((await sb.exec(test, timeout=60)).ok))
        steps["test"] += time.perf_counter() - t
        t = time.perf_counter()
    steps["release"] = time.perf_counter() - t
    return Episode(sb.id, rewards, steps, time.perf_counter() - start)


async def run_async(
    n: int, concurrency: int, url: Optional[str], token: Optional[str], lease: int, job: str, python: str
) -> Summary:
    limit = asyncio.Semaphore(concurrency)
    async with AsyncSandman(url, token) as client:
        async with await client.job(job, lease=lease) as j:

            async def one() -> Episode:
                async with limit:
                    return await episode_async(client, j.name, lease, python)

            start = time.perf_counter()
            results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
            wall = time.perf_counter() - start
    return summarize(results, wall, job)


# ---- threads: the sync client, one thread per concurrent episode ----


def episode_sync(client: Sandman, job: str, lease: int, python: str) -> Episode:
    steps = dict.fromkeys(["create", "write", "test", "release"], 0.0)
    start = time.perf_counter()
    t = time.perf_counter()
    sb: Sandbox
    with client.create("host", job=job, lease=lease) as sb:
        steps["create"] = time.perf_counter() - t
        project = f"/tmp/rollout/{sb.id}"
        test = TEST_COMMAND.format(dir=project, python=python)
        rewards = []

        t = time.perf_counter()
        sb.write_file(f"{project}/calc.py", CALC)
        sb.write_file(f"{project}/test_calc.py", TEST)
        steps["write"] += time.perf_counter() - t

        t = time.perf_counter()
        rewards.append(int(sb.exec(test, timeout=60).ok))
        steps["test"] += time.perf_counter() - t

        t = time.perf_counter()
        sb.write_file(f"{project}/calc.py", CALC_FIXED)
        steps["write"] += time.perf_counter() - t

        t = time.perf_counter()
        rewards.append(int(sb.exec(test, timeout=60).ok))
        steps["test"] += time.perf_counter() - t
        t = time.perf_counter()
    steps["release"] = time.perf_counter() - t
    return Episode(sb.id, rewards, steps, time.perf_counter() - start)


def run_threads(
    n: int, concurrency: int, url: Optional[str], token: Optional[str], lease: int, job: str, python: str
) -> Summary:
    with Sandman(url, token) as client, client.job(job, lease=lease) as j:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="episode") as pool:
            futures = [pool.submit(episode_sync, client, j.name, lease, python) for _ in range(n)]
        results: List[object] = []
        for f in futures:
            e = f.exception()
            results.append(e if e is not None else f.result())
        wall = time.perf_counter() - start
    return summarize(results, wall, job)


def summarize(results: Sequence[object], wall: float, job: str) -> Summary:
    episodes = [r for r in results if isinstance(r, Episode)]
    failures = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    failures += [f"episode in {e.sandbox} rewarded {e.rewards}, not [0, 1]" for e in episodes if e.rewards != [0, 1]]
    return Summary(episodes, failures, wall, job, [e.sandbox for e in episodes])


def run(
    n: int = 200,
    concurrency: Optional[int] = None,
    *,
    url: Optional[str] = None,
    token: Optional[str] = None,
    threads: bool = False,
    lease: int = 60,
    job: Optional[str] = None,
    python: str = "python3",
) -> Summary:
    """Runs `n` episodes, `concurrency` (default all) at a time, in one job; `python` is the
    interpreter that runs the project's test in the sandbox."""
    concurrency = concurrency or n
    job = job or f"rollout-{uuid.uuid4().hex[:8]}"
    if threads:
        return run_threads(n, concurrency, url, token, lease, job, python)
    return asyncio.run(run_async(n, concurrency, url, token, lease, job, python))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("-n", "--episodes", type=int, default=200, help="episodes to run (default 200)")
    p.add_argument("-c", "--concurrency", type=int, default=None, help="episodes at once (default: all)")
    p.add_argument("--threads", action="store_true", help="use the sync client from threads, not asyncio")
    p.add_argument("--lease", type=int, default=60, help="lease of each sandbox, seconds (default 60)")
    p.add_argument("--job", default=None, help="job name (default: rollout-<random>)")
    p.add_argument("--python", default="python3", help="interpreter in the sandbox (default python3)")
    p.add_argument("--url", default=None, help="server URL (default: $SANDMAN_URL)")
    p.add_argument("--token", default=None, help="server token (default: $SANDMAN_TOKEN or the token file)")
    args = p.parse_args(argv)
    if args.threads and (args.concurrency or args.episodes) > threading.active_count() + 4096:
        print("error: too many threads", file=sys.stderr)
        return 2
    summary = run(
        args.episodes,
        args.concurrency,
        url=args.url,
        token=args.token,
        threads=args.threads,
        lease=args.lease,
        job=args.job,
        python=args.python,
    )
    print(summary.report())
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
