// Paged attention and KV-cache writes for CPU decoding, float32: compiled into the same library as
// cpu_matmul.cpp (cpu_matmul.py builds both).
//
// A decode step attends each new token over its context in the paged cache. PyTorch does that by
// gathering every sequence's blocks into a padded batch (index_select) and running its attention op
// on it: a handful of ops and their Python overhead per layer, and a copy of the whole context. Here
// one call per layer reads the blocks where they are.
//
// Work items: a new token and up to PART_KEYS of the keys it may see (causal, and within the sliding
// window when there is one); a token that sees more has one item per part, put together after
// (combine_parts: each part's weights rescaled to the largest maximum), so that one long sequence
// still keeps every thread busy. An item scores every query head against its keys, eight keys at a
// time (eight FMA chains), reading each key's row (all KV heads: grouped-query attention) whole and
// in cache order, keys and values asked of memory a few keys ahead (a step reads each once, from a
// cache larger than the CPU's); takes a softmax per head (the maximum subtracted, exponentials from
// a polynomial good to ~2 ulp) and sums the value rows with those weights, divided by the weights'
// sum. Where a token's range is split depends on that range alone, so its result does not depend on
// its batch. Items are handed out to the library's threads (cpu_pool.cpp) when the step has enough work.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "cpu_pool.h"
#include "cpu_simd.h"

namespace {

constexpr int MAX_GROUP = 16;  // query heads per KV head this kernel takes (the caller checks)
// A token that sees more keys than this attends them in parts of this many (items of their own, so that one
// long sequence keeps every thread busy), put together after (combine_parts). The split
// depends on the token's own range alone: its result does not depend on its batch.
constexpr int64_t PART_KEYS = 128;

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

constexpr int64_t PREFETCH_KEYS = 24;  // key and value rows asked of memory ahead of use

// Rows cache + rows[0 .. n) (d floats each) asked of memory ahead of use: a decode step reads every key and
// value once, from blocks scattered in a cache larger than the CPU's, a few hundred bytes in each place.
inline void prefetch_rows(const float* cache, const int64_t* rows, int64_t n, int64_t d) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < d; j += 16) _mm_prefetch(reinterpret_cast<const char*>(cache + rows[i] + j), _MM_HINT_T1);
}

// Value rows weighted by w[0 .. n) summed into acc (d floats, a multiple of 8): key i's are the d floats at
// rows[i] + col of the cache (floats).
// CHUNKS: the vectors of a 64-float slice when known at compile time (0: from d), so that the
// accumulators stay in registers for the usual head size of 64.
template <int CHUNKS>
void weighted_values_t(const Shape& s, const int64_t* rows, int64_t n, const float* w, int64_t col, float* acc) {
    for (int64_t d0 = 0; d0 < s.d; d0 += 64) {
        const int chunks = CHUNKS ? CHUNKS : static_cast<int>((s.d - d0 < 64 ? s.d - d0 : 64) / 8);
        __m256 a[8];
        for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; ++i) {
            const float* v = s.vc + rows[i] + col + d0;
            const __m256 wi = _mm256_set1_ps(w[i]);
            for (int c = 0; c < chunks; ++c) a[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(v + 8 * c), a[c]);
        }
        for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, a[c]);
    }
}

void weighted_values(const Shape& s, const int64_t* rows, int64_t n, const float* w, int64_t col, float* acc) {
    if (s.d == 64) weighted_values_t<8>(s, rows, n, w, col, acc);
    else weighted_values_t<0>(s, rows, n, w, col, acc);
}

// Keys k0 .. k0 + n of token t (of the sequence whose block table is `table`), every head: head h writes d
// floats at out + h * d. ml null: the softmax-weighted values (the token's whole visible range); else the
// values weighted by exp(score - max), unnormalized, and (max, sum of the weights) in ml[2h], ml[2h + 1]: one
// part of a range split in parts (combine_parts). A key's row (all KV heads) is read whole, in cache order.
void attend_keys(const Shape& s, int64_t t, const int32_t* table, int64_t k0, int64_t n, float* out, float* ml,
                 std::vector<float>& scratch, std::vector<int64_t>& rows) {
    const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.d;
    const int64_t padded = (n + 7) & ~int64_t(7);
    if (static_cast<int64_t>(scratch.size()) < s.heads * padded) scratch.resize(s.heads * padded);
    if (static_cast<int64_t>(rows.size()) < n) rows.resize(n);
    float* sc = scratch.data();
    const float* q0 = s.q + t * s.ldq;
    {  // where each key's row starts, block by block (no division per key)
        int64_t b = k0 / s.block_size, off = k0 % s.block_size, base = table[b] * s.block_size;
        for (int64_t i = 0; i < n; ++i) {
            rows[i] = (base + off) * row;
            if (++off == s.block_size && i + 1 < n) off = 0, base = table[++b] * s.block_size;
        }
    }
    const int64_t* r = rows.data();
    // Scores: every query head against each key, eight keys at a time (eight independent accumulator
    // chains: one key's dot product alone waits on each FMA's latency); each score is summed exactly as a
    // key alone would be (lanes over the head's dimensions in order, then hsum).
    // Each key's and value's row is read once per step from a cache larger than the CPU's: both are asked of
    // memory PREFETCH_KEYS keys ahead of the scores, so that the values' pass finds them in L2.
    prefetch_rows(s.kc, r, n < PREFETCH_KEYS ? n : PREFETCH_KEYS, row);
    prefetch_rows(s.vc, r, n < PREFETCH_KEYS ? n : PREFETCH_KEYS, row);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (i + 8 + PREFETCH_KEYS <= n) {
            prefetch_rows(s.kc, r + i + PREFETCH_KEYS, 8, row);
            prefetch_rows(s.vc, r + i + PREFETCH_KEYS, 8, row);
        }
        for (int64_t g = 0; g < s.kv_heads; ++g) {
            const float* k[8];
            for (int u = 0; u < 8; ++u) k[u] = s.kc + r[i + u] + g * s.d;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
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
                _mm256_storeu_ps(sc + h * padded + i,
                                 _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(s.scale)));
            }
        }
    }
    for (; i < n; ++i)  // the last keys one at a time
        for (int64_t h = 0; h < s.heads; ++h) {
            const float* k = s.kc + r[i] + (h / group) * s.d;
            const float* qh = q0 + h * s.d;
            __m256 a = _mm256_setzero_ps();
            for (int64_t j = 0; j < s.d; j += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), _mm256_loadu_ps(k + j), a);
            sc[h * padded + i] = hsum(a) * s.scale;
        }
    for (int64_t h = 0; h < s.heads; ++h) {  // softmax weights, unnormalized, then the weighted values / their sum
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
        float* o = out + h * s.d;
        weighted_values(s, r, n, w, (h / group) * s.d, o);
        if (ml != nullptr) {
            ml[2 * h] = m, ml[2 * h + 1] = hsum(sum);
            continue;
        }
        const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
        for (int64_t j = 0; j < s.d; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(o + j), inv));
    }
}

// A range split in n_parts parts (part c at parts + c * stride: heads * d floats of values, then (max, sum)
// per head) combined into out (head h at out + h * d), in part order, each part's weights rescaled to the
// largest maximum.
void combine_parts(const Shape& s, const float* parts, int64_t n_parts, int64_t stride, float* out) {
    const int64_t ml = s.heads * s.d;
    for (int64_t h = 0; h < s.heads; ++h) {
        float top = -__builtin_inff();
        for (int64_t c = 0; c < n_parts; ++c) top = fmaxf(top, parts[c * stride + ml + 2 * h]);
        float* o = out + h * s.d;
        float den = 0.0f;
        for (int64_t c = 0; c < n_parts; ++c) {
            const float* part = parts + c * stride;
            const float f = expf(part[ml + 2 * h] - top);
            den += f * part[ml + 2 * h + 1];
            const __m256 fv = _mm256_set1_ps(f);
            for (int64_t j = 0; j < s.d; j += 8) {
                const __m256 v = _mm256_mul_ps(fv, _mm256_loadu_ps(part + h * s.d + j));
                _mm256_storeu_ps(o + j, c == 0 ? v : _mm256_add_ps(_mm256_loadu_ps(o + j), v));
            }
        }
        const __m256 inv = _mm256_set1_ps(1.0f / den);
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
    const int64_t part_floats = heads * (d + 2);
    struct Item {
        int64_t t, i, k0, n;  // token, sequence, its keys k0 .. k0 + n (a part of its range, or all of it)
        int64_t part;         // -1: the whole range; else where its part goes in `parts`
    };
    struct Split {
        int64_t t, first, n_parts;
    };
    std::vector<Item> items;
    std::vector<Split> splits;
    int64_t work = 0, n_parts_all = 0;
    for (int64_t j = 0; j < n_ids; ++j) {
        const int32_t i = seq_ids[j];
        for (int64_t t = qsl[i]; t < qsl[i + 1]; ++t) {
            const int64_t pos = seq_lens[i] - (qsl[i + 1] - qsl[i]) + (t - qsl[i]);
            const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, n = pos - lo + 1;
            if (n <= PART_KEYS) {
                items.push_back({t, i, lo, n, -1});
                continue;
            }
            const int64_t n_parts = (n + PART_KEYS - 1) / PART_KEYS;
            splits.push_back({t, n_parts_all, n_parts});
            for (int64_t c = 0; c < n_parts; ++c) {
                const int64_t k0 = lo + c * PART_KEYS;
                items.push_back({t, i, k0, k0 + PART_KEYS < lo + n ? PART_KEYS : lo + n - k0, n_parts_all + c});
            }
            n_parts_all += n_parts;
        }
        work += (qsl[i + 1] - qsl[i]) * static_cast<int64_t>(seq_lens[i]);
    }
    std::vector<float> parts(n_parts_all * part_floats);
    const bool parallel = threads > 1 && work * heads * d >= (int64_t(1) << 18);
    dw_parallel_for(parallel ? threads : 1, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<float> scratch;
        thread_local std::vector<int64_t> rows;
        for (int64_t it = begin; it < end; ++it) {
            const Item& x = items[it];
            const int32_t* table = tables + x.i * table_width;
            if (x.part < 0) {
                attend_keys(s, x.t, table, x.k0, x.n, out + x.t * heads * d, nullptr, scratch, rows);
            } else {
                float* p = parts.data() + x.part * part_floats;
                attend_keys(s, x.t, table, x.k0, x.n, p, p + heads * d, scratch, rows);
            }
        }
    });
    for (const Split& sp : splits)  // the parts of a long range put together, in order
        combine_parts(s, parts.data() + sp.first * part_floats, sp.n_parts, part_floats, out + sp.t * heads * d);
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
