"""`commands.run("true")` through the real E2B SDK against the same command through Sandman's
own Python SDK, on one `sandman serve` (process provider), measured side by side in one run.

Both run `/bin/bash -l -c true` (what the E2B SDK sends for `commands.run("true")`) in the same
sandbox, interleaved call by call so that a noisy machine moves both alike. Prints p50, p99 and
the ratio. `SANDMAN_E2B_BENCH_N` sets the calls per path (default 300).

    ./scripts/test-harnesses e2b-bench
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandman_server import serve  # noqa: E402


def pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main() -> None:
    n = int(os.environ.get("SANDMAN_E2B_BENCH_N", "300"))
    gen = serve("e2b-bench")
    server = next(gen)
    try:
        os.environ.update(
            E2B_API_URL=f"{server.url}/e2b",
            E2B_SANDBOX_URL=f"{server.url}/e2b/envd",
            E2B_API_KEY=server.token,
        )
        from e2b import Sandbox

        sbx = Sandbox.create("base", timeout=600)
        client = server.client()
        ours = client.sandbox(sbx.sandbox_id)
        argv = ["/bin/bash", "-l", "-c", "true"]
        e2b_ms, ours_ms = [], []
        for _ in range(20):  # warm both paths
            sbx.commands.run("true")
            ours.exec(argv)
        for _ in range(n):
            t = time.perf_counter()
            sbx.commands.run("true")
            e2b_ms.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            r = ours.exec(argv)
            ours_ms.append((time.perf_counter() - t) * 1000)
            assert r.exit_code == 0
        sbx.kill()
        print(f"commands.run(\"true\"), {n} calls each, one sandbox, process provider")
        print(f"{'path':<36} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
        for name, xs in (("e2b SDK -> /e2b/envd", e2b_ms), ("sandman SDK -> /v1/.../exec", ours_ms)):
            print(f"{name:<36} {pct(xs, 50):>8.2f} {pct(xs, 99):>8.2f} {statistics.mean(xs):>8.2f}")
        print(f"ratio e2b/sandman: p50 {pct(e2b_ms, 50) / pct(ours_ms, 50):.2f}x, p99 {pct(e2b_ms, 99) / pct(ours_ms, 99):.2f}x")
    finally:
        gen.close()


if __name__ == "__main__":
    main()
