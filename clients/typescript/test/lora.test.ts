/**
 * LoRA adapters from TypeScript: GenerateRequest's `adapter` selects one, loadAdapter / unloadAdapter serve and
 * retire them, and an adapter the engine does not serve fails with NOT_FOUND. The engine is started by
 * tests/e2e/test_typescript_client.py with one adapter (LADLE_LORA_ADAPTER, on LADLE_LORA_ENGINE_ADDRESS); the same
 * adapter's folder is LADLE_LORA_PATH.
 */

import assert from "node:assert/strict";
import { after, test } from "node:test";

import { Code, EngineClient, EngineError, tokenIds } from "../src/index.js";
import { greedy } from "./engine.js";

function required(name: string): string {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set: run these tests through tests/e2e/test_typescript_client.py`);
  return value;
}

const client = new EngineClient(required("LADLE_LORA_ENGINE_ADDRESS"), { timeoutMs: 120_000 });
const adapter = required("LADLE_LORA_ADAPTER");
const path = required("LADLE_LORA_PATH");
after(() => client.close());

const prompt = tokenIds([1, 504, 3458, 282, 4649, 314]);

async function tokens(adapterName: string): Promise<number[]> {
  const reply = await client.generate({ input: prompt, sampling: greedy(12, { ignoreEos: true }), adapter: adapterName });
  return reply.choices[0]!.tokenIds;
}

test("GetModelInfo lists the adapter; GenerateRequest.adapter selects it", async () => {
  const info = await client.modelInfo();
  assert.deepEqual(info.lora?.adapters.map((a) => a.name), [adapter]);
  assert.notDeepEqual(await tokens(adapter), await tokens(""));
});

test("loadAdapter serves a second name, unloadAdapter retires it, and then it is NOT_FOUND", async () => {
  const loaded = await client.loadAdapter("ts-copy", path);
  assert.equal(loaded.adapter?.name, "ts-copy");
  assert.deepEqual(await tokens("ts-copy"), await tokens(adapter));
  assert.ok((await client.load()).adapters.includes("ts-copy"));
  await client.unloadAdapter("ts-copy");
  await assert.rejects(tokens("ts-copy"), (error: unknown) => error instanceof EngineError && error.code === Code.NotFound);
});
