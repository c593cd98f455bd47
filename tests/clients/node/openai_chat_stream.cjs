// Drives graft with the real openai Node SDK (chat completions, SSE) and prints one JSON line.
//
// usage: NODE_PATH=<.graft-test-env>/node/node_modules node openai_chat_stream.cjs
// env:   GRAFT_BASE_URL (including /v1), GRAFT_API_KEY, GRAFT_SESSION (x-graft-session
//        header when set), GRAFT_MODEL (default scripted).
// Exits non-zero when the call fails.
"use strict";

const OpenAI = require("openai");
const { VERSION: version } = require("openai/version");

async function main() {
  const headers = {};
  if (process.env.GRAFT_SESSION) headers["x-graft-session"] = process.env.GRAFT_SESSION;
  const client = new OpenAI({
    baseURL: process.env.GRAFT_BASE_URL,
    apiKey: process.env.GRAFT_API_KEY || "sk-graft-test",
    defaultHeaders: headers,
    maxRetries: 0,
    timeout: 60_000,
  });
  const sent = {
    model: process.env.GRAFT_MODEL || "scripted",
    messages: [
      { role: "system", content: "You are a test." },
      { role: "user", content: "graft-node: streaming hello from node" },
    ],
    stream: true,
    stream_options: { include_usage: true },
  };
  const stream = await client.chat.completions.create(sent);
  let content = "";
  let finish = null;
  let usage = null;
  let role = null;
  let chunks = 0;
  const ids = new Set();
  for await (const chunk of stream) {
    chunks += 1;
    ids.add(chunk.id);
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.role) role = choice.delta.role;
      if (choice.delta.content) content += choice.delta.content;
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  if (ids.size !== 1) throw new Error(`expected one completion id, got ${[...ids]}`);
  const out = {
    client: "openai-node",
    version,
    mode: "chat-stream",
    sent,
    id: [...ids][0],
    chunks,
    role,
    content,
    finish_reason: finish,
    usage,
  };
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((err) => {
  process.stderr.write(`openai-node client failed: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
