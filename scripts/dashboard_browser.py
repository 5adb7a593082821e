#!/usr/bin/env python3
"""Drives the dashboard of a real `sandman serve` in a headless Chromium, as an operator would.

It starts the server (process provider, isolation none, its own state directory and token), then:
a wrong token is refused; the right one signs in; a burst of 500 creates from two jobs appears on
the overview and drains; the table filtered to one job shows that job only; a failed sandbox's
page reads its reason; a sandbox released from its page is gone. A screenshot of every page goes
to the directory given with --shots (the docs' PNGs come from here). Exit 0 when every check held.

Run by ./scripts/test-dashboard, which installs Chromium, its driver and Selenium.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

TOKEN = "dashboard-test-token"
DEADLINE_S = 60


class Server:
    def __init__(self, binary, state_dir):
        env = dict(os.environ, SANDMAN_TOKEN=TOKEN, RUST_LOG="warn")
        # The burst below is held by the create rate. Memory admission is off: 500 sandboxes at
        # the 2Gi default would pass the machine's memory times four on any CI machine, and the
        # rest would wait for memory, not drain (attack_bounds.rs tests that wait).
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--state-dir", state_dir, "--isolation", "none",
             "--create-rate", "25", "--create-burst", "5", "--memory-overcommit", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
            # The server dies with this script however it ends.
            preexec_fn=lambda: __import__("ctypes").CDLL("libc.so.6").prctl(1, signal.SIGKILL),
        )
        # It says where it listens on stderr; the rest of its log is drained so that it never blocks.
        m = None
        for line in self.proc.stderr:
            m = re.search(r"serving on http://(\S+)", line)
            if m:
                break
        if not m:
            raise SystemExit("error: the server exited before saying where it listens")
        self.url = f"http://{m.group(1)}"
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"null")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def until(what, check, deadline_s=DEADLINE_S):
    """Polls an outside behaviour (the browser, the server) until `check` holds, with a deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def text(driver, css):
    try:
        return driver.find_element(By.CSS_SELECTOR, css).text
    except Exception:  # not there (yet)
        return ""


def click(driver, by, selector, what=None):
    """Clicks the element once it is there. The pages redraw live (at most once a second), so an
    element found may be replaced before it is clicked: then it is looked up again."""

    def attempt():
        try:
            driver.find_element(by, selector).click()
            return True
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    until(what or selector, attempt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandman", required=True)
    ap.add_argument("--shots", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    args = ap.parse_args()
    os.makedirs(args.shots, exist_ok=True)
    state = tempfile.mkdtemp(prefix="sandman-dashboard-")
    server = Server(args.sandman, state)
    opts = webdriver.ChromeOptions()
    opts.binary_location = args.chromium
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1440,1250",
              "--force-device-scale-factor=1", "--hide-scrollbars"]:
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(args.chromedriver), options=opts)
    checks = []

    def shot(name):
        path = os.path.join(args.shots, f"{name}.png")
        driver.save_screenshot(path)
        print(f"screenshot {path}")

    def ok(what):
        checks.append(what)
        print(f"ok: {what}")

    try:
        # A wrong token is refused, and the form stays.
        driver.get(server.url + "/ui")
        driver.find_element(By.ID, "token").send_keys("not-the-token")
        driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
        until("the refusal", lambda: "refused" in text(driver, "#login-error"))
        assert driver.find_element(By.ID, "top").get_attribute("hidden") is not None
        ok("a wrong token is refused")
        shot("login")

        # The fleet: two jobs, a warm pool, a setup that fails, a prepare run.
        server.call("PUT", "/v1/jobs/train", {"weight": 2, "max_sandboxes": 2000, "lease_s": 900})
        server.call("PUT", "/v1/jobs/eval", {"weight": 1, "max_sandboxes": 1000})
        server.call("PUT", "/v1/pools/warm", {"image": "host", "min_ready": 4, "max": 8})
        for i in range(3):
            r = server.call("POST", "/v1/sandboxes", {"image": "host", "job": "eval", "setup": [f"echo step {i}; exit 3"]})
            assert r.get("error", {}).get("reason") == "setup_failed", r
        server.call("POST", "/v1/prepare", {"images": ["host"], "job": "train"})

        # Sign in: the overview.
        box = driver.find_element(By.ID, "token")
        box.clear()
        box.send_keys(TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
        until("the overview", lambda: "Overview" in text(driver, "main h1"))
        until("the events stream", lambda: text(driver, "#live") == "events: live")
        assert TOKEN not in driver.current_url
        ok("the token signs in, and is not in the address")

        # A burst of 500 creates from the two jobs: it queues, shows, and drains.
        made = []
        lock = threading.Lock()

        def burst(job, n):
            for i in range(n):
                r = server.call("POST", "/v1/sandboxes",
                                {"image": "host", "job": job, "wait": False, "labels": {"task": f"t{i % 25}"}})
                with lock:
                    made.append(r["id"])

        threads = [threading.Thread(target=burst, args=(job, 25)) for job in ("train", "eval") for _ in range(10)]
        for t in threads:
            t.start()
        def queued():
            n = int(text(driver, '[data-state="queued"]').replace(",", "") or 0)
            return n if n > 0 else None

        seen_queued = until("queued creates on the overview", queued)
        # Mid-burst, once the charts have a few samples: the docs' picture of a burst.
        until("three metrics samples", lambda: driver.execute_script("return samples.length") >= 3 and queued())
        shot("overview-burst")
        for t in threads:
            t.join()
        until("the burst to drain", lambda: text(driver, '[data-state="queued"]') == "0"
              and text(driver, '[data-state="creating"]') == "0", deadline_s=120)
        ready = int(text(driver, '[data-state="ready"]').replace(",", ""))
        assert ready >= 500, ready
        ok(f"a burst of 500 creates appeared on the overview ({seen_queued} queued at once) and drained ({ready} ready)")
        time.sleep(6)
        shot("overview")

        # The table, filtered to one job.
        driver.get(server.url + "/ui/#/sandboxes")
        until("the table", lambda: "sandboxes match" in text(driver, ".toolbar"))
        job = driver.find_element(By.CSS_SELECTOR, 'input[aria-label="job"]')
        job.send_keys("eval")
        until("the filtered count", lambda: text(driver, ".toolbar span.muted").startswith("253 "))
        jobs = {td.text for td in driver.find_elements(By.CSS_SELECTOR, "tbody tr td:nth-child(3)")}
        assert jobs == {"eval"}, jobs
        ok("the table filtered to job eval shows its 253 sandboxes only")
        shot("sandboxes")

        # A failed sandbox's page reads its reason.
        driver.get(server.url + "/ui/#/sandboxes?state=failed")
        until("failed rows", lambda: text(driver, ".toolbar span.muted").startswith("3 "))
        click(driver, By.CSS_SELECTOR, "tbody tr.link")
        reason = until("the reason", lambda: text(driver, "#reason"))
        assert reason == "setup_failed", reason
        ok("a failed sandbox's page reads its reason (setup_failed)")
        shot("sandbox-failed")

        # A ready sandbox with a background process and its conditions record; then release it.
        sid = made[0]
        server.call("POST", f"/v1/sandboxes/{sid}/processes", {"argv": ["sleep", "300"], "tag": "server"})
        driver.get(server.url + f"/ui/#/sandboxes/{sid}")
        until("the sandbox page", lambda: driver.find_elements(By.ID, "list-processes"))
        click(driver, By.ID, "list-processes")
        until("its process", lambda: "sleep 300" in text(driver, "main"))
        click(driver, By.XPATH, "//button[normalize-space()='Take the conditions record']", "the record's button")
        until("the conditions record", lambda: "observed" in text(driver, "main").lower())
        shot("sandbox")
        click(driver, By.ID, "release")
        driver.switch_to.alert.accept()
        until("the sandbox gone", lambda: text(driver, ".kv .state") == "gone")
        assert text(driver, "#reason") == "released"
        assert server.call("GET", f"/v1/sandboxes/{sid}")["state"] == "gone"
        ok("a sandbox released from its page is gone (released)")

        for page in ("jobs", "pools", "prepare"):
            driver.get(server.url + f"/ui/#/{page}")
            until(page, lambda: "Loading" not in text(driver, "main") and text(driver, "main h1"))
            time.sleep(0.5)
            shot(page)
        # Release-all from the jobs page, confirmed.
        driver.get(server.url + "/ui/#/jobs")
        click(driver, By.CSS_SELECTOR, 'button[data-job="eval"]', "the jobs table's release-all of eval")
        driver.switch_to.alert.accept()
        until("eval released", lambda: server.call("GET", "/ui/api/sandboxes?job=eval&state=live")["total"] == 0)
        ok("release-all of job eval, confirmed, released its sandboxes")
    except Exception:
        shot("failure")
        print(f"failed at {driver.current_url}", file=sys.stderr)
        raise
    finally:
        driver.quit()
        for job in ("train", "eval"):
            server.call("DELETE", f"/v1/jobs/{job}")
        server.call("DELETE", "/v1/pools/warm")
        server.stop()
    print(f"{len(checks)} checks held")


if __name__ == "__main__":
    sys.exit(main())
