"""The plain-SDK "harness" on the Anthropic wire: the anthropic Python SDK in a minimal agent
loop with one `bash` tool, streaming Messages, pointed at graft through ANTHROPIC_BASE_URL /
ANTHROPIC_API_KEY (what envd injects) and GRAFT_MODEL.

usage: python anthropic_tool_loop.py TASK   (runs in the current directory, at most 5 calls)
"""

import json
import os
import subprocess
import sys

import anthropic

TOOLS = [{"name": "bash", "description": "Run a shell command in the current directory",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}]


def main() -> None:
    client = anthropic.Anthropic()
    model = os.environ.get("GRAFT_MODEL") or "default"
    messages = [{"role": "user", "content": sys.argv[1]}]
    for _ in range(5):
        with client.messages.stream(model=model, max_tokens=1024, system="You run shell commands to do tasks.",
                                    messages=messages, tools=TOOLS) as stream:
            msg = stream.get_final_message()
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        uses = [b for b in msg.content if b.type == "tool_use"]
        if not uses:
            text = "".join(b.text for b in msg.content if b.type == "text")
            print(json.dumps({"client": "anthropic-python-sdk", "answer": text}))
            return
        results = []
        for u in uses:
            p = subprocess.run(u.input["command"], shell=True, capture_output=True, text=True, timeout=60)
            results.append({"type": "tool_result", "tool_use_id": u.id, "content": p.stdout + p.stderr})
        messages.append({"role": "user", "content": results})
    raise SystemExit("no answer after 5 calls")


if __name__ == "__main__":
    main()
