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

// OpenAI's sampling controls as the client sends them: a +100 bias makes one token every token,
// a presence penalty then has to leave it, and echo with logprobs scores the prompt.
const biased = await client.completions.create({
  model: "mla-tiny", prompt: "The Debian package manager", max_tokens: 4, temperature: 0,
  logit_bias: { "1234": 100 }, logprobs: 0,
});
assert.deepEqual(new Set(biased.choices[0].logprobs.tokens).size, 1);
const penalized = await client.chat.completions.create({
  model: "mla-tiny", messages: [{ role: "user", content: "Hello!" }], max_tokens: 6, temperature: 0,
  presence_penalty: 2, frequency_penalty: 1,
});
assert.equal(penalized.choices[0].message.role, "assistant");
const echoed = await client.completions.create({
  model: "mla-tiny", prompt: [1, 400, 500, 600], max_tokens: 1, temperature: 0, echo: true,
  logprobs: 1,
});
assert.equal(echoed.choices[0].logprobs.token_logprobs.length, 5);
assert.equal(echoed.choices[0].logprobs.token_logprobs[0], null);
assert.ok(echoed.choices[0].logprobs.token_logprobs[1] < 0);

await assert.rejects(
  client.completions.create({ model: "mla-tiny", prompt: "x", max_tokens: -1 }),
  (error) => error.status === 400);
console.log("openai client: models, completions, chat, streaming, sampling controls, echo: ok");
