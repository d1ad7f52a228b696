// GGUF Q6_K weights at their own 6.5625 bits a value: matvecs for decode rows and dequantization for prefill.
// Included by cpu_quant.c after the activation quantizers (int16: activations; int8: cpu_act8.h) and store_bf16,
// before lin_apply, which runs a linear of bits 6 here.
//
// A Q6_K block of 256 values w = (d * sc) * (q - 32), q a 6-bit code, holds ql [128] (the low 4 bits), qh [64] (the
// high 2), sc [16] (int8, one per 16 values) and d (float16). The loader (engine/gguf/blocks.py: q6k_parts) only
// splits each row's blocks into four arrays: ql [K/2], qh [K/4], sc [K/16], d [K/256], every byte as the file has
// it. Half h of a block (128 values, groups of 32 numbered 0-3) reads ql bytes A = ql[64h ..], qh bytes Q =
// qh[32h ..]: value 32c + l (l < 32) has low bits (c & 1 ? A[32 + l] : A[l]) >> (c >> 1 ? 4 : 0) & 15 and high
// bits Q[l] >> 2c & 3. In a qlin_t: codes = ql, zero = qh, scale = sc, ssup = d (float16, whatever the field's
// type says).
//
// Dequantization is gguf's bit for bit: d * sc rounded to float32 once, then times q - 32 (exact in float).
// The matvecs (cpu_q6k_act8.h) take the codes unsigned and the activations as int8: int8 activations as they are,
// int16 ones as two byte planes (the signed top bytes, the unsigned bottom ones), each plane through the same loop
// and the two lanes' sums joined exactly (x = 256 top + bottom). Each row of x is computed with the same operations
// in the same order whatever the number of rows in the call and whatever the SIMD variant, as the q4 and q8 matvecs
// are; builds without AVX2 sum in plain loops.
#pragma once

// the code (0..63) of value i of a row
static inline int q6k_code(const uint8_t *ql, const uint8_t *qh, int i) {
    int h = i >> 7, c = (i >> 5) & 3, l = i & 31;
    int low = (ql[64 * h + 32 * (c & 1) + l] >> (4 * (c >> 1))) & 15;
    return low | ((qh[32 * h + l] >> (2 * c)) & 3) << 4;
}

// the plain loops' row terms: its sub-block scales as int16, and f [M, K/32] = d of the group's block times xs[m][g]
static inline void q6k_row_scales(const int8_t *sc, const half_t *d, const float *xs, int M, int K, int16_t *s16,
                                  float *f) {
    int ng = K / 32;
    for (int i = 0; i < K / 16; i++) s16[i] = sc[i];
    for (int b = 0; b < K / 256; b++) {          // 8 groups a block
        float db = f16_to_f32(d[b]);
        for (int m = 0; m < M; m++)
            for (int g = 8 * b; g < 8 * b + 8; g++) f[m * ng + g] = db * xs[m * ng + g];
    }
}

#ifdef __AVX2__
// Group c (0-3) of a half-block as 32 bytes ((q ^ 32) << 2) in value order (the dequantization's): A0, A1 its ql
// bytes 0-31 and 32-63, qx its qh bytes with the top bit of each 2-bit field flipped (q ^ 32). The 16-bit shifts carry bits across bytes
// only into the positions the masks clear.
static inline __m256i q6k_group(__m256i a0, __m256i a1, __m256i qx, int c) {
    __m256i a = c & 1 ? a1 : a0;
    __m256i low = c >> 1 ? _mm256_srli_epi16(a, 2) : _mm256_slli_epi16(a, 2);        // bits 2-5
    __m256i high = c == 3 ? qx : _mm256_slli_epi16(qx, 6 - 2 * c);                     // bits 6-7
    return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x3C)),
                           _mm256_and_si256(high, _mm256_set1_epi8((char)0xC0)));
}
#endif

#include "cpu_q6k_act8.h"      // the SIMD rows: int8 activations, and int16 ones as two byte planes through them

// y [M, ldy] (+ resid [M, N]) = prep(x) [M, K] times the Q6_K matrix [N, K]^T; scratch as for q4_gemv: the laid-out
// planes and their sums take 3 * M * K bytes more than activations() (mode 0: after its pieces; else where the
// prepared float rows were, quantized by then), which q4_gemv's 7 * M * K leave. K % 256 == 0.
static void q6k_gemv_ld(const float *x, int M, int K, const uint8_t *ql, const uint8_t *qh, const int8_t *sc,
                        const half_t *d, int N, float *y, int ldy, void *scratch, int mode, const float *norm_w,
                        float eps, const float *resid) {
    if (mode & ACT8) {
        q6k_gemv8(x, M, K, ql, qh, sc, d, N, y, ldy, scratch, mode & ~ACT8, norm_w, eps, resid);
        return;
    }
    int ng = K / 32;
    int16_t *xq;
    float *xs, *sums;
    activations(x, M, K, mode, norm_w, eps, scratch, &xq, &xs, &sums);
#ifdef __AVX2__
    int8_t *xl = mode ? (int8_t *)scratch : (int8_t *)(((uintptr_t)(sums + (size_t)M * ng) + 63) & ~(uintptr_t)63);
    int16_t *x32 = (int16_t *)(xl + 2 * (size_t)M * K);
    q6x16_layout(xq, M, K, xl, x32);
    int32_t *x32s = NULL;
#ifdef KVCHAT_AVX512
    // after x32, 64-byte aligned: within the float rows' room (mode != 0) or q4_gemv's 7 M K bytes (mode 0)
    x32s = (int32_t *)(((uintptr_t)(x32 + 2 * (size_t)M * (K / 4)) + 63) & ~(uintptr_t)63);
    q6x16_sums(x32, M, K, x32s);
#endif
#endif
    SHARED_STEPS(N, SHARE_ROWS, n) {
        const uint8_t *l = ql + (size_t)n * (K / 2), *h = qh + (size_t)n * (K / 4);
        float out[MAXM];
#ifdef __AVX2__
        q6x8_rowsM(l, h, sc + (size_t)n * (K / 16), d + (size_t)n * (K / 256), xl, x32, x32s, xs, ng, K, M, 16,
                   out);
#else
        // plain loops: the integer sum of a group can pass 2^31 (32 products of up to 4096 * 32767): 64 bits
        int16_t s16[2 * MAXG];
        float f[MAXM * MAXG];
        q6k_row_scales(sc + (size_t)n * (K / 16), d + (size_t)n * (K / 256), xs, M, K, s16, f);
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int g = 0; g < ng; g++) {
            int16_t c[32];
            for (int j = 0; j < 32; j++) c[j] = (int16_t)((q6k_code(l, h, g * 32 + j) - 32) * s16[2 * g + j / 16]);
            for (int m = 0; m < M; m++) {
                const int16_t *v = xq + (size_t)m * K + g * 32;
                int64_t dot = 0;
                for (int j = 0; j < 32; j++) dot += (int64_t)c[j] * v[j];
                out[m] += f[m * ng + g] * (float)dot;
            }
        }
#endif
        for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
    }
}

void q6k_gemv(const float *x, int M, int K, const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const half_t *d,
              int N, float *y, void *scratch, int mode, const float *norm_w, float eps, const float *resid) {
    q6k_gemv_ld(x, M, K, ql, qh, sc, d, N, y, N, scratch, mode, norm_w, eps, resid);
}

// Rows as float32 (out) or bf16 (out16: each value as torch's .bfloat16() of the float32 one), a half-block a step
static void q6k_dequant_to(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const half_t *d, int N, int K,
                           float *out, uint16_t *out16) {
    #pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) {
        const uint8_t *l = ql + (size_t)n * (K / 2), *h = qh + (size_t)n * (K / 4);
        const int8_t *s = sc + (size_t)n * (K / 16);
        const half_t *dn = d + (size_t)n * (K / 256);
        for (int hb = 0; hb < K / 128; hb++) {
            float tmp[128], ds[8];
            float *o = out16 ? tmp : out + (size_t)n * K + hb * 128;
            float db = f16_to_f32(dn[hb / 2]);
            for (int i = 0; i < 8; i++) ds[i] = db * (float)s[8 * hb + i];
#ifdef __AVX2__
            __m256i a0 = _mm256_loadu_si256((const __m256i *)(l + 64 * hb));
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(l + 64 * hb + 32));
            __m256i qx = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(h + 32 * hb)),
                                          _mm256_set1_epi8((char)0xAA));
            for (int c = 0; c < 4; c++) {
                __m256i b = q6k_group(a0, a1, qx, c);           // int8 (q - 32) * 4, exact; / 4 exact too
                for (int k = 0; k < 4; k++) {
                    __m128i part = k & 2 ? _mm256_extracti128_si256(b, 1) : _mm256_castsi256_si128(b);
                    __m256i q = _mm256_srai_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(part, 8 * (k & 1))), 2);
                    _mm256_storeu_ps(o + 32 * c + 8 * k, _mm256_mul_ps(_mm256_set1_ps(ds[2 * c + k / 2]),
                                                                       _mm256_cvtepi32_ps(q)));
                }
            }
#else
            for (int i = 0; i < 128; i++) o[i] = ds[i / 16] * (float)(q6k_code(l, h, hb * 128 + i) - 32);
#endif
            if (out16) store_bf16(tmp, out16 + (size_t)n * K + hb * 128, 128);
        }
    }
}

void q6k_dequant(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const half_t *d, int N, int K, float *out) {
    q6k_dequant_to(ql, qh, sc, d, N, K, out, NULL);
}

void q6k_dequant_bf16(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const half_t *d, int N, int K,
                      uint16_t *out) {
    q6k_dequant_to(ql, qh, sc, d, N, K, NULL, out);
}
