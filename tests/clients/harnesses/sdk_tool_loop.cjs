// The plain-SDK "harness" in Node: the openai Node SDK in a minimal agent loop with one
// `bash` tool, streaming, pointed at graft through OPENAI_BASE_URL / OPENAI_API_KEY (what envd
// injects) and GRAFT_MODEL. The SDK comes from NODE_PATH (the test env's node folder).
//
// usage: node sdk_tool_loop.cjs TASK   (runs in the current directory, at most 5 calls)
"use strict";
const { execSync } = require("node:child_process");
const OpenAI = require("openai");

const TOOLS = [{
  type: "function",
  function: {
    name: "bash", description: "Run a shell command in the current directory",
    parameters: { type: "object", properties: { command: { type: "string" } }, required: ["command"] },
  },
}];

async function main() {
  const client = new OpenAI.OpenAI();
  const model = process.env.GRAFT_MODEL || process.env.OPENAI_MODEL || "default";
  const messages = [
    { role: "system", content: "You run shell commands to do tasks." },
    { role: "user", content: process.argv[2] },
  ];
  for (let i = 0; i < 5; i++) {
    const stream = await client.chat.completions.create({ model, messages, tools: TOOLS, stream: true });
    let content = "";
    const calls = new Map();
    for await (const chunk of stream) {
      const d = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!d) continue;
      content += d.content || "";
      for (const tc of d.tool_calls || []) {
        const c = calls.get(tc.index) || { id: "", name: "", arguments: "" };
        c.id = tc.id || c.id;
        if (tc.function) {
          c.name += tc.function.name || "";
          c.arguments += tc.function.arguments || "";
        }
        calls.set(tc.index, c);
      }
    }
    const msg = { role: "assistant", content: content || null };
    if (calls.size) {
      msg.tool_calls = [...calls.values()].map((c) => ({
        id: c.id, type: "function", function: { name: c.name, arguments: c.arguments },
      }));
    }
    messages.push(msg);
    if (!calls.size) {
      console.log(JSON.stringify({ client: "openai-node-sdk", answer: content }));
      return;
    }
    for (const c of calls.values()) {
      let out;
      try {
        out = execSync(JSON.parse(c.arguments).command, { encoding: "utf8", timeout: 60000 });
      } catch (e) {
        out = `${e.stdout || ""}${e.stderr || ""}`;
      }
      messages.push({ role: "tool", tool_call_id: c.id, content: out });
    }
  }
  throw new Error("no answer after 5 calls");
}

main().catch((e) => { console.error(e); process.exit(1); });
