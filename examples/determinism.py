#!/usr/bin/env python3
"""Check a task's setup command before trusting it in an RL run.

A task whose setup writes something different in every fresh sandbox (a timestamp, a random
seed, a file fetched from the network) gives each episode a slightly different task, and the
rewards carry that noise. `check_determinism` runs the command once in each of several fresh
sandboxes of one spec and says whether the results agree, and if not, what differs.

    cargo run --release -p sandman-cli -- serve      # in another terminal
    pip install ./python
    python examples/determinism.py                   # two sample setups: one flagged, one not
    python examples/determinism.py -n 10 -p 5 -c 'pip download -q --no-deps requests -d /tmp/w && ls /tmp/w'

The server and token come from SANDMAN_URL / SANDMAN_TOKEN (or the server's token file), as for
every Sandman client; by default that is `sandman serve` on http://127.0.0.1:7777. It exits 1 when
a command's runs disagree.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Sequence

from sandman import DeterminismResult, Sandman

#: Two ways to set up the same toy task: the first stamps the task file with the time it was made,
#: the second pins what it writes.
SAMPLES = [
    "mkdir -p /tmp/task && echo \"made $(date +%s%N)\" > /tmp/task/README && sha256sum /tmp/task/README",
    "mkdir -p /tmp/task && echo 'made for episode 0' > /tmp/task/README && sha256sum /tmp/task/README",
]


def report(command: str, result: DeterminismResult) -> None:
    print(f"$ {command}")
    for n, run in enumerate(result.runs, 1):
        first = result.results[run.result].stdout.split("\n", 1)[0]
        print(
            f"  run {n:>2}  result {chr(ord('A') + run.result % 26)}  exit {run.exit_code}  "
            f"{run.duration_ms:>5} ms  cpu {run.cpu_ms:>4} ms  peak {run.max_rss_kib:>6} KiB  {first[:48]!r}"
        )
    if result.agree:
        print(f"  agree: all {len(result.runs)} runs gave the same exit status, stdout and stderr\n")
    else:
        print(
            f"  DIFFER: {len(result.runs)} runs gave {result.distinct} distinct results"
            f" ({', '.join(result.differs_in)} differs): do not trust this setup as it is\n"
        )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("-c", "--command", action="append", help="a setup command to check (repeatable)")
    parser.add_argument("-i", "--image", default="host", help="the task's image (default: host)")
    parser.add_argument("-n", "--runs", type=int, default=5, help="fresh sandboxes per command")
    parser.add_argument("-p", "--parallel", type=int, default=1, help="runs at once")
    args = parser.parse_args(argv)
    commands: List[str] = args.command or SAMPLES
    disagree = 0
    with Sandman() as client:
        for command in commands:
            result = client.check_determinism(
                args.image, command, runs=args.runs, parallel=args.parallel, lease=120, timeout=300
            )
            report(command, result)
            disagree += not result.agree
    print(f"{len(commands) - disagree} of {len(commands)} setup commands are deterministic")
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
