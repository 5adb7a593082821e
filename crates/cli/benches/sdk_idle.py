"""The Python SDK's exec after idle gaps, beside its floors: run by the idle benchmark.

    python sdk_idle.py URL TOKEN SANDBOX_ID GAP_MS:ROUNDS[,GAP_MS:ROUNDS...]

For each gap, in rounds that interleave the three, each call waits out the gap and is then
timed: `Sandbox.exec(["/bin/true"])` (the sync SDK), the same request made by a bare kept-alive
`http.client` connection (the JSON parsed), and `os.posix_spawn` of `/bin/true` (waited for).
Prints one line of JSON: per gap, the p50 of each in microseconds and the rounds.
"""

import http.client
import json
import os
import sys
import time
import urllib.parse

import sandman


def p50(values):
    values = sorted(values)
    return values[round((len(values) - 1) * 0.5)]


def main() -> None:
    url, token, sandbox_id, plan = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    sb = sandman.Sandman(url, token).sandbox(sandbox_id)
    parsed = urllib.parse.urlsplit(url)
    raw = http.client.HTTPConnection(parsed.hostname, parsed.port)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    path = f"/v1/sandboxes/{sandbox_id}/exec"
    body = json.dumps({"argv": ["/bin/true"]})

    def via_raw() -> None:
        raw.request("POST", path, body=body, headers=headers)
        r = raw.getresponse()
        assert r.status == 200 and json.loads(r.read())["exit_code"] == 0

    def via_sdk() -> None:
        assert sb.exec(["/bin/true"]).exit_code == 0

    def spawn() -> None:
        pid = os.posix_spawn("/bin/true", ["/bin/true"], os.environ)
        assert os.waitpid(pid, 0)[1] == 0

    calls = (("sdk", via_sdk), ("raw", via_raw), ("spawn", spawn))
    for _ in range(30):
        for _, call in calls:
            call()
    out = {}
    for step in plan.split(","):
        gap_ms, rounds = (int(v) for v in step.split(":"))
        times = {name: [] for name, _ in calls}
        for r in range(rounds):
            for k in range(len(calls)):
                name, call = calls[(k + r) % len(calls)]
                for _ in range(10 if gap_ms == 0 else 1):
                    if gap_ms:
                        time.sleep(gap_ms / 1e3)
                    t = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - t)
        out[str(gap_ms)] = {name: p50(v) * 1e6 for name, v in times.items()}
        out[str(gap_ms)]["n"] = len(times["sdk"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
