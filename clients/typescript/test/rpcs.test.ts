/**
 * Every EngineService RPC and the health service through the TypeScript client against a real engine: text,
 * chat and token-id inputs, streams that add up to the whole answer, structured output, embeddings and scores.
 */

import assert from "node:assert/strict";
import { after, test } from "node:test";

import { chat, FinishReason, ServingStatus, SERVICE, text, tokenIds, type StreamResponse } from "../src/index.js";
import { connect, cosine, greedy } from "./engine.js";

const client = connect();
after(() => client.close());

test("health is SERVING for the server and for EngineService", async () => {
  assert.equal(await client.health(""), ServingStatus.SERVING);
  assert.equal(await client.health(SERVICE), ServingStatus.SERVING);
});

test("GetModelInfo describes the embedded model", async () => {
  const info = await client.modelInfo();
  assert.equal(info.modelId, "SmolLM2-135M-Instruct");
  assert.deepEqual([info.contextLength, info.vocabSize, info.architecture], [8192, 49152, "llama"]);
  assert.deepEqual(info.eosTokenIds, [2]);
  assert.ok(info.hasChatTemplate);
  assert.equal(info.limits?.maxN, 16);
  assert.ok(Math.abs((info.defaults?.temperature ?? 0) - 0.2) < 1e-6);
  assert.deepEqual([info.pooling?.method, info.pooling?.normalize, info.pooling?.dimensions], ["last", true, 576]);
});

test("Generate from text: the answer, its tokens, finish reason and usage", async () => {
  const reply = await client.generate({ requestId: "ts-1", input: text("The capital of France is"), sampling: greedy(8) });
  assert.equal(reply.requestId, "ts-1");
  assert.equal(reply.model, "SmolLM2-135M-Instruct");
  assert.equal(reply.choices.length, 1);
  const [choice] = reply.choices;
  assert.match(choice!.text, /Paris/);
  assert.equal(choice!.tokenIds.length, 8);
  assert.equal(choice!.finishReason, FinishReason.LENGTH);
  assert.deepEqual([reply.usage?.promptTokens, reply.usage?.completionTokens, reply.usage?.totalTokens], [5, 8, 13]);
});

test("Generate from chat messages: two choices, a stop string, logprobs", async () => {
  const reply = await client.generate({
    input: chat([{ role: "user", content: "Name the capital of France." }]),
    sampling: greedy(24, { n: 2, stop: ["Paris"], logprobs: true, topLogprobs: 2 }),
  });
  assert.deepEqual(reply.choices.map((c) => c.index), [0, 1]);
  for (const choice of reply.choices) {
    assert.equal(choice.finishReason, FinishReason.STOP);
    assert.deepEqual(choice.matchedStop?.kind, { case: "text", value: "Paris" });
    assert.doesNotMatch(choice.text, /Paris/);
    assert.equal(choice.logprobs.length, choice.tokenIds.length);
    assert.ok(choice.logprobs.every((lp) => lp.topLogprobs.length === 2 && lp.logprob <= 0));
  }
  assert.equal(reply.choices[0]!.text, reply.choices[1]!.text);
});

test("Generate from token ids equals Generate from the same text", async () => {
  const { tokenIds: ids } = await client.tokenize({ input: text("Once upon a time") });
  const byIds = await client.generate({ input: tokenIds(ids), sampling: greedy(6) });
  const byText = await client.generate({ input: text("Once upon a time"), sampling: greedy(6) });
  assert.deepEqual(byIds.choices[0]!.tokenIds, byText.choices[0]!.tokenIds);
  assert.equal(byIds.usage?.promptTokens, ids.length);
});

test("Stream: deltas as an async iterator add up to Generate's answer; usage on the last message, usageSoFar on each", async () => {
  const messages: StreamResponse[] = [];
  for await (const message of client.stream({ requestId: "ts-s", input: text("The capital of France is"), sampling: greedy(10) })) {
    messages.push(message);
  }
  assert.ok(messages.length >= 2, `${messages.length} messages`);
  assert.ok(messages.every((m) => m.requestId === "ts-s"));
  assert.ok(messages.slice(0, -1).every((m) => m.usage === undefined));
  assert.deepEqual([messages.at(-1)!.usage?.promptTokens, messages.at(-1)!.usage?.completionTokens], [5, 10]);
  let sent = 0;
  for (const m of messages) {
    sent += m.choices.reduce((sum, c) => sum + c.tokenIds.length, 0);
    assert.deepEqual([m.usageSoFar?.promptTokens, m.usageSoFar?.completionTokens], [5, sent]);
  }
  const deltas = messages.flatMap((m) => m.choices);
  const whole = (await client.generate({ input: text("The capital of France is"), sampling: greedy(10) })).choices[0]!;
  assert.equal(deltas.map((d) => d.text).join(""), whole.text);
  assert.deepEqual(deltas.flatMap((d) => d.tokenIds), whole.tokenIds);
  assert.equal(deltas.at(-1)!.finishReason, FinishReason.LENGTH);
});

test("Tokenize text and chat; Detokenize gives the text back", async () => {
  const plain = await client.tokenize({ input: text("Hello world") });
  assert.equal(plain.tokenIds.length, 2);
  assert.equal(plain.tokens.length, 2);
  assert.equal(plain.promptText, "");
  assert.equal((await client.detokenize({ tokenIds: plain.tokenIds })).text, "Hello world");
  const templated = await client.tokenize({ input: chat([{ role: "user", content: "Hi" }]) });
  assert.ok(templated.promptText.startsWith("<|im_start|>"));
  assert.ok(templated.promptText.endsWith("<|im_start|>assistant\n"));
});

test("GetLoad reports the KV cache", async () => {
  const load = await client.load();
  assert.ok(load.accepting);
  assert.ok(load.kvBlocksTotal > 0);
  assert.equal(load.kvBlockSize, 16);
  assert.ok(load.kvUsage >= 0 && load.kvUsage <= 1);
  assert.equal(typeof load.speculativeProposedTokens, "bigint"); // uint64 fields are bigints in Protobuf-ES
});

test("structured output: a JSON schema and a choice constrain the answer", async () => {
  const schema = {
    type: "object",
    properties: { city: { type: "string", maxLength: 20 }, population: { type: "integer" } },
    required: ["city", "population"],
    additionalProperties: false,
  };
  const reply = await client.generate({
    input: chat([{ role: "user", content: "Give the capital of France and its population as JSON." }]),
    sampling: greedy(64),
    constraint: { kind: { case: "jsonSchema", value: JSON.stringify(schema) } },
  });
  const [choice] = reply.choices;
  assert.equal(choice!.finishReason, FinishReason.STOP);
  const value = JSON.parse(choice!.text) as { city: unknown; population: unknown };
  assert.deepEqual(Object.keys(value).sort(), ["city", "population"]);
  assert.equal(typeof value.city, "string");
  assert.ok(Number.isInteger(value.population));

  const picked = await client.generate({
    input: chat([{ role: "user", content: "Is Paris in France? Answer yes or no." }]),
    sampling: greedy(8),
    constraint: { kind: { case: "choice", value: { choices: ["yes", "no"] } } },
  });
  assert.ok(["yes", "no"].includes(picked.choices[0]!.text), picked.choices[0]!.text);
});

const TEXTS = ["Hello world", "The capital of France is Paris.", "Bananas are yellow and rich in potassium."];

test("Embed: one normalized vector per input; dimensions, token ids and chat inputs", async () => {
  const reply = await client.embed({ requestId: "ts-e", inputs: TEXTS.map(text) });
  assert.equal(reply.requestId, "ts-e");
  assert.deepEqual(reply.embeddings.map((e) => e.index), [0, 1, 2]);
  for (const embedding of reply.embeddings) {
    assert.equal(embedding.values.length, 576);
    assert.ok(Math.abs(Math.hypot(...embedding.values) - 1) < 1e-5);
  }
  assert.equal(reply.usage?.promptTokens, reply.embeddings.reduce((sum, e) => sum + e.numTokens, 0));

  const whole = (await client.embed({ inputs: [text(TEXTS[1]!)], normalize: false })).embeddings[0]!;
  const short = (await client.embed({ inputs: [text(TEXTS[1]!)], dimensions: 32 })).embeddings[0]!;
  const norm = Math.hypot(...whole.values.slice(0, 32));
  short.values.forEach((v, i) => assert.ok(Math.abs(v - whole.values[i]! / norm) < 1e-5));
  const { tokenIds: ids } = await client.tokenize({ input: text(TEXTS[1]!) });
  const byIds = (await client.embed({ inputs: [tokenIds(ids)], normalize: false })).embeddings[0]!;
  assert.deepEqual(byIds.values, whole.values);
  const fromChat = (await client.embed({ inputs: [chat([{ role: "user", content: "What is an embedding?" }])] })).embeddings[0]!;
  assert.equal(fromChat.values.length, 576);
});

test("Score: the cosine of the query's and each document's embeddings", async () => {
  const query = "Which city is the capital of France?";
  const reply = await client.score({ query: text(query), documents: TEXTS.map(text) });
  assert.equal(reply.scores.length, 3);
  const vectors = (await client.embed({ inputs: [query, ...TEXTS].map(text) })).embeddings.map((e) => e.values);
  reply.scores.forEach((score, i) => assert.ok(Math.abs(score - cosine(vectors[0]!, vectors[i + 1]!)) < 1e-5));
  assert.equal(reply.scores.indexOf(Math.max(...reply.scores)), 1); // the Paris sentence
});
