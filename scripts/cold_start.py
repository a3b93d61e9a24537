"""Cold start as a new visitor meets it: `python app.py` with empty caches (a fresh ENTMTP_CACHE
and TORCH_EXTENSIONS_DIR), seconds until the page is served, then seconds until a first 48-token
race (temperature 0) returns through the race API. Prints one JSON line.

    python scripts/cold_start.py            # empty caches (the worst case: a Space after a rebuild)
    python scripts/cold_start.py --warm     # the caches this machine already has
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RACE = ("Write a Python function that returns the n-th Fibonacci number iteratively.", "code", "tau", "hydra", 48, 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", action="store_true", help="keep this machine's caches instead of empty ones")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    from gradio_client import Client

    from entmtp.machine import device_name, hardware

    env = dict(os.environ)
    tmp = tempfile.mkdtemp(prefix="entmtp-cold-")
    if not args.warm:
        env.update(ENTMTP_CACHE=f"{tmp}/cache", TORCH_EXTENSIONS_DIR=f"{tmp}/ext")
    port = free_port()
    env.update(GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False")
    log = Path(tmp) / "app.log"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > args.timeout:
                print(log.read_text()[-3000:], file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        t_page = time.monotonic() - t0
        client = Client(url, verbose=False, download_files=False, analytics_enabled=False)
        t1 = time.monotonic()
        result = client.predict(*RACE, api_name="/race")
        t_race = time.monotonic() - t1
        same = bool(result[0]) and result[0] == result[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(json.dumps({"machine": f"{device_name()} ({hardware()})", "caches": "warm" if args.warm else "empty",
                      "page_s": round(t_page, 1), "first_race_s": round(t_race, 1), "race_tokens": RACE[4],
                      "identical_texts": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
