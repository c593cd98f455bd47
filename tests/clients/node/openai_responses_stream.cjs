// Drives graft's Responses dialect with the real openai Node SDK, streaming: a function call,
// then the final answer after the tool output. Prints one JSON line.
//
// usage: NODE_PATH=<.graft-test-env>/node/node_modules node openai_responses_stream.cjs
// env:   GRAFT_BASE_URL (including /v1), GRAFT_API_KEY, GRAFT_SESSION (x-graft-session
//        header when set), GRAFT_MODEL (default scripted).
// `sent` holds the exact JSON bodies the SDK put on the wire (captured by a fetch wrapper).
"use strict";

const OpenAI = require("openai");
const { VERSION: version } = require("openai/version");

const WEATHER_TOOL = {
  type: "function",
  name: "get_weather",
  description: "Current weather for a city.",
  parameters: {
    type: "object",
    properties: { city: { type: "string" } },
    required: ["city"],
  },
};
const TOOL_OUTPUT = { city: "Paris", forecast: "sunny", marker: "graft-weather-result" };

async function call(client, body) {
  const stream = await client.responses.create({ ...body, stream: true });
  const events = [];
  let text = "";
  const args = {};
  let final = null;
  for await (const ev of stream) {
    events.push(ev.type);
    if (ev.type === "response.output_text.delta") text += ev.delta;
    if (ev.type === "response.function_call_arguments.delta") {
      args[ev.item_id] = (args[ev.item_id] || "") + ev.delta;
    }
    if (ev.type === "response.completed") final = ev.response;
  }
  if (!final) throw new Error(`no response.completed event; got ${events.join(",")}`);
  return {
    id: final.id,
    status: final.status,
    events,
    delta_text: text,
    delta_arguments: Object.values(args),
    output: final.output,
    function_calls: final.output
      .filter((i) => i.type === "function_call")
      .map((i) => ({ call_id: i.call_id, name: i.name, arguments: i.arguments })),
    usage: final.usage,
  };
}

async function main() {
  const sent = [];
  const headers = {};
  if (process.env.GRAFT_SESSION) headers["x-graft-session"] = process.env.GRAFT_SESSION;
  const client = new OpenAI({
    baseURL: process.env.GRAFT_BASE_URL,
    apiKey: process.env.GRAFT_API_KEY || "sk-graft-test",
    defaultHeaders: headers,
    maxRetries: 0,
    timeout: 60_000,
    fetch: async (url, init) => {
      if (init && typeof init.body === "string") sent.push(JSON.parse(init.body));
      return fetch(url, init);
    },
  });
  const model = process.env.GRAFT_MODEL || "scripted";
  let input = [{ role: "user", content: "graft-weather-ask (node): what is the weather in Paris?" }];
  const first = await call(client, { model, input, tools: [WEATHER_TOOL] });
  if (first.function_calls.length !== 1) throw new Error(`expected one function call: ${JSON.stringify(first)}`);
  const fc = first.function_calls[0];
  input = input.concat(first.output, [
    { type: "function_call_output", call_id: fc.call_id, output: JSON.stringify(TOOL_OUTPUT) },
  ]);
  const second = await call(client, { model, input, tools: [WEATHER_TOOL] });
  const out = { client: "openai-node", version, mode: "responses-stream", sent, calls: [first, second] };
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((err) => {
  process.stderr.write(`openai-node responses client failed: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
