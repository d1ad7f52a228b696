// Helpers shared by kernels/cpu_quant.c and kernels/cpu_kv_quant.c (two libraries, built separately).
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
#endif

#ifdef __AVX2__
// exp of 8 floats: 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for
// precision) and p a degree-6 polynomial (relative error ~1e-7 over the softmax's range x <= 0).
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
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
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

static float exp_span(float *s, int lo, int hi, float mx) {
    // s[lo:hi] = exp(s - mx) in place; returns their sum
    int p = lo;
    float sum = 0.f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; p + 8 <= hi; p += 8) {
        __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), m));
        _mm256_storeu_ps(s + p, w);
        acc = _mm256_add_ps(acc, w);
    }
    sum = hsum8(acc);
#endif
    for (; p < hi; p++) {
        s[p] = expf(s[p] - mx);
        sum += s[p];
    }
    return sum;
}

static inline float dot_f32(const float *a, const float *b, int n) {
#ifdef __AVX2__
    if (n % 16 == 0) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
        }
        return hsum8(_mm256_add_ps(a0, a1));
    }
#endif
    float acc = 0.f;
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

// The spans of one decode attention merged by log-sum-exp: part holds, per span c and query head i,
// at ((c * Hq + i) * (D + 2)) the span's unnormalized output [D], its max score, its exp-sum. -> out [Hq, D]
static void merge_spans(const float *part, int S, int Hq, int D, float *out) {
    for (int i = 0; i < Hq; i++) {
        float mx = -INFINITY, total = 0.f, *dst = out + (size_t)i * D;
        for (int c = 0; c < S; c++) {
            float m = part[((size_t)c * Hq + i) * (D + 2) + D];
            mx = m > mx ? m : mx;
        }
        for (int d = 0; d < D; d++) dst[d] = 0.f;
        for (int c = 0; c < S; c++) {
            const float *o = part + ((size_t)c * Hq + i) * (D + 2);
            if (o[D + 1] == 0.f) continue;
            float w = expf(o[D] - mx);
            total += w * o[D + 1];
            for (int d = 0; d < D; d++) dst[d] += w * o[d];
        }
        for (int d = 0; d < D; d++) dst[d] /= total;
    }
}

static inline uint16_t to_bf16(float f) {
    // round to nearest even, as torch's float -> bfloat16 conversion (NaN kept a NaN)
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
