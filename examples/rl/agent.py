"""A minimal tool-using agent on the openai SDK, the harness of the examples in this folder.

It gets its task in GRAFT_TASK_PROMPT and talks to whatever OPENAI_BASE_URL points at (in a
`graft rl` run: its own gateway session, set by envd inside its sandbox). One tool, `bash`,
runs a command in the working directory. It stops when the model answers without a tool
call, or after AGENT_MAX_STEPS model calls (each at most AGENT_MAX_TOKENS tokens). Its last
answer is also written to final_answer.txt, so a verifier can check an answer given in
words. Nothing in it knows about graft.
"""

import json
import os
import subprocess

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the working directory; returns its output and exit code.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


def main() -> None:
    client = OpenAI(max_retries=0)
    model = os.environ.get("GRAFT_MODEL", "policy")
    messages = [
        {
            "role": "system",
            "content": "You solve tasks by running shell commands with the bash tool. "
            "When the task is done, answer briefly without calling a tool.",
        },
        {"role": "user", "content": os.environ["GRAFT_TASK_PROMPT"]},
    ]
    steps = 0
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "512"))
    for _ in range(int(os.environ.get("AGENT_MAX_STEPS", "6"))):
        steps += 1
        r = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,
            temperature=1.0,
        )
        msg = r.choices[0].message
        turn = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            turn["tool_calls"] = [tc.model_dump() for tc in msg.tool_calls]
        messages.append(turn)
        if not msg.tool_calls:
            break
        for tc in msg.tool_calls:
            try:
                command = json.loads(tc.function.arguments)["command"]
            except (ValueError, KeyError, TypeError) as e:
                out = f"invalid arguments ({e}): {tc.function.arguments}"
            else:
                p = subprocess.run(
                    command, shell=True, capture_output=True, text=True, timeout=60
                )
                out = f"{(p.stdout + p.stderr)[-4000:]}[exit {p.returncode}]"
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    with open("final_answer.txt", "w") as f:
        f.write(answers[-1] if answers else "")
    print(json.dumps({"model_calls": steps}))


if __name__ == "__main__":
    main()
