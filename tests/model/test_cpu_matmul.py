"""The CPU weight-streaming kernel (worker/model/cpu_matmul.py, cpu_matmul.cpp):

- it builds and loads on this machine (x86-64 with AVX2/FMA/F16C and g++: CI's kind), on
  PyTorch's own OpenMP runtime (one libgomp in the process);
- float32 and float16 panels against a float64 reference, for every row count through
  several passes of the kernel's rows (1-20, 64) and odd input widths;
- a row's result does not depend on the rows beside it or on the thread count (bitwise):
  a verify pass over k + 1 rows gives each row what a one-row step would;
- pack / unpack round-trip, and the shapes it refuses;
- DRAFTWISE_CPU_KERNELS=0, a missing compiler and a failing compile each leave the kernel
  out with a reason, and the model's products fall back to torch's with the same results;
- the compiled library is cached: a second build reuses the file.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from draftwise.worker.model import cpu_matmul
from draftwise.worker.model.llama import Linear


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


def test_the_kernel_builds_here_on_torchs_openmp_runtime():
    assert cpu_matmul.kernel() is not None, cpu_matmul.unavailable_reason()
    assert cpu_matmul.unavailable_reason() is None
    code = (
        "import torch; from draftwise.worker.model import cpu_matmul; assert cpu_matmul.kernel() is not None; "
        "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    libs = eval(out)
    assert len(libs) == 1 and "torch" in libs[0], libs  # torch's libgomp, not a second runtime


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("in_features", [576, 1536, 37])
def test_products_match_a_float64_reference(dtype, in_features):
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(96, in_features, generator=g) * 0.05
    panels = cpu_matmul.pack(w, dtype)
    wq = w.to(dtype).float()  # the values the kernel multiplies by
    for rows in [*range(1, 21), 64]:
        x = torch.randn(rows, in_features, generator=g)
        y = cpu_matmul.matmul(x, panels)
        ref = _ref(x, wq)
        scale = (x.abs().double() @ wq.abs().double().T).float()  # sum |x||w|: float32 rounding's bound
        assert y.shape == (rows, 96) and y.dtype == torch.float32
        assert ((y - ref).abs() <= 1e-5 * scale + 1e-6).all(), (rows, (y - ref).abs().max().item())
    assert cpu_matmul.matmul(torch.empty(0, in_features), panels).shape == (0, 96)


def test_a_rows_result_is_independent_of_its_batch_and_of_threads():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3072, 576, generator=g) * 0.05
    panels = cpu_matmul.pack(w)
    x = torch.randn(13, 576, generator=g)
    torch.set_num_threads(2)
    together = cpu_matmul.matmul(x, panels)
    for i in range(13):
        assert torch.equal(cpu_matmul.matmul(x[i : i + 1], panels), together[i : i + 1])
    assert torch.equal(cpu_matmul.matmul(x[3:8], panels), together[3:8])  # a slice, not contiguous from 0
    torch.set_num_threads(1)
    assert torch.equal(cpu_matmul.matmul(x, panels), together)


@pytest.mark.parametrize("bits", [8, 4])
def test_code_panels_give_the_float_kernels_bits_for_every_row_count(bits):
    # One or a few rows form each weight in registers, pass by pass; more rows than a pass form the panel's
    # weights once into a buffer (a batched step is compute-bound). Both must give, bit for bit, the float32
    # kernel's result over the unpacked weights, so that a row's tokens do not depend on its batch.
    g = torch.Generator().manual_seed(2)
    panels, sm = cpu_matmul.pack_quantized(torch.randn(160, 1536, generator=g) * 0.05, bits)
    floats = cpu_matmul.pack(cpu_matmul.unpack(panels, sm))
    x = torch.randn(40, 1536, generator=g)
    torch.set_num_threads(2)
    for rows in (1, 5, 6, 7, 13, 40):
        assert torch.equal(cpu_matmul.matmul(x[:rows], panels, sm), cpu_matmul.matmul(x[:rows], floats)), rows
    together = cpu_matmul.matmul(x, panels, sm)
    for i in (0, 17, 39):
        assert torch.equal(cpu_matmul.matmul(x[i : i + 1], panels, sm), together[i : i + 1])
    torch.set_num_threads(1)
    assert torch.equal(cpu_matmul.matmul(x, panels, sm), together)


def test_pack_round_trips_and_refuses_what_it_cannot_hold():
    w = torch.randn(48, 20)
    panels = cpu_matmul.pack(w)
    assert panels.shape == (3, 20, cpu_matmul.PANEL) and panels.is_contiguous()
    assert torch.equal(cpu_matmul.unpack(panels), w)
    assert torch.equal(cpu_matmul.unpack(cpu_matmul.pack(w, torch.float16)), w.half().float())
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_matmul.pack(torch.randn(40, 20))  # 40 outputs: not whole panels
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_matmul.pack(w, torch.bfloat16)
    with pytest.raises(ValueError, match="matmul"):
        cpu_matmul.matmul(torch.randn(2, 21), panels)  # the wrong input width
    with pytest.raises(ValueError, match="matmul"):
        cpu_matmul.matmul(torch.randn(2, 20), panels.transpose(1, 2))  # not panels
    assert not cpu_matmul.packs(40) and cpu_matmul.packs(48)


@pytest.mark.parametrize("bits", [8, 4])
def test_code_panels_round_trip_and_need_their_scales_and_minimums(bits):
    w = torch.randn(48, 64)
    panels, sm = cpu_matmul.pack_quantized(w, bits)
    assert panels.shape == (3, 64, cpu_matmul.PANEL * bits // 8) and panels.dtype == torch.uint8
    assert sm.shape == (3, 64 // cpu_matmul.QUANT_GROUP, 2, cpu_matmul.PANEL) and sm.dtype == torch.float16
    assert sm.is_contiguous() and panels.is_contiguous()
    q, scale, minimum = cpu_matmul.quantize(w, bits)
    assert q.dtype == torch.uint8 and int(q.max()) <= 2**bits - 1
    assert torch.equal(cpu_matmul.unpack(panels, sm), cpu_matmul.dequantize(q, scale, minimum))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="code panels need their float16 scales and minimums"):
        cpu_matmul.matmul(x, panels)  # none
    with pytest.raises(ValueError, match="code panels need their float16 scales and minimums"):
        cpu_matmul.matmul(x, panels, sm.transpose(1, 3).contiguous())  # the wrong layout
    with pytest.raises(ValueError, match="code panels need their float16 scales and minimums"):
        cpu_matmul.matmul(x, panels, sm.float())  # the wrong dtype
    with pytest.raises(ValueError, match="code panels need their float16 scales and minimums"):
        cpu_matmul.matmul(x, cpu_matmul.pack(w), sm)  # float panels take none
    with pytest.raises(ValueError, match="matmul"):
        cpu_matmul.matmul(x, panels[..., :3].contiguous(), sm)  # a width that is no code panel's
    with pytest.raises(ValueError, match="not a multiple of the group"):
        cpu_matmul.quantize(torch.randn(48, 40), bits)
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_matmul.pack_quantized(torch.randn(40, 64), bits)
    with pytest.raises(ValueError, match="float16's range"):
        cpu_matmul.quantize(torch.full((16, 32), 1e6), bits)
    with pytest.raises(ValueError, match="bits must be one of"):
        cpu_matmul.quantize(w, 6)
    q, scale, minimum = cpu_matmul.quantize(w, 8)
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_matmul.pack_codes(q, scale, minimum, 4)  # 8-bit codes do not fit in 4 bits
    with pytest.raises(ValueError, match="cannot pack"):
        cpu_matmul.pack_codes(q, scale, minimum, 6)
    assert cpu_matmul.packs_quantized(48, 64) and not cpu_matmul.packs_quantized(48, 40)
    assert not cpu_matmul.packs_quantized(40, 64)


def gguf_blocks(rows: int, groups: int, kind: str) -> torch.Tensor:
    """Weights as GGUF's dequantizer gives a Q4_1 (``d * q + m``, q spanning 0..15) or Q8_0 (``d * q``,
    max |q| = 127) tensor: float16 d and m, float32 arithmetic."""
    d = (torch.rand(rows, groups, 1) * 0.01 + 1e-3).half().float()
    if kind == "q4_1":
        q = torch.randint(0, 16, (rows, groups, 32)).float()
        q[..., 0], q[..., 1] = 0, 15  # llama.cpp's Q4_1 maps a block's minimum to 0 and its maximum to 15
        m = (torch.randn(rows, groups, 1) * 0.05).half().float()
        return (d * q + m).reshape(rows, groups * 32)
    q = torch.randint(-127, 128, (rows, groups, 32)).float()
    q[..., 5] = 127 * torch.sign(torch.randn(rows, groups))  # Q8_0: d = max |w| / 127
    return (q * d).reshape(rows, groups * 32)


@pytest.mark.parametrize(("kind", "bits"), [("q4_1", 8), ("q4_1", 4), ("q8_0", 8)])
def test_gguf_blocks_are_held_exactly(kind, bits):
    """Weights dequantized from GGUF's Q4_1 blocks are held exactly by 8- and 4-bit codes, Q8_0's by 8 bits:
    each group finds its block's own grid, so the products are float32's, bit for bit."""
    torch.manual_seed(bits)
    w = gguf_blocks(48, 6, kind)
    assert torch.equal(cpu_matmul.dequantize(*cpu_matmul.quantize(w, bits)), w)
    panels, sm = cpu_matmul.pack_quantized(w, bits)
    x = torch.randn(5, w.shape[1])
    assert torch.equal(cpu_matmul.matmul(x, panels, sm), cpu_matmul.matmul(x, cpu_matmul.pack(w)))


def test_float_weights_round_to_half_a_step_of_their_groups_range():
    torch.manual_seed(3)
    w = torch.randn(32, 128) * 0.05 + 0.01
    g = w.reshape(32, 4, 32)
    spread = (g.amax(2) - g.amin(2))[..., None]
    for bits in (8, 4):
        err = (cpu_matmul.dequantize(*cpu_matmul.quantize(w, bits)) - w).reshape(32, 4, 32).abs()
        step = spread / (2**bits - 1)
        slack = (g.abs().amax(2, keepdim=True) + spread) * 2**-10  # the float16 scale's and minimum's rounding
        assert (err <= step / 2 + slack).all(), bits
        assert err.max() > step.min() / 8  # it did round


def _linear(out_features: int = 64, in_features: int = 32) -> tuple[Linear, torch.Tensor]:
    lin = Linear(in_features, out_features, bias=False)
    w = torch.randn(out_features, in_features)
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    lin.set_cpu_layout(2)
    return lin, w


def test_a_linear_multiplies_with_the_kernel_and_falls_back_to_torch(monkeypatch):
    lin, w = _linear()
    assert lin.panels and lin.weight.shape == (4, cpu_matmul.PANEL, 32)
    assert torch.equal(lin.dense_weight(), w)
    x = torch.randn(5, 32)
    with_kernel = lin(x)
    monkeypatch.setenv(cpu_matmul.ENV, "0")  # read per call: torch's batched product over the same blocks
    assert cpu_matmul.kernel() is None and cpu_matmul.unavailable_reason() == f"{cpu_matmul.ENV}=0"
    torch.testing.assert_close(lin(x), with_kernel, rtol=1e-5, atol=1e-5)
    fallback, _ = _linear()
    assert not fallback.panels  # laid out while the kernel was off: column blocks
    monkeypatch.delenv(cpu_matmul.ENV)
    odd, _ = _linear(out_features=40)
    assert not odd.panels  # 40 outputs: not whole panels
    torch.testing.assert_close(odd(x), x @ odd.dense_weight().T, rtol=1e-5, atol=1e-5)


def test_training_multiplies_the_panels_with_torch_for_gradients():
    lin, w = _linear()
    x = torch.randn(3, 32, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, 32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("broken", ["no compiler", "compile fails"])
def test_without_a_working_compiler_the_kernel_is_left_out_with_a_reason(broken, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_matmul, "_state", {})  # as in a fresh process
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path))  # nothing cached
    if broken == "no compiler":
        monkeypatch.setenv("CXX", "no-such-compiler")
    else:
        bad = tmp_path / "bad.cpp"
        bad.write_text("this is not C++\n")
        monkeypatch.setattr(cpu_matmul, "SOURCES", (bad, *cpu_matmul.SOURCES[1:]))
    assert cpu_matmul.kernel() is None
    reason = cpu_matmul.unavailable_reason()
    assert reason and ("no C++ compiler" in reason if broken == "no compiler" else "failed" in reason), reason
    lin, w = _linear()
    assert not lin.panels
    x = torch.randn(2, 32)
    torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-5)
    assert not list(tmp_path.glob("kernels/*.so*")) and not list(tmp_path.glob("kernels/tmp*"))  # no debris


def test_the_library_is_built_once_and_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path))
    cxx = cpu_matmul._compiler()
    assert cxx is not None
    first = cpu_matmul._build(cxx)
    stamp = first.stat().st_mtime_ns
    assert cpu_matmul._build(cxx) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]


@pytest.mark.parametrize("mode", [None, "fp16", "int8", "int4"])
def test_the_load_log_says_which_kernel_multiplies(mode, monkeypatch):
    from draftwise.worker import default_model_path
    from draftwise.worker.model.loader import cpu_products, load_model

    loaded = load_model(default_model_path(), quantization=mode)
    vectors = "AVX-512" if cpu_matmul.use_avx512() else "AVX2"
    assert cpu_products(loaded.model) == f"draftwise kernel ({vectors})"
    monkeypatch.setenv(cpu_matmul.ENV, "0")
    if mode in ("int8", "int4"):  # no torch fallback: refused in one line
        from draftwise.worker.model.model_config import ModelLoadError

        with pytest.raises(ModelLoadError, match="needs this package's CPU kernel"):
            load_model(default_model_path(), quantization=mode)
        return
    loaded = load_model(default_model_path(), quantization=mode)
    assert cpu_products(loaded.model) == f"torch ({cpu_matmul.ENV}=0)"


def _products(lib, x: torch.Tensor, weights: dict) -> dict[str, torch.Tensor]:
    rows, inn = x.shape
    out = {}
    for name, (w, sm, n_out) in weights.items():
        y = torch.full((rows, n_out), float("nan"))
        a = [x.data_ptr(), rows, inn, w.data_ptr(), n_out, y.data_ptr(), 2]
        getattr(lib, f"dw_matmul_{name}")(*a, *([sm.data_ptr()] if sm is not None else []))
        out[name] = y
    return out


@pytest.mark.skipif(not cpu_matmul.has_avx512(), reason="this CPU has no AVX-512 (CI's machine has)")
def test_the_avx512_products_equal_the_avx2_ones_bit_for_bit(monkeypatch, tmp_path):
    """The 512-bit products (12 rows a pass, one register a panel) sum every output as the AVX2 ones
    do: every format, every row count through the passes and past them (the dequantized-panel
    path of the codes), odd widths."""
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path))
    cxx = cpu_matmul._compiler()
    assert cxx is not None
    narrow = cpu_matmul.open_library(cpu_matmul._build(cxx, avx512=False))
    wide = cpu_matmul.open_library(cpu_matmul._build(cxx, avx512=True))
    assert (narrow.dw_vector_bits(), wide.dw_vector_bits()) == (256, 512)
    gen = torch.Generator().manual_seed(0)
    for n_out, inn in ((64, 576), (1536, 576), (576, 1536), (32, 96)):
        w = torch.randn(n_out, inn, generator=gen)
        weights = {
            "f32": (cpu_matmul.pack(w), None, n_out),
            "f16": (cpu_matmul.pack(w, torch.float16), None, n_out),
            "q8": (*cpu_matmul.pack_quantized(w, 8), n_out),
            "q4": (*cpu_matmul.pack_quantized(w, 4), n_out),
        }
        for rows in [*range(1, 27), 37, 64, 130]:
            x = torch.randn(rows, inn, generator=gen)
            a, b = _products(narrow, x, weights), _products(wide, x, weights)
            for name in weights:
                assert torch.equal(a[name], b[name]), (name, n_out, inn, rows)
                assert not a[name].isnan().any()
            torch.testing.assert_close(a["f32"], _ref(x, w), rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not cpu_matmul.has_avx512(), reason="this CPU has no AVX-512 (CI's machine has)")
def test_draftwise_cpu_avx512_0_builds_the_avx2_products():
    code = "from draftwise.worker.model import cpu_matmul as c; print(c.vector_bits())"
    for value, bits in (("0", "256"), ("1", "512")):
        env = {**os.environ, cpu_matmul.AVX512_ENV: value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == bits, (value, out.stdout, out.stderr)
