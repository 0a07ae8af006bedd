// A small typed client of draftwise.v1.GenerateService over Connect's gRPC transport (HTTP/2).

import { create } from "@bufbuild/protobuf";
import { Code, createClient, type Client as ConnectClient, type Interceptor } from "@connectrpc/connect";
import { createGrpcTransport, Http2SessionManager } from "@connectrpc/connect-node";
import type { MessageInitShape } from "@bufbuild/protobuf";
import {
  GenerateService,
  type GenerateStreamRequestSchema,
  type ListModelsResponse,
} from "./gen/draftwise/v1/generate_service_pb.js";
import {
  PromptSchema,
  type Finished,
  type GenerationEvent,
  type Prompt,
  type SamplingParamsSchema,
  type SpeculationOptionsSchema,
  type StartGenerationSchema,
} from "./gen/draftwise/v1/generation_pb.js";
import { DEFAULT_RESUME, DraftwiseError, isTransportError, Progress, resumeDelayMs, type ResumePolicy } from "./errors.js";
import { Session } from "./session.js";

/** Options of a Client. */
export interface ClientOptions {
  /** Sent as "authorization: Bearer KEY" on every call (servers started with --api-key-file). */
  apiKey?: string;
  /** Dial with TLS (https); default plaintext HTTP/2. */
  tls?: boolean;
  /** PEM root certificates for TLS (default: Node's roots). */
  rootCertificates?: string;
  /** How a Stream resumes after its connection dropped; default DEFAULT_RESUME ({maxAttempts: 0}: never). */
  resume?: ResumePolicy;
}

/** One generation request. */
export interface Request {
  /** Names the request on a Session (unique among its in-flight requests); on stream() it may be empty. */
  id?: string;
  /** A served model's name; empty: the default model. */
  model?: string;
  /** text(...), chat(...) or tokenIds(...). */
  prompt: MessageInitShape<typeof PromptSchema>;
  /** Sampling parameters (vLLM's names, camelCase); unset fields take the server's defaults. */
  params?: MessageInitShape<typeof SamplingParamsSchema>;
  /** Per-request speculative decoding settings; unset: the model's. */
  speculation?: MessageInitShape<typeof SpeculationOptionsSchema>;
}

/** The StartGeneration message of req. */
export function startMessage(req: Request): MessageInitShape<typeof StartGenerationSchema> {
  return {
    requestId: req.id ?? "",
    model: req.model ?? "",
    prompt: req.prompt,
    samplingParams: req.params,
    speculation: req.speculation,
  };
}

/** A text prompt (tokenized by the server). */
export function text(s: string): Prompt {
  return create(PromptSchema, { kind: { case: "text", value: s } });
}

/** A prompt of token ids, used as they are. */
export function tokenIds(ids: number[]): Prompt {
  return create(PromptSchema, { kind: { case: "tokenIds", value: { ids } } });
}

/** A conversation, rendered by the server with the model's chat template. */
export function chat(messages: { role: string; content: string }[]): Prompt {
  return create(PromptSchema, { kind: { case: "chat", value: { messages } } });
}

/** A whole request's result. */
export interface Completion {
  requestId: string;
  text: string;
  tokenIds: number[];
  /** [first_token_index, token count] of each delta received. */
  deltas: [number, number][];
  finished?: Finished;
}

/** Read events to their end into a Completion. */
export async function collect(events: AsyncIterable<GenerationEvent>, into?: Completion): Promise<Completion> {
  const out: Completion = into ?? { requestId: "", text: "", tokenIds: [], deltas: [] };
  for await (const ev of events) {
    out.requestId = ev.requestId;
    if (ev.kind.case === "delta") {
      const d = ev.kind.value;
      out.text += d.text;
      out.tokenIds.push(...d.tokenIds);
      out.deltas.push([d.firstTokenIndex, d.tokenIds.length]);
    } else if (ev.kind.case === "finished") {
      out.finished = ev.kind.value;
    }
  }
  return out;
}

/** A connection to a draftwise gateway. */
export class Client {
  /** The generated Connect client, for anything the wrapper does not cover. */
  readonly stub: ConnectClient<typeof GenerateService>;
  readonly resumePolicy: ResumePolicy;
  private readonly sessions: Http2SessionManager;

  /** target: "host:port". */
  constructor(target: string, options: ClientOptions = {}) {
    const baseUrl = `${options.tls ? "https" : "http"}://${target}`;
    const interceptors: Interceptor[] = [];
    if (options.apiKey) {
      const header = `Bearer ${options.apiKey}`;
      interceptors.push((next) => (req) => {
        req.header.set("authorization", header);
        return next(req);
      });
    }
    const nodeOptions = options.rootCertificates ? { ca: options.rootCertificates } : {};
    this.sessions = new Http2SessionManager(baseUrl, {}, nodeOptions);
    const transport = createGrpcTransport({ baseUrl, interceptors, sessionManager: this.sessions });
    this.stub = createClient(GenerateService, transport);
    this.resumePolicy = options.resume ?? DEFAULT_RESUME;
  }

  /** Close the HTTP/2 connection (calls in flight fail). */
  close(): void {
    this.sessions.abort();
  }

  /** The served models and the default one. */
  async listModels(signal?: AbortSignal): Promise<ListModelsResponse> {
    try {
      return await this.stub.listModels({}, { signal });
    } catch (err) {
      throw DraftwiseError.fromCall(err);
    }
  }

  /** Start req on GenerateStream; iterate the returned Stream for its events. */
  stream(req: Request, signal?: AbortSignal): Stream {
    return new Stream(this, { start: startMessage(req) }, new Progress(req.id ?? ""), signal);
  }

  /** Reattach to a request whose call went away: events from nextIndex on, then the rest live. */
  resume(handle: string, nextIndex: number, signal?: AbortSignal): Stream {
    const progress = new Progress();
    progress.handle = handle;
    progress.nextIndex = nextIndex;
    return new Stream(this, { resume: { resumeHandle: handle, nextTokenIndex: nextIndex } }, progress, signal);
  }

  /** Run req on GenerateStream and return its whole result. */
  async complete(req: Request, signal?: AbortSignal): Promise<Completion> {
    return collect(this.stream(req, signal));
  }

  /** Open a Generate stream: many requests multiplexed on one call. */
  session(signal?: AbortSignal): Session {
    return new Session(this, signal);
  }
}

/**
 * One request on GenerateStream: an async iterable of its events (deltas, then the finished
 * event). Should the connection drop after the first delta, iteration reconnects and resumes
 * the request with its resume handle: one uninterrupted stream, no gap, no duplicate.
 */
export class Stream implements AsyncIterable<GenerationEvent> {
  /** Resumes sent. */
  resumes = 0;
  private readonly abort = new AbortController();
  private started = false;

  constructor(
    private readonly client: Client,
    private readonly first: MessageInitShape<typeof GenerateStreamRequestSchema>,
    private readonly progress: Progress,
    private readonly signal?: AbortSignal,
  ) {
    signal?.addEventListener("abort", () => this.abort.abort(signal.reason), { once: true });
  }

  get requestId(): string {
    return this.progress.requestId;
  }

  /** The request's resume handle ("" before its first delta). */
  get resumeHandle(): string {
    return this.progress.handle;
  }

  /** Index of the first output token not yet received. */
  get nextIndex(): number {
    return this.progress.nextIndex;
  }

  /**
   * End the call. A request that already sent its first delta keeps running on the server for
   * its resume retention time: client.resume(resumeHandle, nextIndex) reattaches.
   */
  close(): void {
    this.abort.abort();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<GenerationEvent> {
    if (this.started) throw new Error("a Stream can be iterated once");
    this.started = true;
    const policy = this.client.resumePolicy;
    let request = this.first;
    let attempts = 0;
    try {
      for (;;) {
        const call = new AbortController();
        const onAbort = () => call.abort();
        this.abort.signal.addEventListener("abort", onAbort, { once: true });
        try {
          for await (const res of this.client.stub.generateStream(request, { signal: call.signal })) {
            const ev = res.event;
            if (!ev) continue;
            if (!this.progress.requestId) this.progress.requestId = ev.requestId;
            if (!this.progress.accept(ev)) continue;
            attempts = 0;
            yield ev;
            if (ev.kind.case === "finished") return;
          }
          throw new DraftwiseError(Code.Unavailable, "the call ended without a finished event", this.progress.requestId);
        } catch (err) {
          if (this.abort.signal.aborted) return; // closed by the caller
          const e = DraftwiseError.fromCall(err, this.progress.requestId);
          e.resumes = this.resumes;
          if (!this.progress.handle || !isTransportError(e) || attempts >= policy.maxAttempts || this.signal?.aborted) throw e;
          attempts += 1;
          await new Promise((r) => setTimeout(r, resumeDelayMs(policy, attempts)));
          this.resumes += 1;
          request = { resume: { resumeHandle: this.progress.handle, nextTokenIndex: this.progress.nextIndex } };
        } finally {
          this.abort.signal.removeEventListener("abort", onAbort);
          call.abort();
        }
      }
    } finally {
      this.abort.abort();
    }
  }
}
