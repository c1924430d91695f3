/**
 * EngineError: how every failed call of the client surfaces, a gRPC status code with the engine's message.
 *
 * The engine reports failures as status codes, never inside a success message (see engine.proto):
 * INVALID_ARGUMENT names the refused field in its `ladle-param` trailer, RESOURCE_EXHAUSTED means its waiting
 * queue is full (retry later), UNAVAILABLE that it is loading or draining, DEADLINE_EXCEEDED and CANCELLED that
 * the call's deadline passed or its AbortSignal fired (the engine then aborts the request).
 */

import { Code, ConnectError } from "@connectrpc/connect";

export { Code };

/** Trailing metadata of an INVALID_ARGUMENT: the offending field in OpenAI's vocabulary, when known. */
export const PARAM_METADATA_KEY = "ladle-param";

export class EngineError extends Error {
  override readonly name = "EngineError";
  /** The gRPC status code (`Code.InvalidArgument`, `Code.ResourceExhausted`, ...). */
  readonly code: Code;
  /** The engine's own message, without the code Connect puts in front of `message`. */
  readonly rawMessage: string;
  /** The field the engine refused (its `ladle-param` trailer), for INVALID_ARGUMENT. */
  readonly param: string | undefined;
  /** The response headers and trailers. */
  readonly metadata: Headers;

  constructor(cause: ConnectError) {
    super(cause.message, { cause });
    this.code = cause.code;
    this.rawMessage = cause.rawMessage;
    this.param = cause.metadata.get(PARAM_METADATA_KEY) ?? undefined;
    this.metadata = cause.metadata;
  }
}

/** A ConnectError as an EngineError; anything else (a caller's own error) as it is. */
export function asEngineError(reason: unknown): unknown {
  return reason instanceof ConnectError ? new EngineError(reason) : reason;
}
