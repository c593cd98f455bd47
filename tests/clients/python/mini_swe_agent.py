"""Runs the real mini-swe-agent CLI (`mini`, v2.x) on a one-step task through graft and
prints one JSON line with the outcome.

usage: python mini_swe_agent.py          (the python of the venv that has mini-swe-agent)
env:   GRAFT_BASE_URL (including /v1), GRAFT_API_KEY, GRAFT_MODEL (default scripted).
       Sessions: put them in the URL (/s/{session}/v1); mini has no header flag.

The scripted upstream must answer (tests/clients/script.json):
  1. user message containing "graft-mini-task" -> bash: echo graft-mini-step-one-done > result.txt && cat result.txt
  2. tool message containing "graft-mini-step-one-done" -> bash: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT
mini finishes when a command's output starts with COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT
(returncode 0), so the run takes exactly two model calls. It runs in a fresh temp dir
with its global config dir inside it, and nothing phones home (litellm's local cost map,
no first-run setup wizard, cost tracking errors ignored for the unknown model).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TASK = "graft-mini-task: write the word graft-mini-step-one-done into result.txt, then submit."


def main() -> None:
    bin_dir = Path(sys.executable).parent
    mini = bin_dir / "mini"
    model = os.environ.get("GRAFT_MODEL", "scripted")
    with tempfile.TemporaryDirectory(prefix="graft-mini-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        traj = Path(tmp) / "traj.json"
        env = dict(os.environ)
        env.update(
            {
                "OPENAI_BASE_URL": os.environ["GRAFT_BASE_URL"],
                "OPENAI_API_KEY": os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
                "MSWEA_CONFIGURED": "true",
                "MSWEA_GLOBAL_CONFIG_DIR": str(Path(tmp) / "config"),
                "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_TELEMETRY": "False",
                "HOME": tmp,
                "NO_COLOR": "1",
            }
        )
        cmd = [
            str(mini),
            "-m", f"openai/{model}",
            "-t", TASK,
            "-y",
            "--exit-immediately",
            "-l", "0",
            "-o", str(traj),
            "-c", "mini.yaml",
            "-c", "agent.step_limit=5",
        ]
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        if p.returncode != 0 or not traj.exists():
            sys.stderr.write(f"mini failed with {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}\n")
            raise SystemExit(1)
        data = json.loads(traj.read_text())
        messages = data.get("messages", [])
        info = data.get("info", {})
        assistant = [m for m in messages if m.get("role") == "assistant"]
        result = work / "result.txt"
        out = {
            "client": "mini-swe-agent",
            "version": info.get("mini_version"),
            "exit_status": info.get("exit_status"),
            "submission": info.get("submission"),
            "model_calls": len(assistant),
            "api_calls": info.get("model_stats", {}).get("api_calls"),
            "assistant": [
                {
                    "content": m.get("content"),
                    "tool_calls": [
                        {"id": tc["id"], "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}
                        for tc in (m.get("tool_calls") or [])
                    ],
                }
                for m in assistant
            ],
            "result_txt": result.read_text() if result.exists() else None,
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
