/**
 * Batch, the bidirectional stream: 100 items (generations, embeddings and scores, with bad items mixed in) are
 * written while their results arrive, and every result is matched to its item by its id.
 */

import assert from "node:assert/strict";
import { after, test } from "node:test";

import { Code, text, type BatchItem, type BatchResponse } from "../src/index.js";
import { collect, connect, greedy } from "./engine.js";

const client = connect();
after(() => client.close());

const PROMPTS = ["The capital of France is", "One, two, three,", "Hello, my name is", "The sky is"];
const NUM_ITEMS = 100;
const WRITTEN_BEFORE_WAITING = 50;

type Expected = { kind: "result"; maxTokens: number } | { kind: "embed" } | { kind: "score" } | { kind: "error"; param: string };

/** Item i: an embedding at 5 mod 25, a score at 15 mod 25, a refused temperature at 3 mod 10, a missing input
 * at 7 mod 10, else a greedy generation of 2 to 4 tokens. */
function item(i: number): [BatchItem, Expected] {
  const itemId = `item-${i}`;
  if (i % 25 === 5) return [{ itemId, pooling: { case: "embed", value: { inputs: [text(PROMPTS[i % 4]!)] } } }, { kind: "embed" }];
  if (i % 25 === 15) {
    const value = { query: text("fruit"), documents: [text("Bananas are yellow."), text("Paris is in France.")] };
    return [{ itemId, pooling: { case: "score", value } }, { kind: "score" }];
  }
  const maxTokens = 2 + (i % 3);
  if (i % 10 === 3) {
    return [{ itemId, request: { input: text(PROMPTS[i % 4]!), sampling: greedy(maxTokens, { temperature: -1 }) } }, { kind: "error", param: "temperature" }];
  }
  if (i % 10 === 7) return [{ itemId, request: { sampling: greedy(maxTokens) } }, { kind: "error", param: "input" }];
  return [{ itemId, request: { input: text(PROMPTS[i % 4]!), sampling: greedy(maxTokens) } }, { kind: "result", maxTokens }];
}

test("100 items, bad ones mixed in, written while results arrive; each result matched to its item", async (t) => {
  const expected = new Map<string, Expected>();
  let firstResult!: () => void;
  const resultArrived = new Promise<void>((resolve) => (firstResult = resolve));
  let resultsBeforeLastWrite = -1;
  const responses: BatchResponse[] = [];

  async function* items(): AsyncGenerator<BatchItem> {
    for (let i = 0; i < NUM_ITEMS; i++) {
      // Halfway, wait for a result: a client that sent everything before reading would never get one.
      if (i === WRITTEN_BEFORE_WAITING) await resultArrived;
      const [request, outcome] = item(i);
      expected.set(request.itemId!, outcome);
      yield request;
    }
    resultsBeforeLastWrite = responses.length;
    yield { itemId: "item-0", request: { input: text("again"), sampling: greedy(2) } }; // a repeated id
  }

  for await (const response of client.batch(items())) {
    responses.push(response);
    firstResult();
  }

  t.diagnostic(`${resultsBeforeLastWrite} of ${responses.length} results arrived before the last item was written`);
  assert.ok(resultsBeforeLastWrite > 0, "every result came after the last item was written");
  assert.equal(responses.length, NUM_ITEMS + 1);
  const byId = new Map<string, BatchResponse[]>();
  for (const response of responses) byId.set(response.itemId, [...(byId.get(response.itemId) ?? []), response]);
  assert.deepEqual([...byId.keys()].sort(), [...expected.keys()].sort());

  const sameId = byId.get("item-0")!; // the repeated id is refused; the first item-0 runs
  const refused = sameId.findIndex((r) => r.outcome.case === "error" && r.outcome.value.param === "item_id");
  assert.notEqual(refused, -1, JSON.stringify(sameId.map((r) => r.outcome.case)));
  sameId.splice(refused, 1);

  const texts = new Map<string, Set<string>>();
  for (const [itemId, want] of expected) {
    const [response] = byId.get(itemId)!;
    const outcome = response!.outcome;
    if (want.kind === "error") {
      assert.equal(outcome.case, "error", itemId);
      assert.equal(outcome.value.code, Code.InvalidArgument);
      assert.equal(outcome.value.param, want.param);
      assert.ok(outcome.value.message.length > 0);
    } else if (want.kind === "embed") {
      assert.equal(outcome.case, "embedResult", itemId);
      assert.equal(outcome.value.embeddings[0]!.values.length, 576);
    } else if (want.kind === "score") {
      assert.equal(outcome.case, "scoreResult", itemId);
      const [fruit, city] = outcome.value.scores;
      assert.ok(fruit! > city!, `${fruit} ${city}`);
    } else {
      assert.equal(outcome.case, "result", itemId);
      const choice = outcome.value.choices[0]!;
      assert.equal(choice.tokenIds.length, want.maxTokens);
      assert.equal(outcome.value.usage?.completionTokens, want.maxTokens);
      const i = Number(itemId.split("-")[1]);
      const key = `${i % 4}/${want.maxTokens}`;
      texts.set(key, (texts.get(key) ?? new Set()).add(choice.text));
    }
  }
  // Greedy: the items with the same prompt and length agree with each other.
  assert.ok([...texts.values()].every((same) => same.size === 1), JSON.stringify([...texts].map(([k, v]) => [k, [...v]])));
});

test("an embed item's vector equals the Embed call's", async () => {
  const items = [{ itemId: "e", pooling: { case: "embed" as const, value: { inputs: [text("The sky is")] } } }];
  const [response] = await collect(client.batch(items));
  assert.equal(response!.outcome.case, "embedResult");
  const alone = await client.embed({ inputs: [text("The sky is")] });
  assert.deepEqual(response!.outcome.value.embeddings[0]!.values, alone.embeddings[0]!.values);
});
