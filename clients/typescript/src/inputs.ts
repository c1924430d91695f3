/**
 * Builders of `ladle.v1.Input`, the oneof every request starts from: text, chat messages or token ids.
 *
 * Protobuf-ES writes a oneof as `{ kind: { case: "text", value: "..." } }`; these say the same in one word.
 */

import type { MessageInitShape } from "@bufbuild/protobuf";
import type { ChatInputSchema, ChatMessageSchema, InputSchema } from "./gen/ladle/v1/types_pb.js";

export type InputInit = MessageInitShape<typeof InputSchema>;
export type ChatMessageInit = MessageInitShape<typeof ChatMessageSchema>;
export type ChatOptions = Omit<MessageInitShape<typeof ChatInputSchema>, "messages" | "$typeName">;

/** Prompt text; the engine adds the tokenizer's special tokens (e.g. BOS) as the model expects. */
export function text(value: string): InputInit {
  return { kind: { case: "text", value } };
}

/** A conversation, rendered with the model's own chat template; `options` adds tools, tool_choice and the rest. */
export function chat(messages: ChatMessageInit[], options: ChatOptions = {}): InputInit {
  return { kind: { case: "chat", value: { ...options, messages } } };
}

/** Prompt token ids, used as they are. */
export function tokenIds(ids: Iterable<number>): InputInit {
  return { kind: { case: "tokenIds", value: { ids: [...ids] } } };
}
