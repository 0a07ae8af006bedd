#!/usr/bin/env node
// draftwise-example: the TypeScript client against a running server. It streams one
// completion, resumes a request whose call it dropped on purpose, multiplexes three requests on
// one Generate stream, cancelling one of them, and shows that a request the server refuses
// (top_p 2) ends alone on its stream.
//
//   node dist/example.js --server 127.0.0.1:50051 [--prompt "def fibonacci(n):"] [--max-tokens 24] [--model NAME] [--json]
//
// With --json it prints one JSON object per scenario (machine-readable); otherwise the text.
// With --pause-after N it runs one scenario instead, "reconnect": it streams a request, and after
// N deltas prints {"paused": true} and waits for a line on stdin (time to break the connection,
// say) before reading on; the client resumes the request by itself if the connection broke.

import { createInterface } from "node:readline";
import { parseArgs } from "node:util";
import { FinishReason } from "./gen/draftwise/v1/generation_pb.js";
import { Client, collect, text, type Completion, type Request } from "./index.js";

interface Result {
  id: string;
  text: string;
  token_ids: number[];
  deltas: [number, number][];
  finish_reason: string;
  prompt_tokens: number;
  completion_tokens: number;
  resume_handle: boolean;
  resumes: number;
  error?: string;
}

function toResult(c: Completion, handle: string, err?: unknown): Result {
  const f = c.finished;
  const r: Result = {
    id: c.requestId,
    text: c.text,
    token_ids: c.tokenIds,
    deltas: c.deltas,
    finish_reason: f ? `FINISH_REASON_${FinishReason[f.finishReason]}` : "",
    prompt_tokens: f?.usage?.promptTokens ?? 0,
    completion_tokens: f?.usage?.completionTokens ?? 0,
    resume_handle: handle !== "",
    resumes: 0,
  };
  if (err !== undefined) r.error = err instanceof Error ? err.message : String(err);
  return r;
}

function empty(id: string): Completion {
  return { requestId: id, text: "", tokenIds: [], deltas: [] };
}

function params(maxTokens: number): Request["params"] {
  return { maxTokens, temperature: 0, ignoreEos: true };
}

async function run(
  client: Client,
  model: string,
  prompt: string,
  maxTokens: number,
  print: (name: string, results: Result[]) => void,
): Promise<void> {
  // 1. stream one completion
  const s = client.stream({ model, prompt: text(prompt), params: params(maxTokens) });
  const streamed = await collect(s);
  print("stream", [toResult(streamed, s.resumeHandle)]);

  // 2. resume: read the first delta, drop the call, reattach with the resume handle
  const dropped = client.stream({ model, prompt: text(prompt), params: params(maxTokens) });
  const whole = empty("");
  for await (const ev of dropped) {
    whole.requestId = ev.requestId;
    if (ev.kind.case === "delta") {
      whole.text += ev.kind.value.text;
      whole.tokenIds.push(...ev.kind.value.tokenIds);
      whole.deltas.push([ev.kind.value.firstTokenIndex, ev.kind.value.tokenIds.length]);
    }
    break; // leaving the loop ends the call; the server keeps the request for its resume retention time
  }
  await collect(client.resume(dropped.resumeHandle, dropped.nextIndex), whole);
  print("resume", [toResult(whole, dropped.resumeHandle)]);

  // 3. multiplex three requests on one Generate stream; cancel the long one after its first delta
  const session = client.session();
  const reqs: Request[] = [
    { id: "a", model, prompt: text(prompt), params: params(maxTokens) },
    { id: "b", model, prompt: text("class Stack:"), params: params(Math.floor(maxTokens / 2)) },
    { id: "long", model, prompt: text("import os"), params: params(400) },
  ];
  const results = await Promise.all(
    reqs.map(async (req) => {
      const r = session.start(req);
      const out = empty(r.id);
      try {
        if (req.id === "long") {
          for await (const ev of r) {
            if (ev.kind.case === "delta") {
              out.text += ev.kind.value.text;
              out.tokenIds.push(...ev.kind.value.tokenIds);
              out.deltas.push([ev.kind.value.firstTokenIndex, ev.kind.value.tokenIds.length]);
              r.cancel();
            } else if (ev.kind.case === "finished") {
              out.finished = ev.kind.value;
            }
          }
        } else {
          await collect(r, out);
        }
        out.requestId = r.id;
        return toResult(out, r.resumeHandle);
      } catch (err) {
        return toResult(out, r.resumeHandle, err);
      }
    }),
  );
  session.closeSend();
  await session.done;
  print("multiplex", results);
  const failed = results.find((r) => r.error);
  if (failed) throw new Error(failed.error);

  // 4. a per-request error ends that request only: the stream and its other request go on
  const session2 = client.session();
  const bad = session2.start({ id: "bad", model, prompt: text(prompt), params: { maxTokens: 4, topP: 2 } });
  const good = session2.start({ id: "good", model, prompt: text(prompt), params: params(4) });
  const settle = async (r: typeof bad): Promise<Result> => {
    const out = empty(r.id);
    try {
      await collect(r, out);
      out.requestId = r.id;
      return toResult(out, r.resumeHandle);
    } catch (err) {
      out.requestId = r.id;
      return toResult(out, r.resumeHandle, err);
    }
  };
  const [badResult, goodResult] = await Promise.all([settle(bad), settle(good)]);
  session2.closeSend();
  await session2.done;
  print("request-error", [badResult, goodResult]);
  if (goodResult.error) throw new Error(goodResult.error);
  if (!badResult.error) throw new Error("a request with top_p 2 was accepted");
}

/** Stream one request; after pauseAfter deltas print {"paused": true} and wait for a line on stdin. */
async function reconnect(
  client: Client,
  model: string,
  prompt: string,
  maxTokens: number,
  pauseAfter: number,
  print: (name: string, results: Result[]) => void,
): Promise<void> {
  const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  const s = client.stream({ model, prompt: text(prompt), params: params(maxTokens) });
  const out = empty("");
  let deltas = 0;
  try {
    for await (const ev of s) {
      out.requestId = ev.requestId;
      if (ev.kind.case === "delta") {
        out.text += ev.kind.value.text;
        out.tokenIds.push(...ev.kind.value.tokenIds);
        out.deltas.push([ev.kind.value.firstTokenIndex, ev.kind.value.tokenIds.length]);
        if (++deltas === pauseAfter) {
          console.log(JSON.stringify({ paused: true }));
          await lines.next();
        }
      } else if (ev.kind.case === "finished") {
        out.finished = ev.kind.value;
      }
    }
  } catch (err) {
    print("reconnect", [{ ...toResult(out, s.resumeHandle, err), resumes: s.resumes }]);
    throw err;
  } finally {
    await lines.return?.();
  }
  print("reconnect", [{ ...toResult(out, s.resumeHandle), resumes: s.resumes }]);
}

async function main(): Promise<number> {
  const { values } = parseArgs({
    options: {
      server: { type: "string", default: "127.0.0.1:50051" },
      "api-key": { type: "string", default: process.env.DRAFTWISE_API_KEY ?? "" },
      prompt: { type: "string", default: "def fibonacci(n):" },
      "max-tokens": { type: "string", default: "24" },
      model: { type: "string", default: "" },
      "pause-after": { type: "string", default: "0" },
      json: { type: "boolean", default: false },
    },
  });
  const maxTokens = Number(values["max-tokens"]);
  if (!Number.isInteger(maxTokens) || maxTokens < 2) {
    console.error("draftwise-example: --max-tokens must be an integer of at least 2");
    return 2;
  }
  const print = (name: string, results: Result[]) => {
    if (values.json) {
      console.log(JSON.stringify({ scenario: name, requests: results }));
      return;
    }
    for (const r of results) {
      console.log(`== ${name} ${r.id}: ${r.finish_reason} (${r.prompt_tokens}+${r.completion_tokens} tokens)${r.error ? ` error: ${r.error}` : ""}\n${r.text}`);
    }
  };
  const client = new Client(values.server, { apiKey: values["api-key"] || undefined });
  try {
    const pauseAfter = Number(values["pause-after"]);
    if (pauseAfter > 0) await reconnect(client, values.model, values.prompt, maxTokens, pauseAfter, print);
    else await run(client, values.model, values.prompt, maxTokens, print);
    return 0;
  } catch (err) {
    console.error(`draftwise-example: ${err instanceof Error ? err.message : String(err)}`);
    return 1;
  } finally {
    client.close();
  }
}

process.exitCode = await main();
