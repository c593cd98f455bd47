"""Drives graft with the real openai Python SDK, sending the message shapes real harnesses
send (OpenHands: every content as a list of text parts; tool messages with a name;
assistant turns echoed with `reasoning_content` or `reasoning`), and prints one JSON line.

usage: python passthrough_shapes.py MODE     MODE: agent | image | side
env:   GRAFT_BASE_URL  base URL including /v1 (a session URL: /s/{session}/v1)
       GRAFT_API_KEY   API key (default sk-graft-test)
       GRAFT_MODEL     model id (default scripted)

agent: three calls of one tool-using conversation. The scripted upstream must answer a user
       message containing "graft-shapes-task" with a `bash` tool call, a tool message with
       text, and "graft-shapes-more" with text.
image: one call whose user message holds an image part.
side:  a tool-using conversation of two calls with, between them, a side call that starts
       its own conversation (a title request to a small model, no tools), as Claude Code
       and OpenHands make; "graft-side-title" must get an answer.
"""

import json
import os
import sys

import openai

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def parts(text: str) -> list:
    return [{"type": "text", "text": text}]


def client() -> openai.OpenAI:
    return openai.OpenAI(
        base_url=os.environ["GRAFT_BASE_URL"],
        api_key=os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
        max_retries=0,
        timeout=60,
    )


def agent(c: openai.OpenAI, model: str) -> dict:
    messages = [
        {"role": "system", "content": parts("You are OpenHands agent.")},
        {"role": "user", "content": parts("graft-shapes-task: list the files")},
    ]
    r1 = c.chat.completions.create(model=model, messages=messages, tools=[BASH_TOOL])
    m1 = r1.choices[0].message
    call = m1.tool_calls[0]
    # Echoed with a reasoning field (DeepSeek-style clients keep `reasoning_content`).
    messages.append(
        {
            "role": "assistant",
            "content": parts(m1.content or ""),
            "reasoning_content": "I should list the files.",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        }
    )
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "name": "bash", "content": parts("graft-shapes-listing: a.txt b.txt")}
    )
    r2 = c.chat.completions.create(model=model, messages=messages, tools=[BASH_TOOL])
    m2 = r2.choices[0].message
    # Echoed with `reasoning` (vLLM's newer name), then a new user turn in parts.
    messages.append({"role": "assistant", "content": parts(m2.content or ""), "reasoning": "Two files."})
    messages.append({"role": "user", "content": parts("graft-shapes-more: and now?")})
    r3 = c.chat.completions.create(model=model, messages=messages, tools=[BASH_TOOL])
    return {
        "calls": 3,
        "tool": call.function.name,
        "answers": [m2.content, r3.choices[0].message.content],
    }


def image(c: openai.OpenAI, model: str) -> dict:
    r = c.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "graft-shapes-image: what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                ],
            }
        ],
    )
    return {"calls": 1, "answer": r.choices[0].message.content}


def side(c: openai.OpenAI, model: str) -> dict:
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "graft-shapes-task: list the files"},
    ]
    r1 = c.chat.completions.create(model=model, messages=messages, tools=[BASH_TOOL])
    m1 = r1.choices[0].message
    call = m1.tool_calls[0]
    # The harness marks its side call with a header of its own (as Codex's
    # x-codex-turn-metadata names the agent of each call).
    title = c.chat.completions.create(
        extra_headers={"x-graft-purpose": "title"},
        model="scripted-small",
        messages=[
            {"role": "system", "content": "Write a five-word title for the conversation."},
            {"role": "user", "content": "graft-side-title: graft-shapes-task: list the files"},
        ],
    )
    messages.append(m1.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "graft-shapes-listing: a.txt b.txt"})
    r2 = c.chat.completions.create(model=model, messages=messages, tools=[BASH_TOOL])
    return {"calls": 3, "title": title.choices[0].message.content, "answer": r2.choices[0].message.content}


def main() -> None:
    modes = {"agent": agent, "image": image, "side": side}
    if len(sys.argv) != 2 or sys.argv[1] not in modes:
        sys.exit(f"usage: {sys.argv[0]} {' | '.join(modes)}")
    out = modes[sys.argv[1]](client(), os.environ.get("GRAFT_MODEL", "scripted"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
