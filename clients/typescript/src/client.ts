/**
 * EngineClient: a typed client for one ladle engine, `ladle.v1.EngineService` over gRPC (HTTP/2).
 *
 * It takes requests as the generated messages or plain objects of their shape, returns the generated messages
 * unchanged, and adds what every caller needs: a deadline on every call (`timeoutMs`, 600 s unless told), an
 * AbortSignal to cancel (the engine aborts the request and frees its KV blocks), failures as `EngineError`,
 * keepalive pings on long calls and one HTTP/2 connection that `close()` ends.
 *
 *     const client = new EngineClient("127.0.0.1:50051");
 *     await client.waitUntilServing();
 *     const reply = await client.generate({ input: text("Hello"), sampling: { maxTokens: 16 } });
 *     for await (const delta of client.stream({ input: text("Once"), sampling: { maxTokens: 64 } })) { ... }
 *     client.close();
 */

import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code, createClient, type Client } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";

import { asEngineError, EngineError } from "./errors.js";
import { Health, HealthCheckResponse_ServingStatus } from "./gen/grpc/health/v1/health_pb.js";
import {
  EngineService,
  type BatchRequestSchema,
  type BatchResponse,
  type DetokenizeRequestSchema,
  type DetokenizeResponse,
  type EmbedRequestSchema,
  type EmbedResponse,
  type GenerateRequestSchema,
  type GenerateResponse,
  type GetLoadResponse,
  type GetModelInfoResponse,
  type LoadAdapterResponse,
  type ScoreRequestSchema,
  type ScoreResponse,
  type StreamRequestSchema,
  type StreamResponse,
  type TokenizeRequestSchema,
  type TokenizeResponse,
} from "./gen/ladle/v1/engine_pb.js";

export const SERVICE = "ladle.v1.EngineService";
export const DEFAULT_TIMEOUT_MS = 600_000;
const HEALTH_TIMEOUT_MS = 5_000;
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024; // the engine's own limit
const KEEPALIVE_MS = 30_000; // the engine permits client pings every 20 s or more

export type BatchItem = MessageInitShape<typeof BatchRequestSchema>;

/** Per call: `timeoutMs` replaces the client's deadline (0 or less: none); `signal` cancels the call. */
export interface CallOptions {
  timeoutMs?: number;
  signal?: AbortSignal;
}

export interface EngineClientOptions {
  /** The deadline of every call that does not set its own; 0 or less: none. */
  timeoutMs?: number;
}

export class EngineClient {
  private readonly session: Http2SessionManager;
  private readonly engine: Client<typeof EngineService>;
  private readonly healthService: Client<typeof Health>;

  /** `address` is HOST:PORT, as `ladle engine` prints it, or an http:// URL. */
  constructor(address: string, options: EngineClientOptions = {}) {
    const baseUrl = address.includes("://") ? address : `http://${address}`;
    this.session = new Http2SessionManager(baseUrl, { pingIntervalMs: KEEPALIVE_MS });
    const transport = createGrpcTransport({
      baseUrl,
      sessionManager: this.session,
      defaultTimeoutMs: options.timeoutMs ?? DEFAULT_TIMEOUT_MS,
      readMaxBytes: MAX_MESSAGE_BYTES,
      writeMaxBytes: MAX_MESSAGE_BYTES,
    });
    this.engine = createClient(EngineService, transport);
    this.healthService = createClient(Health, transport);
  }

  /** One request, the whole result. */
  generate(request: MessageInitShape<typeof GenerateRequestSchema>, options?: CallOptions): Promise<GenerateResponse> {
    return unary(this.engine.generate(request, options));
  }

  /** Deltas as the engine produces them; every message carries usageSoFar, the last one usage too. Leaving the
   * loop early cancels the call, as does `options.signal`; either way the engine aborts the request. */
  stream(request: MessageInitShape<typeof StreamRequestSchema>, options?: CallOptions): AsyncIterable<StreamResponse> {
    return streamed((opened) => this.engine.stream(request, opened), options);
  }

  /** Many independent items in, each result out as soon as it finishes, tagged with its item's `itemId`. Items
   * are sent while results arrive (the engine reads them as it has room); a bad item is an `error` outcome of
   * its own and the call goes on. */
  batch(items: Iterable<BatchItem> | AsyncIterable<BatchItem>, options?: CallOptions): AsyncIterable<BatchResponse> {
    return streamed((opened) => this.engine.batch(asAsync(items), opened), options);
  }

  /** One vector per input, in order. */
  embed(request: MessageInitShape<typeof EmbedRequestSchema>, options?: CallOptions): Promise<EmbedResponse> {
    return unary(this.engine.embed(request, options));
  }

  /** One score per document, in order. */
  score(request: MessageInitShape<typeof ScoreRequestSchema>, options?: CallOptions): Promise<ScoreResponse> {
    return unary(this.engine.score(request, options));
  }

  tokenize(request: MessageInitShape<typeof TokenizeRequestSchema>, options?: CallOptions): Promise<TokenizeResponse> {
    return unary(this.engine.tokenize(request, options));
  }

  /** The text of token ids, decoded as generated text is. */
  detokenize(
    request: MessageInitShape<typeof DetokenizeRequestSchema>,
    options?: CallOptions,
  ): Promise<DetokenizeResponse> {
    return unary(this.engine.detokenize(request, options));
  }

  modelInfo(options?: CallOptions): Promise<GetModelInfoResponse> {
    return unary(this.engine.getModelInfo({}, options));
  }

  load(options?: CallOptions): Promise<GetLoadResponse> {
    return unary(this.engine.getLoad({}, options));
  }

  /** Serve the LoRA adapter in folder `path` (on the engine's host) as `name`; requests then select it by
   * `adapter: name`. */
  loadAdapter(name: string, path: string, options?: CallOptions): Promise<LoadAdapterResponse> {
    return unary(this.engine.loadAdapter({ name, path }, options));
  }

  /** Stop serving adapter `name`; requests already running with it finish with it. */
  async unloadAdapter(name: string, options?: CallOptions): Promise<void> {
    await unary(this.engine.unloadAdapter({ name }, options));
  }

  /** The engine's grpc.health.v1 status for `service` ("" for the server as a whole). */
  async health(service: string = SERVICE, options: CallOptions = {}): Promise<HealthCheckResponse_ServingStatus> {
    const reply = await unary(this.healthService.check({ service }, { timeoutMs: HEALTH_TIMEOUT_MS, ...options }));
    return reply.status;
  }

  /** Resolves once the engine is SERVING (it answers UNAVAILABLE or NOT_SERVING while loading). */
  async waitUntilServing(timeoutMs = 300_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      try {
        if ((await this.health()) === HealthCheckResponse_ServingStatus.SERVING) return;
      } catch (error) {
        if (!(error instanceof EngineError && error.code === Code.Unavailable)) throw error;
      }
      if (Date.now() > deadline) throw new Error(`engine not SERVING after ${timeoutMs} ms`);
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
  }

  /** Closes the connection; calls still open end with CANCELLED or UNAVAILABLE. */
  close(): void {
    this.session.abort();
  }
}

async function unary<T>(call: Promise<T>): Promise<T> {
  try {
    return await call;
  } catch (error) {
    throw asEngineError(error);
  }
}

/** A streaming call, opened at the first `next()`. Connect's iterables cancel only by their AbortSignal, so a
 * caller that stops early (`break`, `return` or a throw in its `for await`) aborts this call's own signal, then
 * reads the call's end, which lets Connect close the HTTP/2 stream and clear its deadline timer. */
async function* streamed<T>(
  open: (options: CallOptions) => AsyncIterable<T>,
  options: CallOptions = {},
): AsyncGenerator<T, void, undefined> {
  const stop = new AbortController();
  const signal = options.signal ? AbortSignal.any([options.signal, stop.signal]) : stop.signal;
  const messages = open({ ...options, signal })[Symbol.asyncIterator]();
  let ended = false;
  try {
    for (let next = await messages.next(); !next.done; next = await messages.next()) yield next.value;
    ended = true;
  } catch (error) {
    ended = true;
    throw asEngineError(error);
  } finally {
    if (!ended) {
      stop.abort();
      await messages.next().catch(() => undefined); // CANCELLED, as asked
    }
  }
}

async function* asAsync<T>(items: Iterable<T> | AsyncIterable<T>): AsyncGenerator<T, void, undefined> {
  yield* items;
}
