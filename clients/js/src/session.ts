// Many requests multiplexed on one Generate stream.

import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import type { GenerateRequestSchema } from "./gen/draftwise/v1/generate_service_pb.js";
import type { GenerationEvent } from "./gen/draftwise/v1/generation_pb.js";
import { DraftwiseError, Progress } from "./errors.js";
import { AsyncQueue } from "./queue.js";
import { startMessage, type Client, type Request } from "./client.js";

type Outgoing = MessageInitShape<typeof GenerateRequestSchema>;

/**
 * One Generate call: requests multiplexed on one bidirectional stream, each with its own id,
 * cancellable on its own; a per-request error ends that request only. A reader task hands
 * each event to its request's SessionRequest.
 */
export class Session {
  /** Settles when the call has ended: after closeSend() once every request finished, or on failure. */
  readonly done: Promise<void>;
  private readonly outgoing = new AsyncQueue<Outgoing>();
  private readonly requests = new Map<string, SessionRequest>();
  private readonly abort = new AbortController();
  private ended: unknown = undefined;
  private isEnded = false;
  private sendClosed = false;

  constructor(client: Client, signal?: AbortSignal) {
    signal?.addEventListener("abort", () => this.abort.abort(signal.reason), { once: true });
    this.done = this.read(client);
    this.done.catch(() => undefined); // a failure reaches each request; done rejects for whoever awaits it
  }

  private async read(client: Client): Promise<void> {
    let failure: DraftwiseError | undefined;
    try {
      for await (const res of client.stub.generate(this.outgoing, { signal: this.abort.signal })) {
        const ev = res.event;
        if (!ev) continue;
        const r = this.requests.get(ev.requestId);
        if (!r) continue;
        if (ev.kind.case === "finished" || ev.kind.case === "error") this.requests.delete(ev.requestId);
        r.events.push(ev);
        if (ev.kind.case === "finished" || ev.kind.case === "error") r.events.close();
      }
    } catch (err) {
      failure = DraftwiseError.fromCall(err);
    }
    this.isEnded = true;
    this.ended = failure;
    this.outgoing.close();
    for (const [id, r] of this.requests) {
      r.events.close(
        failure
          ? new DraftwiseError(failure.code, failure.detail, id)
          : new DraftwiseError(Code.Unavailable, "the stream ended without a final event", id),
      );
    }
    this.requests.clear();
    if (failure) throw failure;
  }

  private register(id: string): SessionRequest {
    if (!id) throw new DraftwiseError(Code.InvalidArgument, "a session request needs an id");
    if (this.isEnded) throw new DraftwiseError(Code.FailedPrecondition, `the session has ended: ${String(this.ended ?? "closed")}`, id);
    if (this.sendClosed) throw new DraftwiseError(Code.FailedPrecondition, "closeSend() was called: no new requests", id);
    if (this.requests.has(id)) {
      throw new DraftwiseError(Code.InvalidArgument, `request id "${id}" is already in flight on this session`, id);
    }
    const r = new SessionRequest(this, id);
    this.requests.set(id, r);
    return r;
  }

  /** Send req (its id must be set and unique among the session's in-flight requests). */
  start(req: Request): SessionRequest {
    const r = this.register(req.id ?? "");
    this.outgoing.push({ action: { case: "start", value: startMessage(req) } });
    return r;
  }

  /** Reattach a request started on a call that went away, under the id id. */
  resume(handle: string, nextIndex: number, id: string): SessionRequest {
    const r = this.register(id);
    r.progress.handle = handle;
    r.progress.nextIndex = nextIndex;
    this.outgoing.push({ action: { case: "resume", value: { resumeHandle: handle, nextTokenIndex: nextIndex, requestId: id } } });
    return r;
  }

  /** @internal */
  sendCancel(id: string): void {
    this.outgoing.push({ action: { case: "cancel", value: { requestId: id } } });
  }

  /** Half-close: the in-flight requests finish, then the call ends OK (see done). */
  closeSend(): void {
    this.sendClosed = true;
    this.outgoing.close();
  }

  /** Cancel the call: requests that sent a delta stay resumable for the server's retention time. */
  close(): void {
    this.abort.abort();
  }
}

/** One request of a Session: an async iterable of its events (deltas, then the finished event). */
export class SessionRequest implements AsyncIterable<GenerationEvent> {
  /** @internal */
  readonly events = new AsyncQueue<GenerationEvent>();
  /** @internal */
  readonly progress: Progress;

  constructor(
    private readonly session: Session,
    readonly id: string,
  ) {
    this.progress = new Progress(id);
  }

  /** Ask the server to stop the request: its final event is finished with FINISH_REASON_ABORT. */
  cancel(): void {
    this.session.sendCancel(this.id);
  }

  /** The request's resume handle ("" before its first delta). */
  get resumeHandle(): string {
    return this.progress.handle;
  }

  /** Index of the first output token not yet received. */
  get nextIndex(): number {
    return this.progress.nextIndex;
  }

  /** Events until the final one; a per-request error event is thrown as a DraftwiseError. */
  async *[Symbol.asyncIterator](): AsyncIterator<GenerationEvent> {
    for await (const ev of this.events) {
      if (ev.kind.case === "error") throw DraftwiseError.fromEvent(ev);
      if (!this.progress.accept(ev)) continue;
      yield ev;
      if (ev.kind.case === "finished") return;
    }
  }
}
