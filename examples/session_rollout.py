"""One rollout as a graft session, with an unmodified openai-SDK agent.

Usage: python examples/session_rollout.py GATEWAY_URL [ADMIN_KEY | DATA_DIR]

The session API takes the gateway's admin key: `auth.admin_key`, or, when none is set, the key
the gateway generated into `<data dir>/admin.key` (the default: `graft-data/admin.key`).

Creates a session, runs a tiny tool-using agent through the session's base URL (the agent
only sees an OpenAI base URL and key), posts a reward, closes the session. Afterwards:
    graft records show --data-dir graft-data --session <id>
"""

import json
import os
import sys
import urllib.request

from openai import OpenAI


def admin(url, path, body, key):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})},
        method="POST",
    )
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def agent(base_url, api_key, task):
    """The harness: knows nothing about graft."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": task}]
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"})
    return None


def admin_key(arg):
    """The key given, or the one a gateway generated into a data dir (graft-data by default)."""
    where = arg or "graft-data"
    if os.path.isdir(where):
        with open(os.path.join(where, "admin.key")) as f:
            return f.read().strip()
    return arg


def main():
    url = sys.argv[1].rstrip("/")
    key = admin_key(sys.argv[2] if len(sys.argv) > 2 else None)
    session = admin(url, "/graft/sessions", {"group_id": "weather-task"}, key)
    answer = agent(session["base_url"], session["api_key"], "What is the weather in Lisbon?")
    reward = 1.0 if answer and "18" in answer else 0.0
    admin(url, f"/graft/sessions/{session['session_id']}/reward", {"reward": reward}, key)
    admin(url, f"/graft/sessions/{session['session_id']}/close", {}, key)
    print(json.dumps({"session_id": session["session_id"], "answer": answer, "reward": reward}))


if __name__ == "__main__":
    main()
