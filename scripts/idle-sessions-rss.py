"""Memory of sessions that are never closed: the RSS of one graft gateway (passthrough to the
scripted upstream, async durability) after N sessions each make CALLS chat calls with a
BODY_KB-KB first message and are never closed. The retry bookkeeping
(`limits.retry_memory_*`) and the recorder's delta bases (`recorder.delta_base_sessions`) are
bounded over all sessions, so past those bounds RSS stops growing with N.

usage: python scripts/idle-sessions-rss.py GRAFT_BIN N CALLS BODY_KB [GRAFT_TOML]
       (a python with httpx: .graft-test-env/py/bin/python). Prints one JSON line.
Results and the exact commands: docs/BENCHMARKS.md, "Sessions never closed".
"""

import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    for line in p.stdout:
        m = re.search(r"listening on\s+(\S+)", line)
        if m:
            out = p.stdout
            threading.Thread(target=lambda: [None for _ in out], daemon=True).start()
            return p, m.group(1).rstrip("/")
    raise SystemExit(f"{cmd[1]} did not start")


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise SystemExit("no VmRSS")


def main() -> None:
    graft, n, calls, kb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    config = sys.argv[5:6]
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "script.json"
        script.write_text('{"rules": []}')  # every answer echoes the last user message
        up, up_url = start([graft, "scripted-upstream", "--listen", "127.0.0.1:0", "--script", str(script)])
        gw_cmd = [graft, "gateway", "--listen", "127.0.0.1:0", "--upstream", up_url + "/v1",
                  "--data-dir", f"{d}/data", "--durability", "async"]
        if config:
            gw_cmd += ["--config", config[0]]
        gw, gw_url = start(gw_cmd)
        # The admin key the gateway generated into its data dir (none when the config sets one).
        key_file = Path(d) / "data" / "admin.key"
        admin = {"authorization": "Bearer " + key_file.read_text().strip()} if key_file.exists() else {}
        c = httpx.Client(timeout=60)
        text = "x " * (kb * 512)

        def session(i: int) -> None:
            s = c.post(gw_url + "/graft/sessions", json={"group_id": "g"}, headers=admin).json()
            msgs = [{"role": "user", "content": f"{i} {text}"}]
            for t in range(calls):
                r = c.post(f"{gw_url}/s/{s['session_id']}/v1/chat/completions",
                           json={"model": "m", "messages": msgs},
                           headers={"authorization": "Bearer " + s["api_key"]})
                r.raise_for_status()
                msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {t}"}]

        for i in range(20):
            session(-1 - i)
        before = rss_mib(gw.pid)
        t = time.time()
        for i in range(n):
            session(i)
        time.sleep(2)
        print(json.dumps({"sessions": n, "calls_each": calls, "body_kb": kb, "config": config[0] if config else None,
                          "rss_mib_after_warmup": before, "rss_mib_after": rss_mib(gw.pid),
                          "secs": round(time.time() - t, 1)}))
        for p in (gw, up):
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
