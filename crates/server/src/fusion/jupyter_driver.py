# Runs the cells of one `run_jupyter` call in a fresh python3 kernel, inside the call's sandbox,
# and writes what each cell printed, displayed and raised, in the shape SandboxFusion answers
# with (`CellRunResult`). Written into the sandbox by the server (crates/server/src/fusion).
import json
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
# The kernel's connection files and IPython's profile stay in the call's directory: the image's
# home may not be writable.
os.environ.setdefault("JUPYTER_RUNTIME_DIR", os.path.join(here, ".jupyter-runtime"))
os.environ.setdefault("IPYTHONDIR", os.path.join(here, ".ipython"))

from jupyter_client.manager import start_new_kernel  # noqa: E402

with open(os.path.join(here, ".sandman_jupyter_input.json")) as f:
    config = json.load(f)

status = "Finished"
results = []
km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
started = time.monotonic()
try:
    for cell in config["cells"]:
        left = config["total_timeout"] - (time.monotonic() - started)
        if left <= 0:
            status = "TimeLimitExceeded"
            break
        timeout = left if config["cell_timeout"] <= 0 else min(left, config["cell_timeout"])
        result = {"stdout": "", "stderr": "", "display": [], "error": []}

        def hook(msg, result=result):
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                result[content["name"]] += content["text"]
            elif kind in ("display_data", "execute_result"):
                result["display"].append(content["data"])
            elif kind == "error":
                result["error"].append(content)

        try:
            reply = kc.execute_interactive(cell, output_hook=hook, timeout=timeout)
        except TimeoutError:
            status = "TimeLimitExceeded"
            results.append(result)
            break
        result["status"] = reply["content"]["status"]
        results.append(result)
finally:
    try:
        km.shutdown_kernel(now=True)
    except Exception as e:  # the answer matters more than a clean kernel exit
        print(f"failed to shut the kernel down: {e}", file=sys.stderr)

with open(os.path.join(here, ".sandman_jupyter_output.json"), "w") as f:
    json.dump({"status": status, "cells": results}, f)
