#!/usr/bin/env python3
"""What an agent harness uses from a sandbox, one step each: a terminal, merged output, a session
whose timeout keeps the shell, a default user, and a web server reached through Sandman.

    cargo run --release -p sandman-cli -- serve      # in another terminal
    pip install ./python
    python examples/harness_features.py

The server and token come from SANDMAN_URL / SANDMAN_TOKEN (or the server's token file), as for
every Sandman client. It prints what each step saw and exits 0 when all of them did what they
should.
"""

from __future__ import annotations

import sys
import time

from sandman import Sandman


def main() -> int:
    with Sandman() as client, client.create("host", lease=120) as sb:
        # A Python REPL on a terminal: prompt, answer, resize.
        py = sb.pty(["python3", "-i", "-q"], rows=24, cols=80, tag="repl")
        py.read_until(">>> ")
        py.write("print(6 * 7)\r")
        print("repl answered:", py.read_until(">>> ").splitlines()[1].strip())
        py.resize(40, 120)
        py.write("import shutil; shutil.get_terminal_size()\r")
        print("repl sees:", py.read_until("lines=40)").splitlines()[-1].strip())
        py.write(b"\x04")  # Ctrl-D ends the REPL
        py.wait(timeout=10)

        # stdout and stderr as a terminal interleaves them.
        merged = sb.exec("echo one; echo two >&2; echo three", merge_output=True)
        print("merged output:", merged.stdout.split())

        # A session whose command times out: the shell and its state stay.
        with sb.session() as sh:
            sh.run("cd /tmp && export STEP=kept")
            timed = sh.run("sleep 60", timeout=1)
            after = sh.run('echo "$PWD $STEP"')
            print("timed out:", timed.timed_out, "| then:", after.stdout.strip())

        # A web server in the sandbox, answering through the server.
        sb.write_file("/tmp/site/index.html", "<h1>hello from a sandbox</h1>\n")
        sb.start("exec python3 -m http.server 8765 --bind 127.0.0.1 --directory /tmp/site", tag="web")
        with sb.port_client(8765) as http:
            for _ in range(100):
                r = http.get("/")
                if r.status_code == 200:
                    break
                time.sleep(0.1)  # the server is still starting (503: nothing answers yet)
            print("web:", r.status_code, r.text.strip())
        ok = merged.stdout == "one\ntwo\nthree\n" and timed.timed_out and after.stdout == "/tmp kept\n"
        ok = ok and r.status_code == 200

    # A sandbox whose commands run as another user unless a call names one.
    with Sandman() as client, client.create("host", lease=60, user="65534") as sb:
        uid = sb.exec(["id", "-u"], cwd="/").stdout.strip()
        print("default user:", sb.info.user, "| id -u:", uid)
    return 0 if ok and uid == "65534" else 1


if __name__ == "__main__":
    sys.exit(main())
