// Errors and resume bookkeeping shared by Stream and Session.

import { Code, ConnectError } from "@connectrpc/connect";
import type { GenerationEvent } from "./gen/draftwise/v1/generation_pb.js";

/** A request that failed: the call's gRPC status, or a per-request error event on a Session. */
export class DraftwiseError extends Error {
  /** The gRPC status code (Connect's Code has the same numbers). */
  readonly code: Code;
  /** What the server said. */
  readonly detail: string;
  /** The request it is about ("" when the whole call failed). */
  readonly requestId: string;
  /** The server's retry hint on RESOURCE_EXHAUSTED, in milliseconds (0: none). */
  readonly retryAfterMs: number;
  /** Resumes sent for the request before this error. */
  resumes = 0;

  constructor(code: Code, detail: string, requestId = "", retryAfterMs = 0) {
    super(`${requestId ? `request ${requestId}: ` : ""}${Code[code] ?? code}: ${detail}`);
    this.name = "DraftwiseError";
    this.code = code;
    this.detail = detail;
    this.requestId = requestId;
    this.retryAfterMs = retryAfterMs;
  }

  /** The error of a failed call. */
  static fromCall(err: unknown, requestId = ""): DraftwiseError {
    if (err instanceof DraftwiseError) return err;
    const e = ConnectError.from(err);
    return new DraftwiseError(e.code, e.rawMessage, requestId);
  }

  /** The error of a per-request error event. */
  static fromEvent(ev: GenerationEvent): DraftwiseError {
    const e = ev.kind.case === "error" ? ev.kind.value : undefined;
    return new DraftwiseError(e?.code ?? Code.Unknown, e?.message ?? "", ev.requestId, e?.retryAfterMs ?? 0);
  }
}

/**
 * What Node's HTTP/2 stack says when the transport broke under a call, which Connect reports as
 * INTERNAL, UNKNOWN or ABORTED (a reset socket: "read ECONNRESET") rather than UNAVAILABLE. (The
 * server's own ABORTED, "resumed on another connection", says none of these.)
 */
const TRANSPORT_DETAILS = ["econnreset", "econnrefused", "socket hang up", "stream closed", "goaway", "session closed", "premature close", "err_http2"];

/** Whether err says the connection failed (rather than the server ending the request). */
export function isTransportError(err: DraftwiseError): boolean {
  if (err.code === Code.Unavailable) return true;
  // A session torn down under a call (a reset connection) closes its streams with RST_STREAM CANCEL, which
  // Connect reports as CANCELED; the caller's own cancel never resumes (Stream checks its signal first).
  if (err.code === Code.Canceled) return err.detail.toLowerCase().includes("stream closed with error code cancel");
  if (err.code === Code.Internal || err.code === Code.Unknown || err.code === Code.Aborted) {
    const d = err.detail.toLowerCase();
    return TRANSPORT_DETAILS.some((t) => d.includes(t));
  }
  return false;
}

/** How Stream resumes a request whose connection dropped after its first delta. */
export interface ResumePolicy {
  /** Reconnections in a row without a new event before the error is thrown (0: never resume). */
  maxAttempts: number;
  /** Delay before the first reconnection, in milliseconds; it doubles up to maxBackoffMs. */
  initialBackoffMs: number;
  /** Upper bound of the delay, in milliseconds. */
  maxBackoffMs: number;
}

/** The client's default: up to 5 reconnections in a row, 50 ms doubling to 2 s. */
export const DEFAULT_RESUME: ResumePolicy = { maxAttempts: 5, initialBackoffMs: 50, maxBackoffMs: 2000 };

export function resumeDelayMs(policy: ResumePolicy, attempt: number): number {
  return Math.min(policy.maxBackoffMs, policy.initialBackoffMs * 2 ** (attempt - 1));
}

/**
 * What the caller has of one request: its resume handle and the index of the first token it
 * has not received. Drops replayed deltas; a gap is DATA_LOSS.
 */
export class Progress {
  handle = "";
  nextIndex = 0;
  finished = false;

  constructor(public requestId = "") {}

  /** Record ev; false for a delta the caller already has. Throws DraftwiseError(DATA_LOSS) on a gap. */
  accept(ev: GenerationEvent): boolean {
    if (ev.kind.case !== "delta") {
      if (ev.kind.case === "finished") {
        if (this.finished) return false;
        this.finished = true;
      }
      return true;
    }
    const d = ev.kind.value;
    if (d.resumeHandle && !this.handle) this.handle = d.resumeHandle;
    const end = d.firstTokenIndex + d.tokenIds.length;
    if (d.firstTokenIndex === this.nextIndex) {
      this.nextIndex = end;
      return true;
    }
    if (end <= this.nextIndex && d.tokenIds.length > 0) return false;
    throw new DraftwiseError(
      Code.DataLoss,
      `delta at token ${d.firstTokenIndex} (+${d.tokenIds.length}) after ${this.nextIndex} tokens received`,
      this.requestId,
    );
  }
}
