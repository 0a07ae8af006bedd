// Small AVX2 helpers shared by the CPU kernel library's files (cpu_matmul.py builds them).
#pragma once

#include <immintrin.h>

// exp(x), Cephes' single-precision polynomial with the argument reduced by a two-part ln 2 (good to ~2 ulp);
// below -87.3 the result is 0, above 88 it is exp(88).
static inline __m256 exp_ps(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// hsum of eight vectors at once: lane u of the result is hsum(a_u), summed in the same order (so the same bits):
// each vector's halves added (v_i + v_{i+4}), then lanes 0 + 2 and 1 + 3, then those two.
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 s04 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a4, 0x20), _mm256_permute2f128_ps(a0, a4, 0x31));
    const __m256 s15 = _mm256_add_ps(_mm256_permute2f128_ps(a1, a5, 0x20), _mm256_permute2f128_ps(a1, a5, 0x31));
    const __m256 s26 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a6, 0x20), _mm256_permute2f128_ps(a2, a6, 0x31));
    const __m256 s37 = _mm256_add_ps(_mm256_permute2f128_ps(a3, a7, 0x20), _mm256_permute2f128_ps(a3, a7, 0x31));
    const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(s04, s15, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s04, s15, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(s26, s37, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(s26, s37, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_hadd_ps(e, f);
}
