// Paged attention and KV-cache writes for CPU decoding, float32: compiled into the same library as
// cpu_matmul.cpp (cpu_matmul.py builds both).
//
// A decode step attends each new token over its context in the paged cache. PyTorch does that by
// gathering every sequence's blocks into a padded batch (index_select) and running its attention op
// on it: a handful of ops and their Python overhead per layer, and a copy of the whole context. Here
// one call per layer reads the blocks where they are.
//
// Work items: (new token, KV head). An item scores the token's query heads that share the KV head
// (grouped-query attention) against every key it may see (causal, and within the sliding window
// when there is one; the keys' rows located once per item, block by block, and scored eight at a time:
// eight accumulator chains instead of one, each key's sum in the same order), takes a softmax per head (the maximum subtracted, exponentials from a
// polynomial good to ~2 ulp) and sums the value rows with those weights; the result is divided by
// the weights' sum. Items are handed out to the library's threads (cpu_pool.cpp) when the step has
// enough of them.

#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"

namespace {

constexpr int MAX_GROUP = 16;  // query heads per KV head this kernel takes (the caller checks)

struct Shape {
    const float* q;
    int64_t ldq;  // floats between tokens' query rows; a token's heads are contiguous, d apart
    const float* kc;
    const float* vc;
    int64_t block_size, heads, kv_heads, d;
    const int32_t* tables;
    int64_t table_width;
    float scale;
    int64_t window;  // 0: none; else a token at p sees keys p - window + 1 .. p
    float* out;      // [T, heads, d] contiguous
};

// Value rows weighted by w[0 .. n) summed into acc (d floats, a multiple of 8); rows[i]: where key i's row
// for this KV head starts in the cache (floats).
// CHUNKS: the vectors of a 64-float slice when known at compile time (0: from d), so that the
// accumulators stay in registers for the usual head size of 64.
template <int CHUNKS>
void weighted_values_t(const Shape& s, const int64_t* rows, int64_t n, const float* w, float* acc) {
    for (int64_t d0 = 0; d0 < s.d; d0 += 64) {
        const int chunks = CHUNKS ? CHUNKS : static_cast<int>((s.d - d0 < 64 ? s.d - d0 : 64) / 8);
        __m256 a[8];
        for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {
            const float* v = s.vc + rows[i] + d0;
            const __m256 wi = _mm256_set1_ps(w[i]);
            for (int c = 0; c < chunks; ++c) a[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(v + 8 * c), a[c]);
        }
        for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, a[c]);
    }
}

void weighted_values(const Shape& s, const int64_t* rows, int64_t n, const float* w, float* acc) {
    if (s.d == 64) weighted_values_t<8>(s, rows, n, w, acc);
    else weighted_values_t<0>(s, rows, n, w, acc);
}

// One item: token t (at position pos, of the sequence whose block table is `table`), KV head g.
void attend_item(const Shape& s, int64_t t, int64_t pos, const int32_t* table, int64_t g, std::vector<float>& scratch,
                 std::vector<int64_t>& rows) {
    const int64_t group = s.heads / s.kv_heads;
    const int64_t lo = s.window > 0 && pos - s.window + 1 > 0 ? pos - s.window + 1 : 0;
    const int64_t n = pos - lo + 1;
    const int64_t padded = (n + 7) & ~int64_t(7);
    if (static_cast<int64_t>(scratch.size()) < group * padded) scratch.resize(group * padded);
    if (static_cast<int64_t>(rows.size()) < n) rows.resize(n);
    float* sc = scratch.data();
    const float* q0 = s.q + t * s.ldq + g * group * s.d;
    const int64_t row = s.kv_heads * s.d;
    {  // where each key's row starts, block by block (no division per key)
        int64_t b = lo / s.block_size, off = lo % s.block_size, base = table[b] * s.block_size;
        for (int64_t i = 0; i < n; ++i) {
            rows[i] = (base + off) * row + g * s.d;
            if (++off == s.block_size && i + 1 < n) off = 0, base = table[++b] * s.block_size;
        }
    }
    const int64_t* r = rows.data();
    // Scores: every query head of the group against each key, eight keys at a time (eight independent
    // accumulator chains: one key's dot product alone waits on each FMA's latency); each score is summed
    // exactly as a key alone would be (lanes over the head's dimensions in order, then hsum).
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float* k[8];
        for (int u = 0; u < 8; ++u) k[u] = s.kc + r[i + u];
        for (int64_t h = 0; h < group; ++h) {
            const float* qh = q0 + h * s.d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t j = 0; j < s.d; j += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + j);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + j), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + j), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + j), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + j), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + j), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + j), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + j), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + j), a7);
            }
            float* o = sc + h * padded + i;
            o[0] = hsum(a0) * s.scale, o[1] = hsum(a1) * s.scale, o[2] = hsum(a2) * s.scale;
            o[3] = hsum(a3) * s.scale, o[4] = hsum(a4) * s.scale, o[5] = hsum(a5) * s.scale;
            o[6] = hsum(a6) * s.scale, o[7] = hsum(a7) * s.scale;
        }
    }
    for (; i < n; ++i) {  // the last keys one at a time
        const float* k = s.kc + r[i];
        for (int64_t h = 0; h < group; ++h) {
            const float* qh = q0 + h * s.d;
            __m256 a = _mm256_setzero_ps();
            for (int64_t j = 0; j < s.d; j += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), _mm256_loadu_ps(k + j), a);
            sc[h * padded + i] = hsum(a) * s.scale;
        }
    }
    for (int64_t h = 0; h < group; ++h) {  // softmax weights, unnormalized, then the weighted values / their sum
        float* w = sc + h * padded;
        float m = w[0];
        for (int64_t i = 1; i < n; ++i) m = w[i] > m ? w[i] : m;
        for (int64_t i = n; i < padded; ++i) w[i] = -__builtin_inff();
        const __m256 mv = _mm256_set1_ps(m);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t i = 0; i < padded; i += 8) {
            const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(w + i), mv));
            _mm256_storeu_ps(w + i, e);
            sum = _mm256_add_ps(sum, e);
        }
        float* o = s.out + (t * s.heads + g * group + h) * s.d;
        weighted_values(s, r, n, w, o);
        const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
        for (int64_t j = 0; j < s.d; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(o + j), inv));
    }
}

}  // namespace

extern "C" {

int dw_attention_max_group(void) { return MAX_GROUP; }

// Causal attention of the new tokens of sequences seq_ids[0 .. n_ids) over their contexts in the paged cache
// (their KV already written). q: [T, heads, d] rows ldq floats apart; caches [blocks, block_size, kv_heads, d];
// qsl [S + 1] and seq_lens [S] int32 (the flat batch's); tables [S, table_width] int32; out [T, heads, d].
// d a multiple of 8, heads a multiple of kv_heads, heads / kv_heads <= MAX_GROUP (the caller checks).
void dw_paged_attention_f32(const float* q, int64_t ldq, const float* kc, const float* vc, int64_t block_size,
                            int64_t heads, int64_t kv_heads, int64_t d, const int32_t* qsl, const int32_t* seq_lens,
                            const int32_t* tables, int64_t table_width, const int32_t* seq_ids, int64_t n_ids,
                            float scale, int64_t window, float* out, int threads) {
    const Shape s{q, ldq, kc, vc, block_size, heads, kv_heads, d, tables, table_width, scale, window, out};
    std::vector<int64_t> items;  // (token, sequence) pairs, then KV heads within each
    int64_t work = 0;
    for (int64_t j = 0; j < n_ids; ++j) {
        const int32_t i = seq_ids[j];
        for (int64_t t = qsl[i]; t < qsl[i + 1]; ++t) {
            items.push_back(t);
            items.push_back(i);
        }
        work += (qsl[i + 1] - qsl[i]) * static_cast<int64_t>(seq_lens[i]);
    }
    const int64_t n_items = static_cast<int64_t>(items.size() / 2) * kv_heads;
    const bool parallel = threads > 1 && work * heads * d >= (int64_t(1) << 18);
    dw_parallel_for(parallel ? threads : 1, n_items, 1, [&](int64_t begin, int64_t end) {  // one item a chunk
        thread_local std::vector<float> scratch;
        thread_local std::vector<int64_t> rows;
        for (int64_t it = begin; it < end; ++it) {
            const int64_t k = it / kv_heads, g = it % kv_heads;
            const int64_t t = items[2 * k], i = items[2 * k + 1];
            const int64_t pos = seq_lens[i] - (qsl[i + 1] - qsl[i]) + (t - qsl[i]);
            attend_item(s, t, pos, tables + i * table_width, g, scratch, rows);
        }
    });
}

// KV rows of T new tokens into the paged caches at their slots (slot < 0: padding, skipped). k and v:
// [T, kv_heads, d] rows ldk / ldv floats apart, each row's heads contiguous; caches [slots, kv_heads, d].
// Returns -1, or (nothing written) the first slot at or beyond `capacity`.
int64_t dw_write_kv_f32(const float* k, int64_t ldk, const float* v, int64_t ldv, const int64_t* slots,
                        int64_t tokens, int64_t width, float* kc, float* vc, int64_t capacity) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] >= capacity) return slots[t];
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(kc + slot * width, k + t * ldk, width * sizeof(float));
        memcpy(vc + slot * width, v + t * ldv, width * sizeof(float));
    }
    return -1;
}
}
