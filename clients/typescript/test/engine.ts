/**
 * What the tests share: clients for the engines tests/e2e/test_typescript_client.py starts (their addresses in
 * LADLE_ENGINE_ADDRESS and LADLE_TIGHT_ENGINE_ADDRESS), greedy sampling and a wait on the engine's load.
 */

import type { MessageInitShape } from "@bufbuild/protobuf";

import { EngineClient, type GetLoadResponse, type SamplingParamsSchema } from "../src/index.js";

/** A client of the shared engine (32 seats), or of the tight one (one seat, a waiting queue of one). */
export function connect(which: "shared" | "tight" = "shared"): EngineClient {
  const variable = which === "shared" ? "LADLE_ENGINE_ADDRESS" : "LADLE_TIGHT_ENGINE_ADDRESS";
  const address = process.env[variable];
  if (!address) throw new Error(`${variable} is not set: run these tests through tests/e2e/test_typescript_client.py`);
  return new EngineClient(address, { timeoutMs: 120_000 });
}

/** Greedy unless told otherwise. */
export function greedy(
  maxTokens: number,
  fields: MessageInitShape<typeof SamplingParamsSchema> = {},
): MessageInitShape<typeof SamplingParamsSchema> {
  return { maxTokens, temperature: 0, ...fields };
}

/** Polls GetLoad until `done` holds, failing after `withinMs`; returns the load and how long it took. */
export async function waitForLoad(
  client: EngineClient,
  done: (load: GetLoadResponse) => boolean,
  withinMs: number,
): Promise<{ load: GetLoadResponse; elapsedMs: number }> {
  const started = performance.now();
  for (;;) {
    const load = await client.load({ timeoutMs: 5_000 });
    const elapsedMs = performance.now() - started;
    if (done(load)) return { load, elapsedMs };
    if (elapsedMs > withinMs) {
      throw new Error(`load still ${JSON.stringify(summary(load))} after ${withinMs} ms`);
    }
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

export function summary(load: GetLoadResponse): { running: number; waiting: number; kvBlocksUsed: number } {
  return { running: load.running, waiting: load.waiting, kvBlocksUsed: load.kvBlocksUsed };
}

export function cosine(a: number[], b: number[]): number {
  let dot = 0;
  let aa = 0;
  let bb = 0;
  a.forEach((x, i) => {
    const y = b[i] ?? Number.NaN;
    dot += x * y;
    aa += x * x;
    bb += y * y;
  });
  return dot / Math.sqrt(aa * bb);
}

/** Everything an async iterable yields (Array.fromAsync before Node 22). */
export async function collect<T>(iterable: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const value of iterable) out.push(value);
  return out;
}
