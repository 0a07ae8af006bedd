// The draftwise TypeScript client: generated GenerateService stubs (protobuf-es v2) and a small
// typed wrapper over Connect's gRPC transport.

export { Client, Stream, chat, collect, startMessage, text, tokenIds } from "./client.js";
export type { ClientOptions, Completion, Request } from "./client.js";
export { Session, SessionRequest } from "./session.js";
export { DEFAULT_RESUME, DraftwiseError, isTransportError } from "./errors.js";
export type { ResumePolicy } from "./errors.js";
export * from "./gen/draftwise/v1/generation_pb.js";
export * from "./gen/draftwise/v1/generate_service_pb.js";
