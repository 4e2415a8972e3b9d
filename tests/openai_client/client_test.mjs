// The official OpenAI client library (npm `openai`) against `quantmla serve`: completions, chat,
// and streaming of both. Run by run.sh, which starts the server; exits non-zero on a failed check.
import OpenAI from "openai";
import assert from "node:assert/strict";

const client = new OpenAI({ baseURL: process.env.QUANTMLA_URL, apiKey: "sesame", maxRetries: 0 });

const models = await client.models.list();
assert.equal(models.data[0].id, "mla-tiny");

const completion = await client.completions.create({
  model: "mla-tiny", prompt: "The Debian package manager", max_tokens: 8, temperature: 0,
});
assert.equal(completion.object, "text_completion");
assert.ok(completion.choices[0].text.length > 0);
assert.equal(completion.usage.completion_tokens, completion.choices[0].finish_reason === "length" ? 8 : completion.usage.completion_tokens);

let streamed = "";
const stream = await client.completions.create({
  model: "mla-tiny", prompt: "The Debian package manager", max_tokens: 8, temperature: 0, stream: true,
});
for await (const chunk of stream) streamed += chunk.choices[0]?.text ?? "";
assert.equal(streamed, completion.choices[0].text);

const chat = await client.chat.completions.create({
  model: "mla-tiny", messages: [{ role: "user", content: "Hello!" }], max_tokens: 6, temperature: 0,
});
assert.equal(chat.choices[0].message.role, "assistant");
assert.ok(chat.usage.prompt_tokens > 2);

let chatStreamed = "";
const chatStream = await client.chat.completions.create({
  model: "mla-tiny", messages: [{ role: "user", content: "Hello!" }], max_tokens: 6, temperature: 0,
  stream: true,
});
for await (const chunk of chatStream) chatStreamed += chunk.choices[0]?.delta?.content ?? "";
assert.equal(chatStreamed, chat.choices[0].message.content);

await assert.rejects(
  client.completions.create({ model: "mla-tiny", prompt: "x", max_tokens: -1 }),
  (error) => error.status === 400);
console.log("openai client: models, completions, chat, streaming: ok");
