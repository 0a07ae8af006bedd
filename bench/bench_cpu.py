"""The real-model CPU path against llama.cpp on the same GGUF files, each ratio measured in one run:

0. ``products``: the model's weight products alone for 1-64 rows: float32 and fp16 by this
   package's kernel (``worker/model/cpu_matmul.py``) and by torch's (column blocks, fbgemm:
   what runs with ``DRAFTWISE_CPU_KERNELS=0``), and torch's CPU kernels not offered (weight-only
   int8 and int4, fbgemm's dynamic int8, with its accuracy against float32).
1. ``decode``: batch-1 decode tokens/s, in-process (``LLM.generate``) for float32, float16, int8
   and int4 weights (``--quantization none|fp16|int8|int4``), against ``llama-bench`` (tg) on the F32, F16, Q8_0 and
   Q4_1 files, and against the memory roofline (bytes a step streams / read bandwidth).
1b. ``depth``: the same decode after a prompt of 2048 tokens (its keys and values read every token),
   against ``llama-bench -d 2048``.
2. ``served``: the same over HTTP (``draftwise serve`` vs ``llama-server``, one request at a
   time, non-streamed): decode tokens/s and time to first token of a 256-token prompt; our
   served decode against our in-process decode.
3. ``concurrent``: 8 and 32 concurrent requests (64-token prompts, 64 new tokens each) against
   ``llama-server`` with as many slots: output tokens/s (both servers up, their rounds in turn).
4. ``startup``: seconds from ``draftwise serve --model FILE`` to its serving line.

Ours and llama.cpp's figures are taken in turn, ROUNDS rounds each (decode, depth, concurrent), and a
ratio is the median of the rounds' ratios: this VM's memory bandwidth drifts over minutes.
In-process decode rates are (N - 1) / (seconds from a request's first token to its last), the
request's own timings (``RequestOutput.metrics``: the prompt's prefill left out, as llama-bench's
``tg`` leaves it out); served ones (N - 1) / (time of N tokens - time of 1 token); each request with
a prompt of its own (no prefix-cache hit), greedy, ``ignore_eos``.

    python bench/bench_cpu.py [--model MODEL] [--llama-cpp DIR] [--only products,decode,depth,served,concurrent,startup]

``--llama-cpp``: a folder with ``llama-bench``, ``llama-server`` and ``llama-quantize`` (built from
the sources vendored in the ``llama-cpp-python`` sdist: docs/benchmarks.md, section ``cpu``).
The F32, F16 and Q8_0 files are made once from the model's file by ``llama-quantize
--allow-requantize`` into ``.cache/models`` (F32 holds exactly the values our loader dequantizes
from the Q4_1 file). Without it only our own figures are measured.
Writes docs/benchmarks.md (section ``cpu-<model>``) and bench/results/cpu_<model>.json.
"""

from __future__ import annotations

import draftwise  # noqa: F401  (before torch: it sets GOMP_SPINCOUNT, which OpenMP reads as torch loads it)

# isort: split

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, add_model_argument, for_model, machine, model_label, write_section  # noqa: E402

from draftwise.worker.paths import resolve_model  # noqa: E402

NEW = 128
PROMPT = 64
ROUNDS = 3  # ours and llama.cpp in turn, per mode (interleaved)
DEPTH = 2048  # ``depth``: the context a long conversation brings (decode then reads its keys and values each token)
MODES = {
    "float32": ("F32", None),
    "fp16": ("F16", "fp16"),
    "int8": ("Q8_0", "int8"),
    "int4": ("Q4_1", "int4"),  # the model's own file: int4 holds its Q4_1 weights exactly (and int8 its Q8_0 ones)
}  # ours -> (llama.cpp file, --quantization)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(1000, 40000) for _ in range(length - 1)] for _ in range(n)]


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a 1 GiB sum reads: the median of ``repeats`` rounds (the fastest round once
    read 58.9 GB/s on a machine whose rounds otherwise read 28-31)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    times = sorted(_timed(x.sum) for _ in range(repeats))
    return nbytes / times[len(times) // 2]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gguf_files(model: Path, bin_dir: Path | None) -> dict[str, Path]:
    """The model's own file and, with llama.cpp, F32 / F16 / Q8_0 files made from it."""
    files = {model.stem.rsplit(".", 1)[-1].upper(): model}
    if bin_dir is None:
        return files
    out = ROOT / ".cache" / "models"
    out.mkdir(parents=True, exist_ok=True)
    base = model.stem.rsplit(".", 1)[0]
    for kind in ("F32", "F16", "Q8_0"):
        path = out / f"{base}.{kind}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(".part")
            subprocess.run(
                [str(bin_dir / "llama-quantize"), "--allow-requantize", str(model), str(tmp), kind],
                check=True,
                capture_output=True,
            )
            tmp.rename(path)
        files[kind] = path
    return files


# ---- in-process


def in_process_decoder(path: Path, quantization: str | None, threads: int, prompt: int = PROMPT) -> tuple:
    """(a function that decodes NEW tokens after a fresh ``prompt``-token prompt and returns the rate, the
    load's figures): the engine loaded once, warmed up."""
    from draftwise.worker import LLM, SamplingParams

    torch.set_num_threads(threads)
    t = time.perf_counter()
    llm = LLM(model=str(path), quantization=quantization, skip_tokenizer_init=True)
    load_s = time.perf_counter() - t
    ps = iter(prompts(20, prompt, seed=3))

    def rate() -> float:  # tokens after the first over the seconds from the first to the last (prefill left out)
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        m = llm.generate([next(ps)], params, use_tqdm=False)[0].metrics
        assert m.first_token_time is not None and m.finish_time is not None
        return (NEW - 1) / (m.finish_time - m.first_token_time)

    rate()  # warm-up: the first runs after a load are up to 20% slower
    rate()
    loaded = llm.engine.loaded
    return rate, {"load_s": load_s, "streamed_mb": loaded.streamed_bytes / 1e6}


def in_process_decode(path: Path, quantization: str | None, threads: int, prompt: int = PROMPT) -> dict:
    """Our rate alone (the median of three runs) and the load's figures."""
    rate, info = in_process_decoder(path, quantization, threads, prompt)
    return {"tokens_per_s": statistics.median(rate() for _ in range(3)), **info}


def interleaved(ours, theirs, rounds: int = ROUNDS) -> dict:
    """Our rate and llama.cpp's (``theirs``: None when not measured) taken in turn, ``rounds`` times: the
    medians and the median of each round's ratio. This VM's memory bandwidth drifts by 10-40% over minutes;
    measured one after the other, a ratio is mostly that drift (2026-12-04: our float32 decode 88 and then 61
    tokens/s in back-to-back runs of one script)."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        a.append(ours())
        if theirs is not None:
            b.append(theirs())
    out = {"tokens_per_s": statistics.median(a), "rounds": a}
    if b:
        out.update(llama_cpp=statistics.median(b), llama_cpp_rounds=b)
        out["ratio"] = statistics.median(x / y for x, y in zip(a, b, strict=True))
    return out


def llama_bench(bin_dir: Path, path: Path, threads: int, depth: int = 0, repeats: int = 3) -> float:
    res = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(NEW)]
        + ["-r", str(repeats)]
        + ["-d", str(depth), "-o", "json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(res.stdout)[0]["avg_ts"])


def llama_decoder(bin_dir: Path | None, path: Path, threads: int, depth: int = 0):
    """One llama-bench round (``-r 1``) as a function, or None without llama.cpp."""
    if bin_dir is None:
        return None
    return lambda: llama_bench(bin_dir, path, threads, depth, repeats=1)


# ---- served


class Server:
    def __init__(self, argv: list[str], url: str, ready: str, log: Path, env: dict[str, str] | None = None) -> None:
        self.url, self.log = url, log
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        while ready not in log.read_text():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited:\n{log.read_text()[-3000:]}")
            if time.perf_counter() - self.t0 > 600:
                raise RuntimeError(f"{argv[0]} not ready in 600 s")
            time.sleep(0.05)
        self.ready_s = time.perf_counter() - self.t0
        self.client = httpx.Client(timeout=600)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        time.sleep(3)  # the workers' exit, before anything else is timed


def start_ours(path: Path, quantization: str | None, threads: int, tmp: Path, cache: Path | None = None) -> Server:
    port = free_port()
    argv = [
        str(Path(sys.executable).parent / "draftwise"),
        "serve",
        "--model",
        str(path),
        "--workers",
        "1",
        "--model-name",
        "bench",
    ]
    argv += ["--port", "0", "--http-port", str(port), "--log-level", "info", "--log-format", "json"]
    argv += ["--quantization", quantization or "none"]  # none: float32 weights, not the default's exact codes
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    if cache is not None:
        env["DRAFTWISE_CACHE_DIR"] = str(cache)
    return Server(argv, f"http://127.0.0.1:{port}", "draftwise serving", tmp / "ours.log", env)


def start_llama(bin_dir: Path, path: Path, threads: int, slots: int, tmp: Path) -> Server:
    port = free_port()
    argv = [str(bin_dir / "llama-server"), "-m", str(path), "-t", str(threads), "-np", str(slots)]
    argv += ["-c", str(slots * 2 * (PROMPT + NEW)), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    return Server(argv, f"http://127.0.0.1:{port}", "listening on http", tmp / "llama.log")


def complete(server: Server, prompt: list[int], n: int, llama: bool) -> float:
    if llama:
        body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
        t = time.perf_counter()
        r = server.client.post(server.url + "/completion", json=body)
        dt = time.perf_counter() - t
        r.raise_for_status()
        assert r.json()["tokens_predicted"] == n, r.text[:300]
    else:
        body = {"model": "bench", "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0}
        t = time.perf_counter()
        r = server.client.post(server.url + "/v1/completions", json=body)
        dt = time.perf_counter() - t
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == n, r.text[:300]
    return dt


def streamed(server: Server, prompt: list[int]) -> float:
    """Our decode rate streamed (SSE, one event per token as it comes): (NEW - 1) tokens over the
    seconds from the first event with text to the last."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": NEW, "ignore_eos": True, "temperature": 0}
    times = []
    with server.client.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    assert len(times) >= 2, times
    return (NEW - 1) / (times[-1] - times[0])


def served(server: Server, llama: bool, in_process=None, rounds: int = ROUNDS) -> dict:
    """Served decode (non-streamed: (N - 1) / (time of N tokens - time of 1 token), median of 3) and
    the time to first token of a 256-token prompt. With ``in_process`` (our engine's rate in this
    process), each of ``rounds`` rounds also times it and our streamed decode, in turn: the ratios
    are the medians of the rounds' ratios (this VM's bandwidth drifts between invocations)."""
    ps = iter(prompts(40 + 8 * rounds, PROMPT, seed=5))
    long = iter(prompts(6, 256, seed=6))
    complete(server, next(ps), 8, llama)  # warm-up

    def whole() -> float:
        full = statistics.median(complete(server, next(ps), NEW, llama) for _ in range(3))
        first = statistics.median(complete(server, next(ps), 1, llama) for _ in range(3))
        return (NEW - 1) / (full - first)

    out: dict = {}
    if in_process is None:
        out["tokens_per_s"] = whole()
    else:
        rows = [(in_process(), whole(), streamed(server, next(ps))) for _ in range(rounds)]
        out["tokens_per_s"] = statistics.median(r[1] for r in rows)
        out["streamed_tokens_per_s"] = statistics.median(r[2] for r in rows)
        out["in_process_tokens_per_s"] = statistics.median(r[0] for r in rows)
        out["ratio"] = statistics.median(r[1] / r[0] for r in rows)
        out["streamed_ratio"] = statistics.median(r[2] / r[0] for r in rows)
        out["rounds"] = rows
    out["ttft_256_s"] = statistics.median(complete(server, next(long), 1, llama) for _ in range(3))
    return out


def concurrent(server: Server, n: int, llama: bool, new: int = 64, round_: int = 0) -> float:
    ps = prompts(n, PROMPT, seed=100 + n + 1000 * round_)  # each round its own prompts: no prefix-cache hit
    complete(server, ps[0][:8], 4, llama)
    with ThreadPoolExecutor(n) as pool:
        t = time.perf_counter()
        list(pool.map(lambda p: complete(server, p, new, llama), ps))
        dt = time.perf_counter() - t
    return n * new / dt


# ---- the weight products alone, and the kernels not offered


def _products(fns: list, widths: list[int], rows: int, repeats: int = 7) -> float:
    """Median seconds of every projection's product, back to back, for ``rows`` rows."""
    xs = {w: torch.randn(rows, w) for w in set(widths)}

    def once() -> None:
        for f, w in zip(fns, widths, strict=True):
            f(xs[w])

    once()
    return statistics.median(_timed(once) for _ in range(repeats))


class DynamicInt8:
    """fbgemm's dynamic int8 product of a weight ``[out, in]`` (per-channel int8 weights,
    activations quantized to 7 bits per call): measured here, not offered (docs/models.md)."""

    def __init__(self, w: torch.Tensor) -> None:
        import warnings

        scale = (w.abs().amax(1) / 127).clamp(min=1e-12).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated as an API; fbgemm's op takes them
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.contiguous(), self._packed, True)


def products(path: Path, threads: int) -> dict:
    """Per row count: ms of the model's products for float32 and fp16 by this package's kernel and
    by torch's (column blocks, fbgemm), and torch's other CPU kernels: weight-only int8 and int4,
    fbgemm's dynamic int8."""
    from draftwise.worker.model import cpu_matmul
    from draftwise.worker.model.loader import load_model

    torch.set_num_threads(threads)
    out: dict = {}
    if cpu_matmul.kernel() is None:
        raise SystemExit(f"the CPU kernel does not run here: {cpu_matmul.unavailable_reason()}")
    layers = load_model(path).model.linears()
    ours16 = load_model(path, quantization="fp16").model.linears()
    ours8 = load_model(path, quantization="int8").model.linears()
    os.environ[cpu_matmul.ENV] = "0"  # laid out and packed for torch's products (read at load time)
    try:
        blocks = load_model(path).model.linears()
        fbgemm = load_model(path, quantization="fp16").model.linears()
    finally:
        del os.environ[cpu_matmul.ENV]
    dense = [m.dense_weight() for m in layers]
    widths = [w.shape[1] for w in dense]
    kernels: dict[str, list] = {
        "float32 (draftwise kernel)": [m.product for m in layers],
        "float32 (torch, column blocks)": [m.product for m in blocks],
        "fp16 (draftwise kernel)": [m.product for m in ours16],
        "fp16 (fbgemm)": [m.product for m in fbgemm],
        "int8, groups of 32 (draftwise kernel)": [m.product for m in ours8],
        "int8 dynamic (fbgemm, activations 7-bit)": [DynamicInt8(w).matmul for w in dense],
    }
    pack8 = [((w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8), w.abs().amax(1) / 127) for w in dense]
    kernels["int8 weight-only (torch._weight_int8pack_mm)"] = [
        lambda x, q=q, s=s: torch._weight_int8pack_mm(x, q, s) for q, s in pack8
    ]
    pack4 = []
    for w in dense:
        o, i = w.shape
        g = w.reshape(o, i // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        sc = ((hi - lo) / 15).clamp(min=1e-8)
        q = ((g - lo[..., None]) / sc[..., None]).round().clamp(0, 15).to(torch.int32).reshape(o, i)
        zeros = torch.stack([sc, lo + 8 * sc], -1).transpose(0, 1).contiguous()
        pack4.append((torch._convert_weight_to_int4pack_for_cpu(q, 1), zeros))
    kernels["int4 weight-only (torch._weight_int4pack_mm_for_cpu)"] = [
        lambda x, p=p, z=z: torch._weight_int4pack_mm_for_cpu(x, p, 32, z) for p, z in pack4
    ]
    for rows in (1, 2, 3, 4, 5, 8, 16, 64):
        out[str(rows)] = {name: 1e3 * _products(fns, widths, rows) for name, fns in kernels.items()}
        print(rows, out[str(rows)], flush=True)
    return out


def int8_agreement(path: Path, texts: list[str]) -> dict:
    """fbgemm's dynamic int8 (every projection and the LM head) against float32, teacher-forced
    over ``texts``: max |logit diff| and argmax agreement (what keeps it out of the offered modes)."""
    from draftwise.worker.model.kv_cache import KVCache
    from draftwise.worker.model.loader import load_model
    from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk
    from draftwise.worker.text.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    ids = [tok.encode(t)[:200] for t in texts]

    def logits(loaded) -> list[torch.Tensor]:
        runner = ModelRunner(loaded, KVCache(loaded.kv_config, 16, 16, torch.float32, "cpu"))
        return [runner.run([SequenceChunk(p, 0, list(range(16)), num_logits=len(p))]) for p in ids]

    ref = logits(load_model(path))
    loaded = load_model(path)
    for m in loaded.model.linears():
        m.packed = DynamicInt8(m.dense_weight())  # type: ignore[assignment]  # the packed product's interface
    got = logits(loaded)
    n = sum(len(p) for p in ids)
    return {
        "positions": n,
        "max_abs_logit_diff": max((a - b).abs().max().item() for a, b in zip(ref, got, strict=True)),
        "argmax_agreement": sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref, got, strict=True)) / n,
    }


def model_arg(ap: argparse.ArgumentParser) -> None:
    add_model_argument(ap)
    ap.set_defaults(model="smollm2-135m-instruct")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arg(ap)
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_BIN"))
    ap.add_argument("--only", default="products,decode,depth,served,concurrent,startup")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    which = set(args.only.split(","))
    model = resolve_model(args.model)
    files = gguf_files(model, args.llama_cpp)
    name = for_model("cpu", args.model, "_")
    out_path = ROOT / "bench" / "results" / f"{name}.json"
    r: dict = json.loads(out_path.read_text()) if out_path.exists() else {}
    r.update({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "model": args.model, "threads": args.threads})
    r.setdefault("files", {}).update({k: f"{v.name} ({v.stat().st_size / 1e6:.0f} MB)" for k, v in files.items()})

    def save() -> None:
        out_path.parent.mkdir(exist_ok=True)
        out_path.write_text(json.dumps(r, indent=1) + "\n")
        write_section(for_model("cpu", args.model), render(r))

    if "products" in which:
        r["products_ms"] = products(files.get("F32", model), args.threads)
        texts = [p.read_text()[:2000] for p in sorted((ROOT / "docs").glob("*.md"))[:6]]
        r["int8_dynamic_accuracy"] = int8_agreement(model, texts)
        print(r["int8_dynamic_accuracy"], flush=True)
        save()
    if "decode" in which:
        r["read_gb_s"] = read_bandwidth() / 1e9
        r["decode"] = {}
        r["llama_bench"] = {}
        for mode, (kind, quant) in MODES.items():
            path = files.get(kind, model)
            rate, info = in_process_decoder(path, quant, args.threads)
            got = interleaved(rate, llama_decoder(args.llama_cpp, path, args.threads))
            r["decode"][mode] = {**info, **got, "file": path.name}
            if "llama_cpp" in got:
                r["llama_bench"][kind] = got["llama_cpp"]
            del rate
            print(mode, r["decode"][mode], flush=True)
        save()
    if "depth" in which:
        r["depth"] = {"tokens": DEPTH, "ours": {}, "llama.cpp": {}, "ratio": {}}
        for mode, (kind, quant) in MODES.items():
            path = files.get(kind, model)
            rate, _ = in_process_decoder(path, quant, args.threads, prompt=DEPTH)
            got = interleaved(rate, llama_decoder(args.llama_cpp, path, args.threads, depth=DEPTH))
            del rate
            r["depth"]["ours"][mode] = got["tokens_per_s"]
            if "llama_cpp" in got:
                r["depth"]["llama.cpp"][kind] = got["llama_cpp"]
                r["depth"]["ratio"][mode] = got["ratio"]
            print("depth", mode, got, flush=True)
            save()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if which & {"served", "concurrent", "startup"}:
            r.setdefault("served", {})
            r.setdefault("concurrent", {})
            r.setdefault("startup_s", {})
            for mode, (kind, quant) in MODES.items():
                path = files.get(kind, model)
                cache = tmp / f"cache-{mode}"  # empty: the first start converts the GGUF tokenizer
                first = start_ours(path, quant, args.threads, tmp, cache)
                first.close()
                s = start_ours(path, quant, args.threads, tmp, cache)
                key = f"llama.cpp {kind}"
                theirs = None
                try:
                    r["startup_s"][mode] = {"first": first.ready_s, "again": s.ready_s, "file": path.name}
                    if args.llama_cpp and which & {"served", "concurrent"}:  # both up: their rounds take turns
                        theirs = start_llama(args.llama_cpp, path, args.threads, 32, tmp)
                    if "served" in which:  # our engine in this process too: both decode in turn
                        rate, _ = in_process_decoder(path, quant, args.threads)
                        r["served"][mode] = served(s, llama=False, in_process=rate)
                        del rate
                        if theirs is not None:
                            r["served"][key] = served(theirs, llama=True)
                    if "concurrent" in which:
                        r["concurrent"][mode], their_rates = {}, {}
                        for n in (8, 32):
                            a, b = [], []
                            for i in range(ROUNDS):
                                a.append(concurrent(s, n, llama=False, round_=i))
                                if theirs is not None:
                                    b.append(concurrent(theirs, n, llama=True, round_=i))
                            r["concurrent"][mode][str(n)] = statistics.median(a)
                            if b:
                                their_rates[str(n)] = statistics.median(b)
                                ratios = (x / y for x, y in zip(a, b, strict=True))
                                r["concurrent"][mode][f"ratio_{n}"] = statistics.median(ratios)
                        if their_rates:
                            r["concurrent"][key] = their_rates
                finally:
                    s.close()
                    if theirs is not None:
                        theirs.close()
                print(mode, r["served"].get(mode), r["concurrent"].get(mode), r["startup_s"][mode], flush=True)
                print(key, r["served"].get(key), r["concurrent"].get(key), flush=True)
                save()
    save()


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def render(r: dict) -> str:
    model = r.get("model")
    lines = [
        f"## CPU path against llama.cpp ({model_label(model)})",
        "",
        f"Command: `python bench/bench_cpu.py --model {model} --llama-cpp DIR` — {r.get('date')}, {r.get('machine')}, "
        f"{r.get('threads')} threads everywhere. Files: "
        + ", ".join(f"{k}: {v}" for k, v in r.get("files", {}).items())
        + ".",
        "",
        "llama.cpp: `llama-bench`, `llama-server` and `llama-quantize` built from the llama.cpp sources vendored in "
        "the `llama-cpp-python` 0.3.36 sdist (`pip download --no-deps --no-binary :all: llama-cpp-python`; in its "
        "`vendor/llama.cpp`: `cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "
        "-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF && cmake --build build -j 2 --target llama-server llama-bench "
        "llama-quantize`, about 25 minutes on 2 cores); llama-server with 32 slots, `cache_prompt: false`.",
        "",
        "`--only` reruns some sections and keeps the others' results: a section's figures come from one invocation "
        "(every ratio compares figures of the same invocation), different sections may come from different ones.",
        "",
    ]
    pm = r.get("products_ms")
    if pm:
        names = list(next(iter(pm.values())))
        lines += [
            "### The weight products alone (ms for every projection and the LM head, back to back)",
            "",
            "| rows | " + " | ".join(names) + " |",
            "| --- |" + " --- |" * len(names),
            *[f"| {rows} | " + " | ".join(f"{v[n]:.1f}" for n in names) + " |" for rows, v in pm.items()],
            "",
        ]
        acc = r.get("int8_dynamic_accuracy")
        if acc:
            lines += [
                f"fbgemm's dynamic int8 against float32, teacher-forced over {acc['positions']} tokens of held-out text: "
                f"max |logit diff| {acc['max_abs_logit_diff']:.2f}, argmax agreement {acc['argmax_agreement']:.1%} "
                "(not offered; fp16's: docs/models.md).",
                "",
            ]
    dec, lb = r.get("decode", {}), r.get("llama_bench", {})
    if dec:
        bw = r.get("read_gb_s", 0) * 1e9
        lines += [
            "### Batch-1 decode, in-process (tokens/s)",
            "",
            "| draftwise mode | file | tokens/s | llama.cpp, same file | ratio (goal >= 1.0) | roofline fraction (goal >= 0.5) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for mode, (kind, _) in MODES.items():
            d = dec.get(mode)
            if not d:
                continue
            roof = bw / (d["streamed_mb"] * 1e6) if bw else None
            theirs = lb.get(kind)
            ratio = f"{d['ratio']:.2f}x" if "ratio" in d else _ratio(d["tokens_per_s"], theirs)
            lines.append(
                f"| {mode} | {d['file']} | {d['tokens_per_s']:.1f} | {theirs or 0:.1f} | "
                f"{ratio} | {d['tokens_per_s'] / roof if roof else 0:.2f} "
                f"({d['streamed_mb']:.0f} MB a step at {bw / 1e9:.1f} GB/s) |"
            )
        best = max((d["tokens_per_s"] for d in dec.values()), default=0)
        for kind in ("Q8_0", "Q4_1"):
            if kind in lb:
                lines.append(
                    f"| fastest of ours vs llama.cpp {kind} (goal >= 0.8) | | {best:.1f} | {lb[kind]:.1f} | "
                    f"{_ratio(best, lb[kind])} | |"
                )
        lines.append("")
    dp = r.get("depth")
    if dp:
        lines += [
            f"### Batch-1 decode after a {dp['tokens']}-token prompt, in-process (tokens/s; llama.cpp: `llama-bench -d "
            f"{dp['tokens']}`)",
            "",
            "| draftwise mode | tokens/s | llama.cpp, same file | ratio |",
            "| --- | --- | --- | --- |",
        ]
        for mode, (kind, _) in MODES.items():
            if mode in dp["ours"]:
                theirs = dp["llama.cpp"].get(kind)
                rr = dp.get("ratio", {}).get(mode)
                ratio = f"{rr:.2f}x" if rr is not None else _ratio(dp["ours"][mode], theirs)
                lines.append(f"| {mode} | {dp['ours'][mode]:.1f} | {theirs or 0:.1f} | {ratio} |")
        lines.append("")
    sv = r.get("served", {})
    if sv:
        lines += [
            "### Served over HTTP, one request at a time",
            "",
            "| server | decode tokens/s | in-process, in turn | served / in-process (goal within 10%) | streamed "
            "tokens/s | streamed / in-process | TTFT, 256-token prompt (s) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for key, v in sv.items():
            if "ratio" in v:  # in turn with our in-process decode
                cells = [
                    f"{v['in_process_tokens_per_s']:.1f}",
                    f"{v['ratio']:.2f}x",
                    f"{v['streamed_tokens_per_s']:.1f}",
                    f"{v['streamed_ratio']:.2f}x",
                ]
            else:
                inproc = dec.get(key, {}).get("tokens_per_s")
                cells = ["-", _ratio(v["tokens_per_s"], inproc) if inproc else "-", "-", "-"]
            lines.append(f"| {key} | {v['tokens_per_s']:.1f} | {' | '.join(cells)} | {v['ttft_256_s']:.3f} |")
        lines.append("")
    cc = r.get("concurrent", {})
    if cc:
        lines += [
            "### Concurrent requests (64-token prompts, 64 new tokens each; llama-server with 32 slots)",
            "",
            "| server | 8 requests: tokens/s | 32 requests: tokens/s | 32: vs llama.cpp, same file (goal >= 2x) |",
            "| --- | --- | --- | --- |",
        ]
        for key, v in cc.items():
            kind = MODES.get(key, ("",))[0]
            theirs = cc.get(f"llama.cpp {kind}", {}).get("32")
            ratio = f"{v['ratio_32']:.2f}x" if "ratio_32" in v else _ratio(v["32"], theirs) if kind else ""
            lines.append(f"| {key} | {v['8']:.1f} | {v['32']:.1f} | {ratio} |")
        lines.append("")
    st = r.get("startup_s", {})
    if st:
        lines += [
            "### Start-up: `draftwise serve --model FILE` to its serving line (goal <= 15 s)",
            "",
            "| mode | file | first start (GGUF tokenizer converted and cached), s | next start, s |",
            "| --- | --- | --- | --- |",
            *[
                f"| {k} | {v.get('file', '')} | {v['first']:.1f} | {v['again']:.1f} |"
                for k, v in st.items()
                if isinstance(v, dict)
            ],
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
