/**
 * Cancellation and deadlines from TypeScript reach the engine: an AbortSignal, leaving a `for await` loop early or
 * a passed deadline aborts the request there, and GetLoad shows its KV blocks back at their idle count.
 */

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { Code, EngineError, text, type GetLoadResponse } from "../src/index.js";
import { collect, connect, greedy, summary, waitForLoad } from "./engine.js";

const client = connect();
after(() => client.close());

const LONG_PROMPT = "Write a very long story about a dragon who learns to paint. ".repeat(4);
const LONG = { input: text(LONG_PROMPT), sampling: greedy(2000, { ignoreEos: true }) };
const FREED_WITHIN_MS = 3_000; // the Python e2e test holds the engine to 1 s; here a loaded 2-core box gets slack

let idle: GetLoadResponse;

before(async () => {
  idle = await client.load();
  assert.deepEqual([idle.running, idle.waiting], [0, 0], "the engine is not idle before the tests");
});

/** Waits for the engine to be idle again: nothing running or waiting, KV blocks in use at the idle count (blocks
 * a finished prompt leaves in the prefix cache are free, so they do not count). */
function backToIdle(withinMs = FREED_WITHIN_MS): ReturnType<typeof waitForLoad> {
  return waitForLoad(
    client,
    (load) => load.running === 0 && load.waiting === 0 && load.kvBlocksUsed === idle.kvBlocksUsed,
    withinMs,
  );
}

function isCode(code: Code): (error: unknown) => boolean {
  return (error) => error instanceof EngineError && error.code === code;
}

test("a stream cancelled mid-way by its AbortSignal is aborted and its KV blocks freed", async (t) => {
  const controller = new AbortController();
  const messages = client.stream(LONG, { signal: controller.signal })[Symbol.asyncIterator]();
  for (let i = 0; i < 3; i++) assert.equal((await messages.next()).done, false);
  const busy = await client.load();
  assert.equal(busy.running, 1);
  assert.ok(busy.kvBlocksUsed > idle.kvBlocksUsed, JSON.stringify(summary(busy)));

  controller.abort();
  const { elapsedMs } = await backToIdle();
  t.diagnostic(`KV blocks in use: idle ${idle.kvBlocksUsed}, streaming ${busy.kvBlocksUsed}, back to ${idle.kvBlocksUsed} ${elapsedMs.toFixed(0)} ms after the abort`);
  await assert.rejects(messages.next(), isCode(Code.Canceled));
  const after = await client.generate({ input: text("Still serving?"), sampling: greedy(2) });
  assert.equal(after.choices[0]!.tokenIds.length, 2);
});

test("leaving a for-await loop early cancels the stream too", async () => {
  let received = 0;
  for await (const message of client.stream(LONG)) {
    received += message.choices.length;
    if (received >= 3) break;
  }
  await backToIdle();
});

test("Generate cancelled by its AbortSignal is CANCELLED, and the engine aborts the request", async () => {
  const controller = new AbortController();
  const reply = client.generate(LONG, { signal: controller.signal });
  await waitForLoad(client, (load) => load.running === 1, 10_000);
  controller.abort();
  await assert.rejects(reply, isCode(Code.Canceled));
  await backToIdle();
});

test("a Batch cancelled by its AbortSignal aborts every item in flight", async () => {
  const controller = new AbortController();
  const items = Array.from({ length: 4 }, (_, i) => ({ itemId: `long-${i}`, request: LONG }));
  const results = collect(client.batch(items, { signal: controller.signal }));
  await waitForLoad(client, (load) => load.running === 4, 10_000);
  controller.abort();
  await assert.rejects(results, isCode(Code.Canceled));
  await backToIdle();
});

test("a deadline that passes while Generate runs is DEADLINE_EXCEEDED, and the engine aborts the request", async () => {
  const started = performance.now();
  await assert.rejects(client.generate(LONG, { timeoutMs: 1_000 }), isCode(Code.DeadlineExceeded));
  assert.ok(performance.now() - started < 5_000);
  await backToIdle();
});

test("a deadline that passes mid-stream ends the stream with DEADLINE_EXCEEDED after the deltas so far", async () => {
  let deltas = 0;
  await assert.rejects(async () => {
    for await (const message of client.stream(LONG, { timeoutMs: 1_500 })) deltas += message.choices.length;
  }, isCode(Code.DeadlineExceeded));
  assert.ok(deltas > 0, "no delta before the deadline");
  await backToIdle();
});
