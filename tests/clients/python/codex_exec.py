"""Runs the real Codex CLI (`codex exec`, npm @openai/codex) on a two-turn task through
graft's Responses dialect and prints one JSON line with the outcome.

usage: python codex_exec.py
env:   GRAFT_CODEX_BIN     the codex launcher (.graft-test-env/codex/node_modules/.bin/codex)
       GRAFT_CODEX_CONFIG  a config.toml made by `graft harness config codex --session URL`
                           (provider block with wire_api = "responses", env_key GRAFT_API_KEY,
                           update check / analytics / plugins off)
       GRAFT_API_KEY       the key Codex sends (the provider's env_key)
       GRAFT_CODEX_TASK    the task, when not the default one below (a test's own script
                           answers it)

The scripted upstream must answer (tests/clients/script.json):
  1. user message containing "graft-codex-task" -> exec_command
     {"cmd": "echo graft-codex-step-done > codex_result.txt && cat codex_result.txt"}
  2. tool output containing "graft-codex-step-done" -> the final message
Codex runs in a fresh temp dir with a temp CODEX_HOME and HOME (no user config, no login
shell profile), so the run takes exactly two model calls and touches nothing else.
"""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

TASK = os.environ.get(
    "GRAFT_CODEX_TASK",
    "graft-codex-task: write the word graft-codex-step-done into codex_result.txt.",
)


def main() -> None:
    codex = os.environ["GRAFT_CODEX_BIN"]
    with tempfile.TemporaryDirectory(prefix="graft-codex-") as tmp:
        home = Path(tmp) / "codex-home"
        work = Path(tmp) / "work"
        home.mkdir()
        work.mkdir()
        shutil.copy(os.environ["GRAFT_CODEX_CONFIG"], home / "config.toml")
        last = Path(tmp) / "last-message.txt"
        env = dict(os.environ)
        env.update(
            {
                "CODEX_HOME": str(home),
                "HOME": tmp,
                "NO_COLOR": "1",
                "TERM": "dumb",
                "RUST_LOG": "warn",
            }
        )
        env.pop("OPENAI_API_KEY", None)
        env.pop("OPENAI_BASE_URL", None)
        cmd = [
            codex,
            "exec",
            "--dangerously-bypass-approvals-and-sandbox",
            "--skip-git-repo-check",
            "--ephemeral",
            "--color", "never",
            "-o", str(last),
            TASK,
        ]
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
        result = work / "codex_result.txt"
        if p.returncode != 0:
            raise SystemExit(
                f"codex exec failed with {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
            )
        version = subprocess.run([codex, "--version"], env=env, capture_output=True, text=True, timeout=60).stdout.strip()
        out = {
            "client": "codex",
            "version": version,
            "task": TASK,
            "result_txt": result.read_text() if result.exists() else None,
            "last_message": last.read_text() if last.exists() else None,
            "stdout_tail": p.stdout[-2000:],
            "stderr_tail": p.stderr[-2000:],
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
