"""The plain-SDK "harness": the openai Python SDK in a minimal agent loop with one `bash`
tool, streaming, pointed at graft through OPENAI_BASE_URL / OPENAI_API_KEY (what envd
injects) and GRAFT_MODEL (default: the first model the sandbox names, OPENAI_MODEL).

usage: python sdk_tool_loop.py TASK   (runs in the current directory, at most 5 calls)
"""

import json
import os
import subprocess
import sys

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the current directory",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]


def main() -> None:
    client = OpenAI()
    model = os.environ.get("GRAFT_MODEL") or os.environ.get("OPENAI_MODEL") or "default"
    messages = [{"role": "system", "content": "You run shell commands to do tasks."},
                {"role": "user", "content": sys.argv[1]}]
    for _ in range(5):
        stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                stream=True)
        content, calls = "", {}
        for chunk in stream:
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
        msg = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]
        messages.append(msg)
        if not calls:
            print(json.dumps({"client": "openai-python-sdk", "answer": content}))
            return
        for c in calls.values():
            cmd = json.loads(c["arguments"])["command"]
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": p.stdout + p.stderr})
    raise SystemExit("no answer after 5 calls")


if __name__ == "__main__":
    main()
