"""verl's own SandboxFusion client, unchanged, scores solutions against a real `sandman serve`.

verl (the `verl` package from PyPI, pinned in scripts/test-harnesses) computes code rewards with
`verl.utils.reward_score.sandbox_fusion.utils`: `check_correctness` fans one `POST /run_code` per
test case and `_process_single_case` maps each answer to a score:

- `status` Success and stdout equal to the expected output (trailing newlines aside): True (1);
  another stdout: False (0);
- `status` Failed with a `compile_result` whose status is Error/TimeLimitExceeded or whose
  return code is not 0: -4 (and every later case of the same solution is marked -4);
- `status` Failed with `run_result` TimeLimitExceeded: -3; Error or a non-zero return code: -2;
- `status` SandboxError, any HTTP error but 504, a reset connection: -1 (the reward is corrupted
  silently); HTTP 504 is retried, three attempts in all, 1 s then 2 s apart.

The client sends no credentials, so it talks to Sandman through a job's capability URL
(`sandman job fusion-url JOB`), used verbatim with `/run_code` appended, as verl's
`reward_model.sandbox_fusion.url` would be.

Two servers: one with the default admission, one saturated (`--fusion-max-calls 4`) where the
calls queue; on both, 256 calls in flight at once are all answered and all scored right.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sandman_server import Server, binary, serve  # noqa: E402

import verl_client  # noqa: E402

#: The verl release scripts/test-harnesses installs (`VERL_VERSION`).
VERL_VERSION = os.environ.get("SANDMAN_VERL_VERSION", "")

IN_FLIGHT = 256


verl = verl_client.load()


def test_the_pinned_verl_is_the_one_loaded() -> None:
    version = importlib.metadata.version("verl")
    if VERL_VERSION:
        assert version == VERL_VERSION
    assert hasattr(verl, "check_correctness") and hasattr(verl, "_process_single_case")


@dataclass
class Fusion:
    server: Server
    #: The job's capability URL (no credentials needed), e.g. `http://127.0.0.1:P/fusion/job/KEY`.
    base: str

    @property
    def run_code(self) -> str:
        return f"{self.base}/run_code"


def sandman_cli(server: Server, *args: str) -> str:
    env = dict(os.environ, SANDMAN_URL=server.url, SANDMAN_TOKEN=server.token)
    out = subprocess.run([str(binary()), *args], env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"sandman {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout


def fusion_url(server: Server, job: str) -> str:
    sandman_cli(server, "job", "put", job)
    lines = [line.strip() for line in sandman_cli(server, "job", "fusion-url", job).splitlines() if line.strip()]
    assert lines and lines[-1].startswith("http"), f"`sandman job fusion-url {job}` printed {lines!r}"
    return lines[-1].rstrip("/")


def start(name: str, args: List[str]) -> Iterator[Fusion]:
    gen = serve(name, args)
    server = next(gen)
    try:
        yield Fusion(server, fusion_url(server, "verl"))
    finally:
        gen.close()


#: The one-machine setting of docs/sandboxfusion.md: every call is a create, and the global create
#: rate (a pace meant for a cluster's API server) would be the bottleneck.
ONE_MACHINE = ["--create-rate", "0"]


@pytest.fixture(scope="module")
def fusion() -> Iterator[Fusion]:
    yield from start("verl", ONE_MACHINE)


@pytest.fixture(scope="module")
def saturated() -> Iterator[Fusion]:
    """A server that runs at most 4 calls at once: the others queue."""
    yield from start("verl-saturated", [*ONE_MACHINE, "--fusion-max-calls", "4"])


# --- Solutions and what verl must score them ------------------------------------------------

DOUBLE_PY = "n = int(input())\nprint(n * 2)\n"
CASES = {"inputs": ["1", "5", "-3", "100"], "outputs": ["2", "10", "-6", "200"]}

DOUBLE_CPP = """#include <iostream>
int main() { long n; std::cin >> n; std::cout << n * 2 << std::endl; return 0; }
"""


def have_gpp() -> bool:
    return shutil.which("g++") is not None


@dataclass
class Solution:
    name: str
    code: str
    language: str
    in_outs: dict
    expected: List[Any]
    timeout: int = 10


def solutions() -> List[Solution]:
    n = len(CASES["inputs"])
    sols = [
        Solution("python-right", DOUBLE_PY, "python", CASES, [True] * n),
        Solution("python-wrong", "n = int(input())\nprint(n + 2)\n", "python", CASES, [False] * n),
        # One case right, the others wrong: each case is scored on its own.
        Solution("python-partly-right", "n = int(input())\nprint(2 if n == 1 else 0)\n", "python", CASES,
                 [True] + [False] * (n - 1)),
        Solution("python-runtime-error", "n = int(input())\nraise ValueError(n)\n", "python", CASES, [-2] * n),
        Solution("python-exit-code", "import sys\nsys.exit(3)\n", "python", CASES, [-2] * n),
        Solution("python-syntax-error", "def f(:\n", "python", CASES, [-2] * n),
        Solution("python-timeout", "import time\ntime.sleep(60)\n", "python", CASES, [-3] * n, timeout=2),
        # verl's LeetCode-style wrapper: stdin holds the function's JSON arguments, one a line.
        Solution("python-fn-name", "class Solution:\n    def twice(self, x):\n        return x * 2\n", "python",
                 {"inputs": ["3", "[1]"], "outputs": ["6", "[1, 1]"], "fn_name": "twice"}, [True, True]),
    ]
    if have_gpp():
        sols += [
            Solution("cpp-right", DOUBLE_CPP, "cpp", CASES, [True] * n),
            Solution("cpp-compile-error", "int main( { return 0; }\n", "cpp", CASES, [-4] * n),
        ]
    else:
        # No C++ compiler on this machine: a compile error of another compiled language.
        assert shutil.which("rustc"), "neither g++ nor rustc: no compiled language to score a compile error with"
        sols += [Solution("rust-compile-error", "fn main() { let x: u32 = \"no\"; }\n", "rust", CASES, [-4] * n)]
    return sols


@pytest.mark.parametrize("sol", solutions(), ids=lambda s: s.name)
def test_verl_scores_each_kind_of_solution(fusion: Fusion, sol: Solution) -> None:
    results, metadata = verl.check_correctness(
        fusion.run_code, sol.in_outs, sol.code, timeout=sol.timeout, language=sol.language
    )
    assert results == sol.expected, [(m.get("status"), m.get("api_request_error"), m.get("api_response")) for m in metadata]
    for m in metadata:
        assert m.get("api_request_error") is None, m


def test_a_timeout_is_the_run_timeout_not_the_client_timeout(fusion: Fusion) -> None:
    """The call that times out answers TimeLimitExceeded itself, well before verl's request
    timeout (compile + run + 10 s), and with the run's own `execution_time`."""
    score, meta = verl._process_single_case(0, "", "", fusion.run_code, "import time\ntime.sleep(60)\n", 1, 1024,
                                            "python")
    assert score == -3, meta
    assert meta["api_status"] == "Failed" and meta["run_status"] == "TimeLimitExceeded"
    assert meta["duration"] is not None and meta["duration"] >= 1


# --- Many calls in flight -------------------------------------------------------------------

#: (code, stdin, expected output, expected score) of the calls in flight: right answers, wrong
#: answers and runtime errors, each answer a function of its stdin so none can pass for another.
def flight_call(i: int) -> Tuple[str, str, str, Any]:
    kind = i % 3
    if kind == 0:
        return ("print(int(input()) * 3 + 1)", str(i), str(i * 3 + 1), True)
    if kind == 1:
        return ("print(int(input()) * 3)", str(i), str(i * 3 + 1), False)
    return ("import sys\nn = int(input())\nsys.exit(n % 7 + 1)", str(i), "", -2)


def run_in_flight(url: str, calls: int, timeout: int = 10) -> List[Tuple[int, Any, dict]]:
    """`calls` calls through verl's `_process_single_case` (per-case `timeout`, verl's default
    10 s), from IN_FLIGHT threads that all send their first call at once (a barrier):
    IN_FLIGHT requests are in flight together."""
    barrier = threading.Barrier(IN_FLIGHT)
    results: List[Optional[Tuple[int, Any, dict]]] = [None] * calls

    def worker(t: int) -> None:
        barrier.wait()
        for i in range(t, calls, IN_FLIGHT):
            code, stdin, expected, _ = flight_call(i)
            score, meta = verl._process_single_case(i, stdin, expected, url, code, timeout, 1024, "python")
            results[i] = (i, score, meta)

    with ThreadPoolExecutor(max_workers=IN_FLIGHT) as pool:
        for f in [pool.submit(worker, t) for t in range(IN_FLIGHT)]:
            f.result()
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def assert_all_scored_right(results: List[Tuple[int, Any, dict]]) -> None:
    wrong = [(i, score, meta.get("status"), meta.get("api_request_error"), meta.get("api_response"))
             for i, score, meta in results if score != flight_call(i)[3] or type(score) is not type(flight_call(i)[3])]
    assert not wrong, f"{len(wrong)} of {len(results)} calls scored wrong, e.g. {wrong[:3]}"


def test_256_calls_in_flight_none_lost(fusion: Fusion) -> None:
    assert_all_scored_right(run_in_flight(fusion.run_code, 2 * IN_FLIGHT))


def test_saturated_server_queues_256_calls_in_flight_none_scored_wrong(saturated: Fusion) -> None:
    """At most 4 calls run at once; the other 252 wait in the server's queue and are answered in
    turn. A call may wait up to its run_timeout before it answers 504, which verl retries (three
    attempts, 1 s and 2 s apart); any other refusal would score -1 and fail here. verl's per-case
    timeout (a setting of its reward config) is 30 s here rather than its default 10 s: the test
    is of queueing, and the queue of one wave of 256 on a loaded machine must not run out of
    verl's three attempts (about 3 x 30 s) for a reason of throughput."""
    assert_all_scored_right(run_in_flight(saturated.run_code, IN_FLIGHT, timeout=30))


def test_saturated_server_answers_504_only_past_the_calls_run_timeout(saturated: Fusion) -> None:
    """Four calls that sleep hold the server's four places; a call with `run_timeout` 1 that
    cannot start answers 504 (the one status verl retries), and not before its second is up. The
    four sleepers are answered normally."""
    blockers = ThreadPoolExecutor(max_workers=4)
    sleeper = "import time\ntime.sleep(8)\nprint('done')\n"
    held = [blockers.submit(verl._process_single_case, k, "", "done", saturated.run_code, sleeper, 20, 1024, "python")
            for k in range(4)]
    probe = {"code": "print(1)", "language": "python", "run_timeout": 1, "compile_timeout": 1,
             "memory_limit_MB": 1024, "stdin": "", "files": {}, "fetch_files": []}
    gateway_timeouts = 0
    try:
        # Until the sleepers are done: a probe either waits past its second and gets 504, or (while
        # the sleepers' calls are still on their way in) runs and answers normally.
        while not all(f.done() for f in held) and gateway_timeouts < 3:
            begun = time.monotonic()
            resp = requests.post(saturated.run_code, json=probe, timeout=30)
            waited = time.monotonic() - begun
            if resp.status_code == 504:
                gateway_timeouts += 1
                assert waited >= 1.0, f"504 after {waited:.2f}s, before the call's run_timeout of 1 s"
            else:
                assert resp.status_code == 200, (resp.status_code, resp.text)
                body = resp.json()
                assert body["status"] == "Success" and body["run_result"]["stdout"] == "1\n", body
        for f in held:
            score, meta = f.result()
            assert score is True, meta
    finally:
        blockers.shutdown(wait=True)
    assert gateway_timeouts > 0, "no probe answered 504 while the four places were held"


# --- The credential ---------------------------------------------------------------------------

def test_calls_without_a_credential_are_refused_and_verl_scores_them_minus_1(fusion: Fusion) -> None:
    bare = f"{fusion.server.url}/fusion/run_code"
    resp = requests.post(bare, json={"code": "print(1)", "language": "python"}, timeout=30)
    assert resp.status_code in (401, 403), (resp.status_code, resp.text)
    score, meta = verl._process_single_case(0, "1", "2", bare, DOUBLE_PY, 10, 1024, "python")
    assert score == -1 and meta["status"] == "api_error", meta


def test_the_servers_token_is_accepted_as_a_bearer_header(fusion: Fusion) -> None:
    resp = requests.post(
        f"{fusion.server.url}/fusion/run_code",
        json={"code": DOUBLE_PY, "language": "python", "stdin": "21"},
        headers={"Authorization": f"Bearer {fusion.server.token}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["run_result"]["stdout"] == "42\n"


def test_a_revoked_capability_url_is_refused(fusion: Fusion) -> None:
    base = fusion_url(fusion.server, "verl-revoked")
    score, meta = verl._process_single_case(0, "21", "42", f"{base}/run_code", DOUBLE_PY, 10, 1024, "python")
    assert score is True, meta
    ping = requests.get(f"{base}/v1/ping", timeout=30)
    assert ping.status_code == 200, ping.text
    sandman_cli(fusion.server, "job", "fusion-url", "verl-revoked", "--revoke")
    resp = requests.post(f"{base}/run_code", json={"code": "print(1)", "language": "python"}, timeout=30)
    assert resp.status_code in (401, 403), (resp.status_code, resp.text)
    score, meta = verl._process_single_case(0, "21", "42", f"{base}/run_code", DOUBLE_PY, 10, 1024, "python")
    assert score == -1 and meta["status"] == "api_error", meta
    # The other job's URL still works.
    score, meta = verl._process_single_case(0, "21", "42", fusion.run_code, DOUBLE_PY, 10, 1024, "python")
    assert score is True, meta
