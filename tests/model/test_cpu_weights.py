"""Float16 and int8 weights on CPU (``quantization="fp16"`` / ``"int8"``, ``draftwise.worker.model.cpu_weights``):

- a packed product is the float32 product of the weight's float16 values (float32 rounding,
  against float64), and a row alone agrees with the same row in any batch within float32
  rounding (as BLAS's float32 products do);
- loading packs every projection and the LM head, drops the float weights, and counts the
  bytes (half of float32's streamed per token);
- on SmolLM2-135M-Instruct, teacher-forced over held-out text, the logits stay within the
  tolerance docs/models.md states (fp16: max |diff| <= 0.15, argmax agreement >= 99%; int8:
  max |diff| <= 2.5, agreement >= 96%);
- inside the mode, speculation is exact as everywhere: greedy with the draft model and with
  n-gram lookup equals plain greedy, batched under chunked prefill and forced preemption;
- a decode step converts no weight: the profiler sees fbgemm's packed product once per
  projection and no copy or conversion of a weight-sized tensor, on the threads configured;
- every refusal is one line: an unknown mode, CUDA, a dtype other than float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draftwise.worker import default_model_path
from draftwise.worker.core.config import QUANTIZATIONS as CONFIG_QUANTIZATIONS
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.model import cpu_matmul
from draftwise.worker.model.cpu_weights import QUANTIZATIONS, PackedWeight
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.llama import Linear
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk
from draftwise.worker.text.tokenizer import load_tokenizer
from tests.engine.test_spec_exactness import _config, _requests, run_alone, run_together
from tests.model.smollm2 import require_smollm2

DOCS = Path(__file__).resolve().parents[2] / "docs"  # held-out text: no model here was trained on it
TOLERANCE_ABS = 0.15  # docs/models.md, "Lower-precision weights on CPU": max |logit diff| vs float32
AGREEMENT = 0.99  # and argmax agreement, teacher-forced over held-out text
INT8_TOLERANCE_ABS, INT8_AGREEMENT = 2.5, 0.96  # the same for int8 (measured 1.52 and 97.2%)


def test_the_config_and_the_kernels_name_the_same_modes():
    assert CONFIG_QUANTIZATIONS == QUANTIZATIONS


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 17, 64, 300])
def test_a_packed_product_is_the_float32_product_of_the_float16_values(rows):
    torch.manual_seed(rows)
    w = torch.randn(200, 96) * 0.05
    packed = PackedWeight(w, "fp16")
    values = packed.dense()
    assert torch.equal(values, w.half().float())  # the values the products use: float16 rounding, nothing else
    x = torch.randn(rows, 96)
    got = packed.matmul(x)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    exact = x.double() @ values.double().t()
    if rows:
        scale = (x.double().abs() @ values.double().abs().t()).max().item()
        assert (got.double() - exact).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 17, 64])
def test_an_int8_product_is_the_float32_product_of_the_int8_values(rows):
    torch.manual_seed(rows)
    w = torch.randn(208, 96) * 0.05
    w[3] = 0.0  # an all-zero group: scale 1, values 0
    packed = PackedWeight(w, "int8")
    assert packed.kernel == "draftwise"
    values = packed.dense()
    q, scale = cpu_matmul.quantize_int8(w)
    assert torch.equal(values, q.float() * scale.repeat_interleave(cpu_matmul.INT8_GROUP, dim=1))
    assert torch.equal(values[3], torch.zeros(96))
    # each value is within half a step of its group's scale of the float32 one
    step = scale.repeat_interleave(cpu_matmul.INT8_GROUP, dim=1)
    assert ((values - w).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(rows, 96)
    got = packed.matmul(x)
    assert got.shape == (rows, 208) and got.dtype == torch.float32
    if rows:
        exact = x.double() @ values.double().t()
        bound = (x.double().abs() @ values.double().abs().t()).max().item()
        assert (got.double() - exact).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * bound


def test_int8_keeps_what_the_kernel_cannot_pack_as_float32_values():
    """An output width off the panel: the int8 values, dequantized; inputs off the group: float32."""
    torch.manual_seed(1)
    w = torch.randn(40, 64) * 0.05  # 40 outputs: not whole panels
    packed = PackedWeight(w, "int8")
    assert packed.kernel == "torch"
    assert torch.equal(packed.dense(), cpu_matmul.dequantize_int8(*cpu_matmul.quantize_int8(w)))
    odd = PackedWeight(torch.randn(48, 40), "int8")  # 40 inputs: not whole groups of 32
    assert odd.kernel == "torch" and odd.dense().dtype == torch.float32
    x = torch.randn(3, 64)
    assert torch.allclose(packed.matmul(x), x @ packed.dense().t())


def test_a_row_gives_the_same_product_alone_and_in_any_batch():
    """fbgemm picks its kernel by the number of rows, so a row's sum may round differently
    alone than in a batch, as BLAS's float32 products do: within float32 rounding of each other
    (the greedy tests below compare the tokens themselves)."""
    torch.manual_seed(0)
    packed = PackedWeight(torch.randn(960, 576) * 0.05, "fp16")
    x = torch.randn(70, 576)
    whole = packed.matmul(x)
    scale = (x.abs() @ packed.dense().abs().t()).max().item()
    for rows in (1, 2, 3, 5, 8, 16, 33):
        for start in (0, rows // 2, 70 - rows):
            part = packed.matmul(x[start : start + rows])
            diff = (part - whole[start : start + rows]).abs().max().item()
            assert diff <= 16 * torch.finfo(torch.float32).eps * scale, (rows, start, diff)


def test_loading_packs_every_projection_and_the_head():
    ref = load_model(default_model_path("target"))
    loaded = load_model(default_model_path("target"), quantization="fp16")
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    head = model._lm_head  # noqa: SLF001
    assert model.lm_head is not None or (head is not None and head.packed is not None)
    assert loaded.quantization == "fp16"
    # per token: the projections and head in float16, norms in float32; the embedding rows are looked up
    assert abs(loaded.streamed_bytes - ref.streamed_bytes / 2) < 0.01 * ref.streamed_bytes
    # every unpacked weight is the float16 rounding of the float32 one
    for (name, a), b in zip(ref.model.named_modules(), loaded.model.modules(), strict=True):
        if isinstance(a, Linear):
            assert isinstance(b, Linear)
            assert torch.equal(b.dense_weight(), a.dense_weight().half().float()), name


def _teacher_forced_logits(path, mode: str | None, prompts: list[list[int]]) -> list[torch.Tensor]:
    loaded = load_model(path, quantization=mode)
    blocks = max(len(p) for p in prompts) // 16 + 1
    runner = ModelRunner(loaded, KVCache(loaded.kv_config, blocks, 16, torch.float32, "cpu"))
    return [runner.run([SequenceChunk(p, 0, list(range(blocks)), num_logits=len(p))]) for p in prompts]


def test_smollm2_fp16_logits_stay_within_the_documented_tolerance():
    path = require_smollm2()
    tok = load_tokenizer(path)
    docs = sorted(DOCS.glob("*.md"))
    assert len(docs) >= 6, "docs/*.md: the held-out text this test reads"
    prompts = [tok.encode(d.read_text()[:2000])[:200] for d in docs[:6]]
    ref = _teacher_forced_logits(path, None, prompts)
    got = _teacher_forced_logits(path, "fp16", prompts)
    diff = max((a - b).abs().max().item() for a, b in zip(ref, got, strict=True))
    positions = sum(len(p) for p in prompts)
    agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref, got, strict=True)) / positions
    assert 0 < diff <= TOLERANCE_ABS, diff  # 0 would mean the mode changed nothing
    assert agree >= AGREEMENT, (agree, positions)


def test_loading_int8_packs_every_projection_and_streams_a_quarter_of_float32():
    ref = load_model(default_model_path("target"))
    loaded = load_model(default_model_path("target"), quantization="int8")
    linears = loaded.model.linears()
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert loaded.quantization == "int8"
    assert all(m.packed.kernel == "draftwise" for m in linears if m.packed is not None)
    # 1 byte a weight + a float32 scale per 32 (1.125 bytes) against 4: about 0.28x (norms stay float32)
    assert 0.27 * ref.streamed_bytes < loaded.streamed_bytes < 0.30 * ref.streamed_bytes, (
        loaded.streamed_bytes / ref.streamed_bytes
    )


def test_smollm2_int8_logits_stay_within_the_documented_tolerance():
    path = require_smollm2()
    tok = load_tokenizer(path)
    prompts = [tok.encode(d.read_text()[:2000])[:200] for d in sorted(DOCS.glob("*.md"))[:6]]
    ref = _teacher_forced_logits(path, None, prompts)
    got = _teacher_forced_logits(path, "int8", prompts)
    diff = max((a - b).abs().max().item() for a, b in zip(ref, got, strict=True))
    positions = sum(len(p) for p in prompts)
    agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref, got, strict=True)) / positions
    assert 0 < diff <= INT8_TOLERANCE_ABS, diff
    assert agree >= INT8_AGREEMENT, (agree, positions)


_WORKLOADS: dict[str, tuple] = {}


def _workload(mode: str) -> tuple:
    """The requests and their plain greedy tokens alone in ``mode`` (made once per mode)."""
    if mode not in _WORKLOADS:
        reqs = _requests(40, seed=7)
        _WORKLOADS[mode] = reqs, run_alone(reqs, quantization=mode)
    return _WORKLOADS[mode]


FIXED_K = {"num_speculative_tokens": 4, "speculative_adaptive": False}  # drafts every step, so that some are accepted
DRAFT = {"speculative_model": "default", **FIXED_K}


@pytest.mark.parametrize(
    ("mode", "spec"),
    [("fp16", {}), ("fp16", DRAFT), ("fp16", {"speculative_method": "ngram", **FIXED_K}), ("int8", DRAFT)],
)
def test_greedy_is_exact_in_the_mode_batched_with_speculation_chunking_and_preemption(mode, spec):
    reqs, alone = _workload(mode)
    engine = LLMEngine(
        _config(
            quantization=mode,
            max_num_batched_tokens=48,
            max_num_seqs=12,
            num_kv_blocks=40,  # forces preemption
            **spec,
        )
    )
    together = run_together(reqs, engine)
    assert engine.scheduler.num_preemptions > 0
    mismatched = [rid for rid in alone if together[rid] != alone[rid]]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. {mismatched[:5]}"
    if spec:
        assert engine.spec_totals["accepted"] > 0, engine.spec_totals
    engine.check_idle_invariants()


def _step_ops(engine: LLMEngine) -> list:
    from torch.profiler import ProfilerActivity, profile

    engine.add_request("warm", [1, 5, 9, 300], _greedy(3))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("r", [1, 5, 9, 300, 41], _greedy(4))
    engine.step()  # the prompt
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.step()  # one decode step
    while engine.has_unfinished_requests():
        engine.step()
    return [e for e in prof.events() if e.input_shapes is not None]


def _greedy(n: int):
    from draftwise.worker.sampling.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _weight_copies(engine: LLMEngine) -> tuple[list, list]:
    """One decode step's ops that copy or convert a tensor at least as large as the smallest
    weight, and all its ops."""
    linears = [m for m in engine.loaded.model.modules() if isinstance(m, Linear)]
    smallest = min(m.in_features * m.out_features for m in linears)
    events = _step_ops(engine)
    copies = [
        e
        for e in events
        if e.name in ("aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous", "aten::clone")
        and any(isinstance(s, list) and len(s) and torch.Size(s).numel() >= smallest for s in e.input_shapes)
    ]
    return copies, events


@pytest.mark.parametrize("mode", [None, "fp16", "int8"])
@pytest.mark.parametrize("kernels", ["draftwise", "torch"])
def test_a_decode_step_converts_no_weight_and_runs_on_the_configured_threads(mode, kernels, monkeypatch):
    """Every projection and the LM head: one product a step, by this package's CPU kernel
    (cpu_matmul; it builds on this machine) or, with DRAFTWISE_CPU_KERNELS=0, by torch's
    (int8 needs the kernel: refused in one line without it)."""
    if kernels == "torch" and mode == "int8":
        monkeypatch.setenv(cpu_matmul.ENV, "0")
        with pytest.raises(ModelLoadError, match="int8' needs this package's CPU kernel") as e:
            LLMEngine(_config(num_kv_blocks=32, quantization=mode))
        assert "\n" not in str(e.value) and cpu_matmul.ENV in str(e.value)
        return
    if kernels == "torch":
        monkeypatch.setenv(cpu_matmul.ENV, "0")
    else:
        assert cpu_matmul.kernel() is not None, cpu_matmul.unavailable_reason()
    calls = []
    matmul = cpu_matmul.matmul
    monkeypatch.setattr(
        cpu_matmul, "matmul", lambda x, panels, scales=None: calls.append(panels.shape) or matmul(x, panels, scales)
    )
    threads = torch.get_num_threads()
    engine = LLMEngine(_config(num_kv_blocks=32, quantization=mode))
    model = engine.loaded.model
    calls.clear()
    copies, events = _weight_copies(engine)
    assert torch.get_num_threads() == threads
    assert not copies, [(e.name, e.input_shapes) for e in copies[:5]]
    products = len(model.linears())  # every projection and the LM head, one product each
    torch_products = sum(e.name in ("aten::bmm", "aten::mm", "aten::addmm") for e in events)
    fbgemm_products = sum(e.name == "quantized::linear_dynamic_fp16" for e in events)
    steps = 3 + 4  # _step_ops runs the warm-up request's 3 steps and the profiled request's 4
    if kernels == "draftwise":
        assert all(m.panels or m.packed is not None for m in model.linears())
        assert len(calls) == products * steps, (len(calls), products)
        assert torch_products == 0 and fbgemm_products == 0
    elif mode == "fp16":
        assert not calls and fbgemm_products == products
    else:
        # column blocks (one batched product each) with several threads, [in, out] (one product each) with one
        assert not calls and torch_products == products
        assert not any(e.name.startswith("quantized::") for e in events)


def test_the_check_sees_a_weight_converted_per_step(monkeypatch):
    """The test above can fail: a projection that converts its weight on every call is seen."""
    engine = LLMEngine(_config(num_kv_blocks=32))
    monkeypatch.setattr(Linear, "forward", lambda self, x: x @ self.dense_weight().to(torch.float64).float().t())
    copies, _ = _weight_copies(engine)
    assert copies


def test_a_float16_draft_beside_a_float32_target_is_exact_and_accepts_as_the_float_draft():
    """speculative_quantization="fp16" (or "int8"): only the draft is packed; greedy output is plain
    greedy's (batched, chunked, preempted), and the draft's acceptance stays near the float32 draft's."""
    reqs = _requests(40, seed=8)
    alone = run_alone(reqs)
    accepted = {}
    for mode in (None, "fp16", "int8"):
        engine = LLMEngine(
            _config(
                speculative_model="default",
                speculative_quantization=mode,
                max_num_batched_tokens=48,
                max_num_seqs=12,
                num_kv_blocks=40,  # forces preemption
                **FIXED_K,
            )
        )
        assert engine.proposer is not None
        draft_packed = [lin.packed is not None for lin in engine.proposer.loaded.model.linears()]
        assert all(draft_packed) if mode else not any(draft_packed)
        assert not any(lin.packed is not None for lin in engine.loaded.model.linears())  # the target stays float32
        together = run_together(reqs, engine)
        assert engine.scheduler.num_preemptions > 0
        assert [rid for rid in alone if together[rid] != alone[rid]] == []
        t = engine.spec_totals
        accepted[mode] = t["accepted"] / t["proposed"]
        engine.check_idle_invariants()
    assert accepted["fp16"] > 0 and abs(accepted["fp16"] - accepted[None]) <= 0.03, accepted
    assert accepted["int8"] > 0 and abs(accepted["int8"] - accepted[None]) <= 0.06, accepted


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"speculative_quantization": "int4", "speculative_model": "default"}, "speculative_quantization must be"),
        ({"speculative_quantization": "fp16", "speculative_method": "ngram"}, "applies to a draft model"),
        ({"speculative_quantization": "fp16", "speculative_model": "default", "device": "cuda"}, "needs device cpu"),
        ({"quantization": "int4"}, "quantization must be one of fp16, int8"),
        ({"quantization": "int8", "device": "cuda"}, "needs device cpu"),
        ({"quantization": "fp16", "device": "cuda"}, "needs device cpu"),
        ({"quantization": "fp16", "dtype": "bfloat16"}, "dtype float32 or auto"),
    ],
)
def test_a_bad_quantization_is_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        EngineConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_the_loader_refuses_fp16_with_another_dtype():
    with pytest.raises(ModelLoadError, match="dtype float32 or auto") as e:
        load_model(default_model_path("target"), dtype="bfloat16", quantization="fp16")
    assert "\n" not in str(e.value)
