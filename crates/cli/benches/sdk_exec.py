"""The Python SDK's exec against a raw HTTP client, side by side: run by the service benchmark.

    python sdk_exec.py URL TOKEN SANDBOX_ID ROUNDS

Interleaves rounds of `Sandbox.exec(["/bin/true"])` (the sync SDK) with the same request made
by a bare kept-alive `httpx.Client` (one POST, the JSON parsed), and prints one line of JSON:
the p50 and p99 of each in microseconds.
"""

import json
import sys
import time

import httpx

import sandman


def pct(values, p):
    values = sorted(values)
    return values[round((len(values) - 1) * p)]


def main() -> None:
    url, token, sandbox_id, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    sdk = sandman.Sandman(url, token)
    sb = sdk.sandbox(sandbox_id)
    raw = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"})
    path = f"/v1/sandboxes/{sandbox_id}/exec"
    body = {"argv": ["/bin/true"]}

    def via_raw() -> None:
        r = raw.post(path, json=body)
        r.raise_for_status()
        assert r.json()["exit_code"] == 0

    def via_sdk() -> None:
        assert sb.exec(["/bin/true"]).exit_code == 0

    for _ in range(50):
        via_raw()
        via_sdk()
    times = {"sdk": [], "raw": []}
    while len(times["sdk"]) < rounds:
        for name, call in (("sdk", via_sdk), ("raw", via_raw)):
            for _ in range(25):
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
    out = {f"{name}_{p}": pct(v, q) * 1e6 for name, v in times.items() for p, q in (("p50", 0.5), ("p99", 0.99))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
