// Weight-streaming products for CPU decoding: y[R, out] = x[R, in] @ W.T, W packed in panels.
//
// A decode or verify step multiplies a few rows by every weight, so the step costs what it
// takes to stream the weights from memory once. BLAS libraries read a weight once per row (or
// per few rows) for such shapes; these kernels read each weight once per call for up to
// ROWS_PER_PASS rows, and from cache after that.
//
// Layout: the weight [out, in] (out a multiple of PANEL) is stored as panels of PANEL
// consecutive output columns, [out / PANEL, in, PANEL]: a panel is one contiguous stream, read
// in full by one thread. For each panel, rows go in groups of ROWS_PER_PASS (12 accumulators, two
// weight registers and a broadcast: 15 of AVX2's 16 vector registers); the first group reads
// the panel from memory, later groups from the core's L2 (a panel is in * PANEL * 4 bytes:
// 36-96 KiB for a 576-1536-wide model at float32).
//
// float32, float16, 8-bit and 4-bit weights (float16 converted in registers with F16C; 8- and 4-bit
// codes widened, converted, scaled and offset per group of 32 inputs and output); activations and
// accumulation are float32,
// summed in blocks of KBLOCK inputs (each in input order), the blocks' sums added in order.
//
// Threads: runs of panels claimed by the caller's thread count, on the library's own pool (cpu_pool.cpp).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "cpu_pool.h"

constexpr int PANEL = 16;
constexpr int ROWS_PER_PASS = 6;
constexpr int PREFETCH = 64;  // rows of the panel ahead (4 KiB at float32): flattens the cost over 1-8 rows

static inline void load_w(const float* p, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(p);
    w1 = _mm256_loadu_ps(p + 8);
}

static inline void load_w(const uint16_t* p, __m256& w0, __m256& w1) {
    w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}

// R rows (R <= ROWS_PER_PASS) times one panel: y[r, 0:PANEL] for each row r. The accumulators
// are named variables, not an array: GCC keeps an array of vectors in memory and stores it
// back every iteration.
#define DW_ROW(r)                                                    \
    if constexpr (R > r) {                                           \
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);       \
        a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0);                   \
        a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1);                   \
    }
#define DW_STORE(r)                                  \
    if constexpr (R > r) {                           \
        _mm256_storeu_ps(y + r * ldy, a##r##0);      \
        _mm256_storeu_ps(y + r * ldy + 8, a##r##1);  \
    }
#define DW_ADD(r)                                                                              \
    if constexpr (R > r) {                                                                     \
        _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(_mm256_loadu_ps(y + r * ldy), a##r##0));  \
        _mm256_storeu_ps(y + r * ldy + 8, _mm256_add_ps(_mm256_loadu_ps(y + r * ldy + 8), a##r##1)); \
    }
#define DW_ZERO                                                                    \
    a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00; \
    a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define DW_DECLARE __m256 a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51;
#define DW_FLUSH(first)                                                             \
    if (first) { DW_STORE(0) DW_STORE(1) DW_STORE(2) DW_STORE(3) DW_STORE(4) DW_STORE(5) } \
    else { DW_ADD(0) DW_ADD(1) DW_ADD(2) DW_ADD(3) DW_ADD(4) DW_ADD(5) }

// Blocked summation: each block of KBLOCK inputs is summed in fresh accumulators (in input order)
// and added to the row's total in y, so that the rounding error grows with KBLOCK + in / KBLOCK
// rather than with in (BLAS's products are blocked alike; tests/numerics.py holds ours to theirs).
constexpr int KBLOCK = 128;

template <int R, typename W>
static void panel_rows(const W* panel, const float* x, int64_t ldx, int64_t in, float* y, int64_t ldy) {
    static_assert(R >= 1 && R <= ROWS_PER_PASS, "rows per pass");
    DW_DECLARE
    for (int64_t k0 = 0; k0 < in; k0 += KBLOCK) {
        const int64_t k1 = k0 + KBLOCK < in ? k0 + KBLOCK : in;
        DW_ZERO
        for (int64_t k = k0; k < k1; ++k) {
            __m256 w0, w1;
            _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PREFETCH) * PANEL), _MM_HINT_T0);
            load_w(panel + k * PANEL, w0, w1);
            DW_ROW(0) DW_ROW(1) DW_ROW(2) DW_ROW(3) DW_ROW(4) DW_ROW(5)
        }
        DW_FLUSH(k0 == 0)
    }
}

template <typename W>
static void panel_all_rows(const W* panel, const float* x, int64_t rows, int64_t in, float* y, int64_t out) {
    int64_t r = 0;
    for (; r + ROWS_PER_PASS <= rows; r += ROWS_PER_PASS)
        panel_rows<ROWS_PER_PASS>(panel, x + r * in, in, in, y + r * out, out);
    switch (rows - r) {
        case 5: panel_rows<5>(panel, x + r * in, in, in, y + r * out, out); break;
        case 4: panel_rows<4>(panel, x + r * in, in, in, y + r * out, out); break;
        case 3: panel_rows<3>(panel, x + r * in, in, in, y + r * out, out); break;
        case 2: panel_rows<2>(panel, x + r * in, in, in, y + r * out, out); break;
        case 1: panel_rows<1>(panel, x + r * in, in, in, y + r * out, out); break;
        default: break;
    }
}

template <typename W>
static void matmul(const float* x, int64_t rows, int64_t in, const W* w, int64_t out, float* y, int threads) {
    const int64_t panels = out / PANEL;
    dw_parallel_for(threads, panels, dw_grain(panels, threads), [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) panel_all_rows(w + p * in * PANEL, x, rows, in, y + p * PANEL, out);
    });
}

// Quantized weights: unsigned codes q of BITS bits (8: a byte per weight; 4: two per byte, output j of a
// panel in the low nibble of byte j and output j + 8 in its high nibble) in groups of GROUP inputs; each
// group of a panel has PANEL float16 scales, then PANEL float16 minimums (one per output). The weight is
// q * scale + min, formed in registers with one FMA (exactly the float32 value unpack() gives: one
// rounding of the exact value) and used as the float32 weight above.
constexpr int GROUP = 32;

template <int BITS>
static inline void load_q(const uint8_t* panel, int64_t k, __m256& w0, __m256& w1) {
    if constexpr (BITS == 8) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * PANEL));
        w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
        w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
    } else {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(panel + k * (PANEL / 2)));
        const __m128i low = _mm_set1_epi8(0x0F);
        w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(q, low)));
        w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
    }
}

// The float16 scales and minimums of the group of inputs starting at g, widened: outputs 0-7 and 8-15.
static inline void load_scales(const uint16_t* sm, int64_t g, __m256& s0, __m256& s1, __m256& m0, __m256& m1) {
    const uint16_t* s = sm + (g / GROUP) * 2 * PANEL;
    s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8)));
    m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + PANEL)));
    m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + PANEL + 8)));
}

template <int R, int BITS>
static void panel_rows_q(const uint8_t* panel, const uint16_t* sm, const float* x, int64_t ldx, int64_t in, float* y,
                         int64_t ldy) {
    static_assert(R >= 1 && R <= ROWS_PER_PASS, "rows per pass");
    static_assert(KBLOCK % GROUP == 0, "blocks of whole groups");
    DW_DECLARE
    for (int64_t k0 = 0; k0 < in; k0 += KBLOCK) {
        const int64_t k1 = k0 + KBLOCK < in ? k0 + KBLOCK : in;
        DW_ZERO
        for (int64_t g = k0; g < k1; g += GROUP) {
            __m256 s0, s1, m0, m1;
            load_scales(sm, g, s0, s1, m0, m1);
            for (int64_t k = g; k < g + GROUP; ++k) {
                __m256 w0, w1;
                _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 4 * PREFETCH) * PANEL * BITS / 8), _MM_HINT_T0);
                load_q<BITS>(panel, k, w0, w1);
                w0 = _mm256_fmadd_ps(w0, s0, m0);
                w1 = _mm256_fmadd_ps(w1, s1, m1);
                DW_ROW(0) DW_ROW(1) DW_ROW(2) DW_ROW(3) DW_ROW(4) DW_ROW(5)
            }
        }
        DW_FLUSH(k0 == 0)
    }
}

// More rows than one pass: the panel's float32 weights formed once (the same FMA per weight as
// panel_rows_q) into a per-thread buffer, which the float32 passes then read from L1/L2; the passes
// sum exactly as panel_rows_q does, so the result is bit-identical. A batched step or a prompt chunk
// is compute-bound, and forming each weight once per pass of 6 rows cost a quarter to a half of it.
// A per-thread buffer of one panel's float32 weights (in * PANEL floats, 64-byte aligned); null if out of memory.
static float* panel_buffer(int64_t in) {
    static thread_local float* buf = nullptr;
    static thread_local int64_t cap = 0;
    if (cap < in * PANEL) {
        _mm_free(buf);
        buf = static_cast<float*>(_mm_malloc(static_cast<size_t>(in) * PANEL * sizeof(float), 64));
        cap = buf ? in * PANEL : 0;
    }
    return buf;
}

template <int BITS>
static const float* dequantize_panel(const uint8_t* panel, const uint16_t* sm, int64_t in) {
    float* buf = panel_buffer(in);
    if (!buf) return nullptr;
    for (int64_t g = 0; g < in; g += GROUP) {
        __m256 s0, s1, m0, m1;
        load_scales(sm, g, s0, s1, m0, m1);
        for (int64_t k = g; k < g + GROUP; ++k) {
            __m256 w0, w1;
            load_q<BITS>(panel, k, w0, w1);
            _mm256_store_ps(buf + k * PANEL, _mm256_fmadd_ps(w0, s0, m0));
            _mm256_store_ps(buf + k * PANEL + 8, _mm256_fmadd_ps(w1, s1, m1));
        }
    }
    return buf;
}

template <int BITS>
static void panel_q(int64_t p, const float* x, int64_t rows, int64_t in, const uint8_t* w, const uint16_t* sm,
                    int64_t out, float* y) {
    {
        const uint8_t* panel = w + p * in * PANEL * BITS / 8;
        const uint16_t* s = sm + p * (in / GROUP) * 2 * PANEL;
        float* yp = y + p * PANEL;
        if (rows > ROWS_PER_PASS) {
            const float* f = dequantize_panel<BITS>(panel, s, in);
            if (f) {
                panel_all_rows(f, x, rows, in, yp, out);
                return;
            }
        }
        int64_t r = 0;
        for (; r + ROWS_PER_PASS <= rows; r += ROWS_PER_PASS)
            panel_rows_q<ROWS_PER_PASS, BITS>(panel, s, x + r * in, in, in, yp + r * out, out);
        switch (rows - r) {
            case 5: panel_rows_q<5, BITS>(panel, s, x + r * in, in, in, yp + r * out, out); break;
            case 4: panel_rows_q<4, BITS>(panel, s, x + r * in, in, in, yp + r * out, out); break;
            case 3: panel_rows_q<3, BITS>(panel, s, x + r * in, in, in, yp + r * out, out); break;
            case 2: panel_rows_q<2, BITS>(panel, s, x + r * in, in, in, yp + r * out, out); break;
            case 1: panel_rows_q<1, BITS>(panel, s, x + r * in, in, in, yp + r * out, out); break;
            default: break;
        }
    }
}

template <int BITS>
static void matmul_q(const float* x, int64_t rows, int64_t in, const uint8_t* w, const uint16_t* sm, int64_t out,
                     float* y, int threads) {
    const int64_t panels = out / PANEL;
    dw_parallel_for(threads, panels, dw_grain(panels, threads), [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) panel_q<BITS>(p, x, rows, in, w, sm, out, y);
    });
}


#ifdef __AVX512F__
// The same products with 512-bit vectors, built when the CPU has AVX-512 (cpu_matmul.py): a panel's 16
// outputs are one register, so a pass holds up to Z_ROWS rows (one accumulator each) and a weight is
// loaded, widened and scaled once per 16 outputs instead of twice. Every output is summed exactly as
// above (the same fused multiply-adds in the same input order, the same blocks): the results are the
// AVX2 kernel's bit for bit (tests/model/test_cpu_matmul.py builds both and compares). On a core whose
// FMA units are 512 bits wide (this project's Zen 5 machine: 396 against 200 GFLOP/s a core, register-only)
// a compute-bound product (a prompt, a batch, a verify pass) runs 1.5-1.7x faster (measured on SmolLM2).
constexpr int Z_ROWS = 12;
// More rows than these: a panel's weights are formed in float32 once (into a per-thread buffer) and every pass
// reads them from cache, instead of each pass forming them again (measured on SmolLM2's layers, 2 threads:
// float16 panels pay from ~36 rows, 1.36x at 128; codes from ~20, while 13-16 rows ran 1.1-1.2x faster
// formed twice, on the fly, than written and read back).
constexpr int Z_WIDEN_F16_ROWS = 36;
constexpr int Z_WIDEN_CODES_ROWS = 20;

#define Z_DECLARE __m512 z0, z1, z2, z3, z4, z5, z6, z7, z8, z9, z10, z11;
#define Z_ZERO                                                                            \
    z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0, z4 = z0, z5 = z0, z6 = z0, z7 = z0; \
    z8 = z0, z9 = z0, z10 = z0, z11 = z0;
#define Z_ROW(r) \
    if constexpr (R > r) z##r = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), w, z##r);
#define Z_ROWS_ALL Z_ROW(0) Z_ROW(1) Z_ROW(2) Z_ROW(3) Z_ROW(4) Z_ROW(5) Z_ROW(6) Z_ROW(7) Z_ROW(8) Z_ROW(9) Z_ROW(10) Z_ROW(11)
#define Z_STORE(r) \
    if constexpr (R > r) _mm512_storeu_ps(y + r * ldy, z##r);
#define Z_ADD(r) \
    if constexpr (R > r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(_mm512_loadu_ps(y + r * ldy), z##r));
#define Z_FLUSH(first)                                                                                         \
    if (first) { Z_STORE(0) Z_STORE(1) Z_STORE(2) Z_STORE(3) Z_STORE(4) Z_STORE(5) Z_STORE(6) Z_STORE(7)      \
                 Z_STORE(8) Z_STORE(9) Z_STORE(10) Z_STORE(11) }                                               \
    else { Z_ADD(0) Z_ADD(1) Z_ADD(2) Z_ADD(3) Z_ADD(4) Z_ADD(5) Z_ADD(6) Z_ADD(7) Z_ADD(8) Z_ADD(9) Z_ADD(10) \
           Z_ADD(11) }

static inline __m512 z_load_w(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 z_load_w(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// n rows (1 <= n <= Z_ROWS) as a compile-time count: f(std::integral_constant<int, R>).
template <int R, typename F>
static inline void z_dispatch(int64_t n, F&& f) {
    if constexpr (R >= 1) {
        if (n == R) {
            f(std::integral_constant<int, R>{});
            return;
        }
        z_dispatch<R - 1>(n, f);
    }
}

template <int R, typename W>
static void z_panel_rows(const W* panel, const float* x, int64_t ldx, int64_t in, float* y, int64_t ldy) {
    static_assert(R >= 1 && R <= Z_ROWS, "rows per pass");
    Z_DECLARE
    for (int64_t k0 = 0; k0 < in; k0 += KBLOCK) {
        const int64_t k1 = k0 + KBLOCK < in ? k0 + KBLOCK : in;
        Z_ZERO
        for (int64_t k = k0; k < k1; ++k) {
            _mm_prefetch(reinterpret_cast<const char*>(panel + (k + PREFETCH) * PANEL), _MM_HINT_T0);
            const __m512 w = z_load_w(panel + k * PANEL);
            Z_ROWS_ALL
        }
        Z_FLUSH(k0 == 0)
    }
}

template <typename W>
static void z_panel_all_rows(const W* panel, const float* x, int64_t rows, int64_t in, float* y, int64_t out) {
    int64_t r = 0;
    for (; r + Z_ROWS <= rows; r += Z_ROWS) z_panel_rows<Z_ROWS>(panel, x + r * in, in, in, y + r * out, out);
    z_dispatch<Z_ROWS - 1>(rows - r, [&](auto rc) {
        z_panel_rows<decltype(rc)::value>(panel, x + r * in, in, in, y + r * out, out);
    });
}

// A float16 panel as float32 (exact) in a per-thread buffer, for products of more rows than a pass: each
// pass then reads float32 weights from cache instead of converting the panel again.
static const float* z_widen_panel(const uint16_t* panel, int64_t in) {
    float* buf = panel_buffer(in);
    if (!buf) return nullptr;
    for (int64_t k = 0; k < in; ++k) _mm512_store_ps(buf + k * PANEL, z_load_w(panel + k * PANEL));
    return buf;
}

template <typename W>
static void z_matmul(const float* x, int64_t rows, int64_t in, const W* w, int64_t out, float* y, int threads) {
    const int64_t panels = out / PANEL;
    dw_parallel_for(threads, panels, dw_grain(panels, threads), [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const W* panel = w + p * in * PANEL;
            if constexpr (std::is_same_v<W, uint16_t>) {
                if (rows > Z_WIDEN_F16_ROWS) {
                    const float* f = z_widen_panel(panel, in);
                    if (f) {
                        z_panel_all_rows(f, x, rows, in, y + p * PANEL, out);
                        continue;
                    }
                }
            }
            z_panel_all_rows(panel, x, rows, in, y + p * PANEL, out);
        }
    });
}

// A panel's codes of input k as float32 weights (outputs 0-15 in order), before scaling.
template <int BITS>
static inline __m512 z_load_q(const uint8_t* panel, int64_t k) {
    if constexpr (BITS == 8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * PANEL))));
    } else {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(panel + k * (PANEL / 2)));
        const __m128i low = _mm_set1_epi8(0x0F);
        const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(q, low), _mm_and_si128(_mm_srli_epi16(q, 4), low));
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
    }
}

static inline void z_load_scales(const uint16_t* sm, int64_t g, __m512& s, __m512& m) {
    const uint16_t* p = sm + (g / GROUP) * 2 * PANEL;
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + PANEL)));
}

template <int R, int BITS>
static void z_panel_rows_q(const uint8_t* panel, const uint16_t* sm, const float* x, int64_t ldx, int64_t in, float* y,
                           int64_t ldy) {
    static_assert(R >= 1 && R <= Z_ROWS, "rows per pass");
    Z_DECLARE
    for (int64_t k0 = 0; k0 < in; k0 += KBLOCK) {
        const int64_t k1 = k0 + KBLOCK < in ? k0 + KBLOCK : in;
        Z_ZERO
        for (int64_t g = k0; g < k1; g += GROUP) {
            __m512 sc, mn;
            z_load_scales(sm, g, sc, mn);
            for (int64_t k = g; k < g + GROUP; ++k) {
                _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 4 * PREFETCH) * PANEL * BITS / 8), _MM_HINT_T0);
                const __m512 w = _mm512_fmadd_ps(z_load_q<BITS>(panel, k), sc, mn);
                Z_ROWS_ALL
            }
        }
        Z_FLUSH(k0 == 0)
    }
}

template <int BITS>
static const float* z_dequantize_panel(const uint8_t* panel, const uint16_t* sm, int64_t in) {
    float* buf = panel_buffer(in);
    if (!buf) return nullptr;
    for (int64_t g = 0; g < in; g += GROUP) {
        __m512 sc, mn;
        z_load_scales(sm, g, sc, mn);
        for (int64_t k = g; k < g + GROUP; ++k) _mm512_store_ps(buf + k * PANEL, _mm512_fmadd_ps(z_load_q<BITS>(panel, k), sc, mn));
    }
    return buf;
}

template <int BITS>
static void z_matmul_q(const float* x, int64_t rows, int64_t in, const uint8_t* w, const uint16_t* sm, int64_t out,
                       float* y, int threads) {
    const int64_t panels = out / PANEL;
    dw_parallel_for(threads, panels, dw_grain(panels, threads), [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const uint8_t* panel = w + p * in * PANEL * BITS / 8;
            const uint16_t* s = sm + p * (in / GROUP) * 2 * PANEL;
            float* yp = y + p * PANEL;
            if (rows > Z_WIDEN_CODES_ROWS) {
                const float* f = z_dequantize_panel<BITS>(panel, s, in);
                if (f) {
                    z_panel_all_rows(f, x, rows, in, yp, out);
                    continue;
                }
            }
            int64_t r = 0;
            for (; r + Z_ROWS <= rows; r += Z_ROWS) z_panel_rows_q<Z_ROWS, BITS>(panel, s, x + r * in, in, in, yp + r * out, out);
            z_dispatch<Z_ROWS - 1>(rows - r, [&](auto rc) {
                z_panel_rows_q<decltype(rc)::value, BITS>(panel, s, x + r * in, in, in, yp + r * out, out);
            });
        }
    });
}
#endif  // __AVX512F__

// RMSNorm of one row: r = x + residual (residual null: r = x, res_out untouched), out = (r * s) * w
// with s = 1 / sqrt(mean(r^2) + eps); the sum of squares in float32, 16 lanes.
static void rms_norm_row(const float* x, const float* residual, const float* w, float eps, int64_t hidden, float* out,
                         float* res_out) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    const float* r = x;
    if (residual != nullptr) {
        for (; i + 8 <= hidden; i += 8) _mm256_storeu_ps(res_out + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(residual + i)));
        for (; i < hidden; ++i) res_out[i] = x[i] + residual[i];
        r = res_out;
    }
    for (i = 0; i + 16 <= hidden; i += 16) {
        const __m256 a = _mm256_loadu_ps(r + i), b = _mm256_loadu_ps(r + i + 8);
        s0 = _mm256_add_ps(s0, _mm256_mul_ps(a, a));
        s1 = _mm256_add_ps(s1, _mm256_mul_ps(b, b));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(s0, s1));
    float ss = 0.0f;
    for (int l = 0; l < 8; ++l) ss += lanes[l];
    for (; i < hidden; ++i) ss += r[i] * r[i];
    const float s = 1.0f / sqrtf(ss / static_cast<float>(hidden) + eps);
    const __m256 sv = _mm256_set1_ps(s);
    for (i = 0; i + 8 <= hidden; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + i), sv), _mm256_loadu_ps(w + i)));
    for (; i < hidden; ++i) out[i] = (r[i] * s) * w[i];
}

extern "C" {

int dw_panel_width(void) { return PANEL; }

// 512: the products run on 512-bit vectors (built with AVX-512), 256: on AVX2's.
int dw_vector_bits(void) {
#ifdef __AVX512F__
    return 512;
#else
    return 256;
#endif
}

// rows x hidden, all row-major and contiguous; residual and res_out null together or not at all.
void dw_rms_norm_f32(const float* x, const float* residual, const float* w, float eps, int64_t rows, int64_t hidden,
                     float* out, float* res_out, int threads) {
    const int team = rows * hidden >= (1 << 16) ? threads : 1;
    dw_parallel_for(team, rows, dw_grain(rows, team), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
            rms_norm_row(x + t * hidden, residual ? residual + t * hidden : nullptr, w, eps, hidden, out + t * hidden,
                         res_out ? res_out + t * hidden : nullptr);
    });
}

// Rotary embedding (rotate-half), in place: row t of x (stride ldx floats) holds `heads` vectors of d floats, each
// becomes x * cos[t] + rotate_half(x) * sin[t], with cos and sin [rows, d]. A product and a sum each rounded, in
// torch's order (the file is compiled with -ffp-contract=off): bit-identical to the torch expression.
void dw_rope_f32(float* x, int64_t rows, int64_t ldx, int64_t heads, int64_t d, const float* cos, const float* sin) {
    const int64_t h = d / 2;
    for (int64_t t = 0; t < rows; ++t) {
        const float* c = cos + t * d;
        const float* s = sin + t * d;
        for (int64_t j = 0; j < heads; ++j) {
            float* v = x + t * ldx + j * d;
            int64_t i = 0;
            for (; i + 8 <= h; i += 8) {
                const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + h + i);
                const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
                const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + h + i)),
                                                _mm256_mul_ps(a, _mm256_loadu_ps(s + h + i)));
                _mm256_storeu_ps(v + i, lo);
                _mm256_storeu_ps(v + h + i, hi);
            }
            for (; i < h; ++i) {
                const float a = v[i], b = v[h + i];
                v[i] = a * c[i] - b * s[i];
                v[h + i] = b * c[h + i] + a * s[h + i];
            }
        }
    }
}

// x [rows, in] float32 row-major; w [out / 16, in, 16] float32; y [rows, out] float32; out % 16 == 0.
void dw_matmul_f32(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y, int threads) {
#ifdef __AVX512F__
    z_matmul(x, rows, in, w, out, y, threads);
#else
    matmul(x, rows, in, w, out, y, threads);
#endif
}

// The same with w float16 (IEEE half, as uint16).
void dw_matmul_f16(const float* x, int64_t rows, int64_t in, const uint16_t* w, int64_t out, float* y, int threads) {
#ifdef __AVX512F__
    z_matmul(x, rows, in, w, out, y, threads);
#else
    matmul(x, rows, in, w, out, y, threads);
#endif
}

// w: codes of BITS (8 or 4) bits in panels [out / 16, in, 16 * BITS / 8] bytes; sm: float16 scales and
// minimums [out / 16, in / 32, 2, 16] (in % 32 == 0): y = x @ (q * scale + min).T.
int dw_quant_group(void) { return GROUP; }
void dw_matmul_q8(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out, float* y, int threads,
                  const uint16_t* sm) {
#ifdef __AVX512F__
    z_matmul_q<8>(x, rows, in, w, sm, out, y, threads);
#else
    matmul_q<8>(x, rows, in, w, sm, out, y, threads);
#endif
}
void dw_matmul_q4(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out, float* y, int threads,
                  const uint16_t* sm) {
#ifdef __AVX512F__
    z_matmul_q<4>(x, rows, in, w, sm, out, y, threads);
#else
    matmul_q<4>(x, rows, in, w, sm, out, y, threads);
#endif
}
}
