// One decoder layer of the Llama model on CPU in one call, for steps of short sequences (decode, verify,
// short chunks): compiled into the kernel library with cpu_matmul.cpp and cpu_attention.cpp, whose
// functions it calls in the order the model's modules call them one by one (worker/model/llama.py):
//
//   h, r1 = rms_norm(x + residual)        (r1 = x in the first layer)
//   qkv   = h @ Wqkv.T (+ bias)           RoPE on its q and k parts, k and v written to the paged cache
//   a     = attention(q, cache)           o = a @ Wo.T (+ bias)
//   h, r2 = rms_norm(o + r1)
//   gu    = h @ Wgu.T (+ bias)            m = silu(gate) * up
//   out   = m @ Wdown.T (+ bias)          returns (out, r2)
//
// The same kernels, so the same numbers, except silu, whose exponential is this library's polynomial
// (torch's is Sleef's; they differ in the last bits). What it saves is the Python between them: some
// 25 torch calls a layer, ~5 ms of a SmolLM2-135M decode step.

#include <stdint.h>

#include "cpu_simd.h"

extern "C" {
void dw_matmul_f32(const float*, int64_t, int64_t, const float*, int64_t, float*, int);
void dw_matmul_f16(const float*, int64_t, int64_t, const uint16_t*, int64_t, float*, int);
void dw_matmul_q8(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int, const uint16_t*);
void dw_matmul_q4(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int, const uint16_t*);
void dw_rms_norm_f32(const float*, const float*, const float*, float, int64_t, int64_t, float*, float*, int);
void dw_rope_f32(float*, int64_t, int64_t, int64_t, int64_t, const float*, const float*);
void dw_paged_attention_f32(const float*, int64_t, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                            const int32_t*, const int32_t*, const int32_t*, int64_t, const int32_t*, int64_t, float,
                            int64_t, float*, int);
int64_t dw_write_kv_f32(const float*, int64_t, const float*, int64_t, const int64_t*, int64_t, int64_t, float*, float*,
                        int64_t);
}

// A projection's weight as the kernels hold it (cpu_layer.py fills these from the model's Linear modules).
struct DwWeight {
    int64_t kind;  // 0: float32 panels, 1: float16 panels, 2: 8-bit codes, 3: 4-bit codes
    const void* w;
    const uint16_t* sm;  // codes' float16 scales and minimums (kinds 2, 3)
    const float* bias;   // null: none
    int64_t out, in;
};

struct DwLayer {
    DwWeight qkv, o, gate_up, down;
    const float* norm1;
    const float* norm2;
    double eps;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, window;  // window 0: none
    double scale;
};

// The per-step arguments every layer shares (the flat batch and its attention metadata).
struct DwStep {
    int64_t tokens;
    const float* cos;  // [T, head_dim] RoPE tables at the tokens' positions
    const float* sin;
    const int64_t* slots;  // [T] cache slot of each new token
    const int32_t* qsl;    // [S + 1]
    const int32_t* seq_lens;
    const int32_t* tables;  // [S, table_width]
    int64_t table_width;
    const int32_t* seq_ids;  // the sequences attended (all of them)
    int64_t n_ids;
    int64_t block_size, capacity;  // cache slots
    int64_t threads;
};

static void product(const DwWeight& w, const float* x, int64_t rows, float* y, int threads) {
    switch (w.kind) {
        case 0: dw_matmul_f32(x, rows, w.in, static_cast<const float*>(w.w), w.out, y, threads); break;
        case 1: dw_matmul_f16(x, rows, w.in, static_cast<const uint16_t*>(w.w), w.out, y, threads); break;
        case 2: dw_matmul_q8(x, rows, w.in, static_cast<const uint8_t*>(w.w), w.out, y, threads, w.sm); break;
        default: dw_matmul_q4(x, rows, w.in, static_cast<const uint8_t*>(w.w), w.out, y, threads, w.sm); break;
    }
    if (w.bias == nullptr) return;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < w.out; ++j) y[r * w.out + j] += w.bias[j];
}

static void silu_mul(const float* gu, int64_t rows, int64_t width, float* m) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gu + r * 2 * width;
        const float* u = g + width;
        float* o = m + r * width;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= width; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
        for (; i < width; ++i) o[i] = g[i] / (1.0f + __builtin_expf(-g[i])) * u[i];
    }
}

extern "C" {

// Floats of scratch one layer needs for T tokens.
int64_t dw_layer_scratch(const DwLayer* l, int64_t tokens) {
    return tokens * (l->hidden + l->qkv.out + l->heads * l->head_dim + l->o.out + l->gate_up.out + l->intermediate);
}

// x [T, hidden]; residual [T, hidden] or null (first layer); out and res_out [T, hidden] (out may be x, and
// res_out residual); scratch dw_layer_scratch floats. Returns -1, or (the cache untouched) a slot beyond it.
int64_t dw_layer_forward(const DwLayer* l, const DwStep* s, const float* x, const float* residual, float* kc, float* vc,
                         float* out, float* res_out, float* scratch) {
    const int64_t t = s->tokens, hid = l->hidden, d = l->head_dim;
    const int threads = static_cast<int>(s->threads);
    float* h = scratch;
    float* qkv = h + t * hid;
    float* a = qkv + t * l->qkv.out;
    float* o = a + t * l->heads * d;
    float* gu = o + t * l->o.out;
    float* m = gu + t * l->gate_up.out;
    float* r1 = res_out;  // x + residual, until the second norm replaces it with o + r1 (in place)
    if (residual == nullptr) {
        dw_rms_norm_f32(x, nullptr, l->norm1, static_cast<float>(l->eps), t, hid, h, nullptr, threads);
        r1 = const_cast<float*>(x);
    } else {
        dw_rms_norm_f32(x, residual, l->norm1, static_cast<float>(l->eps), t, hid, h, r1, threads);
    }
    product(l->qkv, h, t, qkv, threads);
    const int64_t q_size = l->heads * d, kv_size = l->kv_heads * d, ld = l->qkv.out;
    dw_rope_f32(qkv, t, ld, l->heads + l->kv_heads, d, s->cos, s->sin);
    const int64_t bad = dw_write_kv_f32(qkv + q_size, ld, qkv + q_size + kv_size, ld, s->slots, t, kv_size, kc, vc,
                                        s->capacity);
    if (bad >= 0) return bad;
    dw_paged_attention_f32(qkv, ld, kc, vc, s->block_size, l->heads, l->kv_heads, d, s->qsl, s->seq_lens, s->tables,
                           s->table_width, s->seq_ids, s->n_ids, static_cast<float>(l->scale), l->window, a, threads);
    product(l->o, a, t, o, threads);
    dw_rms_norm_f32(o, r1, l->norm2, static_cast<float>(l->eps), t, hid, h, res_out, threads);
    product(l->gate_up, h, t, gu, threads);
    silu_mul(gu, t, l->intermediate, m);
    product(l->down, m, t, out, threads);
    return -1;
}
}
