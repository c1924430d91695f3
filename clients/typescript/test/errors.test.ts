/**
 * The engine's status codes surface as typed `EngineError`s with its messages: INVALID_ARGUMENT naming the refused
 * field (the `ladle-param` trailer) from unary calls and from a stream, RESOURCE_EXHAUSTED from a full queue.
 */

import assert from "node:assert/strict";
import { after, test } from "node:test";

import type { MessageInitShape } from "@bufbuild/protobuf";

import { Code, EngineError, text, tokenIds, type GenerateRequestSchema } from "../src/index.js";
import { connect, greedy, waitForLoad } from "./engine.js";

const client = connect();
const tight = connect("tight");
after(() => {
  client.close();
  tight.close();
});

function invalidArgument(param: string, pattern: RegExp = new RegExp(param)): (error: unknown) => boolean {
  return (error) => {
    assert.ok(error instanceof EngineError, String(error));
    assert.equal(error.code, Code.InvalidArgument);
    assert.equal(error.param, param);
    assert.match(error.rawMessage, pattern);
    return true;
  };
}

const INVALID: [string, MessageInitShape<typeof GenerateRequestSchema>, RegExp?][] = [
  ["top_p", { input: text("hi"), sampling: greedy(4, { topP: 3 }) }],
  ["max_tokens", { input: text("hi"), sampling: greedy(0) }],
  ["n", { input: text("hi"), sampling: greedy(4, { n: 17 }) }],
  ["input", { sampling: greedy(4) }],
  ["prompt", { input: tokenIds([49152]), sampling: greedy(4) }, /49152|vocab/],
];

for (const [param, request, pattern] of INVALID) {
  test(`Generate: a bad ${param} is INVALID_ARGUMENT naming it`, async () => {
    await assert.rejects(client.generate(request), invalidArgument(param, pattern));
  });
}

test("Embed: dimensions above the model's is INVALID_ARGUMENT naming it", async () => {
  await assert.rejects(client.embed({ inputs: [text("x")], dimensions: 577 }), invalidArgument("dimensions"));
});

test("Stream: a refused request fails the iteration with the status, not a message", async () => {
  await assert.rejects(async () => {
    for await (const message of client.stream({ input: text("hi"), sampling: greedy(4, { temperature: 5 }) })) {
      assert.fail(`a message before the error: ${JSON.stringify(message.choices)}`);
    }
  }, invalidArgument("temperature"));
});

test("a full waiting queue is RESOURCE_EXHAUSTED with the engine's message", async () => {
  const long = { input: text("Count slowly to one thousand."), sampling: greedy(2000, { ignoreEos: true }) };
  const stop = new AbortController();
  const hog = tight.stream(long, { signal: stop.signal })[Symbol.asyncIterator]();
  await hog.next(); // the only seat is taken
  const queued = tight.stream(long, { signal: stop.signal })[Symbol.asyncIterator]();
  const queuedEnd = queued.next().then(
    () => assert.fail("the queued stream ran"),
    (error: unknown) => error,
  );
  await waitForLoad(tight, (load) => load.running === 1 && load.waiting === 1, 10_000);

  await assert.rejects(tight.generate({ input: text("One more"), sampling: greedy(4) }), (error: unknown) => {
    assert.ok(error instanceof EngineError, String(error));
    assert.equal(error.code, Code.ResourceExhausted);
    assert.match(error.rawMessage, /too many queued requests \(max_waiting=1\); retry later/);
    return true;
  });

  stop.abort();
  await assert.rejects(hog.next(), (error: unknown) => error instanceof EngineError && error.code === Code.Canceled);
  const queuedError = await queuedEnd;
  assert.ok(queuedError instanceof EngineError && queuedError.code === Code.Canceled, String(queuedError));
  await waitForLoad(tight, (load) => load.running === 0 && load.waiting === 0, 5_000);
});
