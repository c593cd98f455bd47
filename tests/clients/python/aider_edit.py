"""Runs the real aider CLI one-shot (--message, streaming, no tools) through graft: it edits
hello.py in a temp dir. Prints one JSON line with the outcome.

usage: python aider_edit.py          (the python of the aider venv, .graft-test-env/aider)
env:   GRAFT_BASE_URL (including /v1), GRAFT_API_KEY, GRAFT_MODEL (default scripted).
       Sessions: put them in the URL (/s/{session}/v1).

The scripted upstream must answer a message containing "graft-aider-task" with a "whole"
edit (file name line, then a fenced block with the new file; tests/clients/script.json).
Nothing phones home: no git, no update check, no analytics, litellm's local cost map,
no model warnings, no repo map, no URL detection, model metadata from a local file (else
aider downloads litellm's price list); HOME is the temp dir.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ORIGINAL = 'def greet():\n    return "hello"\n\n\nif __name__ == "__main__":\n    print(greet())\n'
MESSAGE = "graft-aider-task: make greet() return 'hello from graft'."


def main() -> None:
    aider = Path(sys.executable).parent / "aider"
    model = os.environ.get("GRAFT_MODEL", "scripted")
    with tempfile.TemporaryDirectory(prefix="graft-aider-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        target = work / "hello.py"
        target.write_text(ORIGINAL)
        # Without metadata for the model aider downloads litellm's price list from GitHub.
        metadata = Path(tmp) / "model-metadata.json"
        metadata.write_text(
            json.dumps(
                {
                    f"openai/{model}": {
                        "max_input_tokens": 32768,
                        "max_output_tokens": 4096,
                        "max_tokens": 4096,
                        "input_cost_per_token": 0.0,
                        "output_cost_per_token": 0.0,
                        "litellm_provider": "openai",
                        "mode": "chat",
                    }
                }
            )
        )
        env = dict(os.environ)
        env.update(
            {
                "HOME": tmp,
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_TELEMETRY": "False",
                "AIDER_CHECK_UPDATE": "false",
                "AIDER_ANALYTICS": "false",
                "NO_COLOR": "1",
                "TERM": "dumb",
            }
        )
        cmd = [
            str(aider),
            "--model", f"openai/{model}",
            "--openai-api-base", os.environ["GRAFT_BASE_URL"],
            "--openai-api-key", os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
            "--model-metadata-file", str(metadata),
            "--edit-format", "whole",
            "--stream",
            "--no-git",
            "--yes-always",
            "--no-check-update",
            "--no-analytics",
            "--no-show-release-notes",
            "--no-show-model-warnings",
            "--no-pretty",
            "--no-fancy-input",
            "--no-detect-urls",
            "--map-tokens", "0",
            "--timeout", "60",
            "--message", MESSAGE,
            "hello.py",
        ]
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        edited = target.read_text()
        if p.returncode != 0:
            sys.stderr.write(f"aider failed with {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}\n")
            raise SystemExit(1)
        version = subprocess.run([str(aider), "--version"], env=env, capture_output=True, text=True, timeout=120).stdout.strip()
        out = {
            "client": "aider",
            "version": version,
            "message": MESSAGE,
            "original": ORIGINAL,
            "edited": edited,
            "changed": edited != ORIGINAL,
            "stdout_tail": p.stdout[-2000:],
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
