"""The real openai Python SDK with a short timeout and its own retries (max_retries=2, as by
default): the first attempt of the call is slow (the scripted upstream's `first_delay_ms`),
so the SDK times out, closes the connection and retries it. Prints one JSON line with the
answer it finally got and the retry headers each attempt carried (read from the SDK's own
HTTP client as it sent them).

usage: python openai_retry.py MODE [SIGNAL]
  MODE:   json | stream
  SIGNAL: how the attempts say they are one request
    stainless  the SDK as it is: `x-stainless-retry-count` 0, 1, ... (the default)
    key        the SDK's own idempotency machinery switched on (`_idempotency_header`, which
               the stock OpenAI client leaves None): one `Idempotency-Key`
               (stainless-python-retry-<uuid>) for every attempt, no retry count
    none       neither header: only the prompt says it is the same call
env:   GRAFT_BASE_URL (including /v1), GRAFT_API_KEY, GRAFT_MODEL (default scripted),
       GRAFT_TIMEOUT (seconds, default 1.5), GRAFT_TEXT (the user message).
"""

import json
import os
import sys

import openai


def main() -> None:
    mode = sys.argv[1]
    signal = sys.argv[2] if len(sys.argv) > 2 else "stainless"
    if signal not in ("stainless", "key", "none"):
        sys.exit(f"unknown SIGNAL {signal!r}: stainless | key | none")
    sent_headers = []

    def seen(request) -> None:
        h = request.headers
        sent_headers.append(
            {
                "idempotency-key": h.get("idempotency-key"),
                "x-stainless-retry-count": h.get("x-stainless-retry-count"),
            }
        )

    c = openai.OpenAI(
        base_url=os.environ["GRAFT_BASE_URL"],
        api_key=os.environ.get("GRAFT_API_KEY", "sk-graft-test"),
        max_retries=2,
        timeout=float(os.environ.get("GRAFT_TIMEOUT", "1.5")),
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [seen]}),
    )
    extra = {}
    if signal == "key":
        c._idempotency_header = "Idempotency-Key"
    if signal in ("key", "none"):
        extra["x-stainless-retry-count"] = openai.omit
    sent = {
        "model": os.environ.get("GRAFT_MODEL", "scripted"),
        "messages": [{"role": "user", "content": os.environ["GRAFT_TEXT"]}],
        "extra_headers": extra,
    }
    if mode == "json":
        r = c.chat.completions.create(**sent)
        content = r.choices[0].message.content
        rid = r.id
    else:
        content, rid = "", None
        for chunk in c.chat.completions.create(**sent, stream=True):
            rid = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                content += chunk.choices[0].delta.content
    print(json.dumps({"content": content, "id": rid, "attempts": sent_headers}))


if __name__ == "__main__":
    main()
