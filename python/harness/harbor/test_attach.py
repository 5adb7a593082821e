"""`SandmanEnvironment.attach()`, what `harbor task start-env -i` calls: an interactive bash in
the sandbox on the caller's terminal. Driven here through a pseudo-terminal of our own, as a
person at a terminal would: type, read the screen, resize the window, exit."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import sys
import termios
import time
import textwrap

from sandman_server import Server

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, tempfile
    from pathlib import Path
    from harbor.models.task.config import EnvironmentConfig
    from harbor.models.trial.paths import TrialPaths
    from sandman.integrations.harbor import SandmanEnvironment

    url, token, image = sys.argv[1:4]
    tmp = Path(tempfile.mkdtemp())
    (tmp / "environment").mkdir()
    env = SandmanEnvironment(
        environment_dir=tmp / "environment", environment_name="attach", session_id="attach__x__env",
        trial_paths=TrialPaths(tmp / "trial"), task_env_config=EnvironmentConfig(docker_image=image, workdir="/w"),
        url=url, token=token, lease=60,
    )

    async def main():
        await env.start(force_build=False)
        try:
            print("sandbox", env.sandbox.id, flush=True)
            await env.attach()
        finally:
            await env.stop(delete=True)

    asyncio.run(main())
    """
)


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Screen:
    """What the program under our terminal shows."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.text = ""
        os.set_blocking(master, False)

    def wait_for(self, needle: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            assert time.monotonic() < deadline, f"{needle!r} never showed; the screen:\n{self.text}"
            try:
                self.text += os.read(self.master, 65536).decode("utf-8", "replace")
            except BlockingIOError:
                time.sleep(0.02)
            except OSError:  # the program closed the terminal
                assert needle in self.text, f"{needle!r} never showed; the screen:\n{self.text}"


def test_attach_is_an_interactive_shell_in_the_sandbox_that_follows_the_window(
    server: Server, image: str
) -> None:
    master, slave = os.openpty()
    set_size(slave, 24, 80)
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, server.url, server.token, image],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    screen = Screen(master)
    try:
        screen.wait_for("sandbox ")
        screen.wait_for("# ")  # bash's prompt, as root
        os.write(master, b"stty size; tty; pwd; echo attach-$((6*7))\r")
        screen.wait_for("attach-42")
        assert "24 80" in screen.text and "/dev/pts/" in screen.text and "/w\r\n" in screen.text
        # The window grows: the sandbox's terminal follows.
        set_size(master, 30, 100)
        proc.send_signal(signal.SIGWINCH)
        # The resize goes its own way to the sandbox: ask until the shell sees it (each answer
        # ends with a mark that only the shell's arithmetic prints, never the typed line).
        for i in range(300):
            os.write(master, f"stty size; echo mark-$((1000+{i}))\r".encode())
            screen.wait_for(f"mark-{1000 + i}")
            if "30 100" in screen.text:
                break
            time.sleep(0.1)
        assert "30 100" in screen.text, screen.text
        os.write(master, b"exit\r")
        assert proc.wait(60) == 0, screen.text
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert server.live_sandboxes() == []
