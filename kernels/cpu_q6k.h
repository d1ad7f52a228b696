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
// The matvecs build each code as the byte ((q ^ 32) << 2), which read as int8 is (q - 32) * 4, unpack it into the
// high byte of a 16-bit lane ((q - 32) * 1024) and take the high half of its product with sc * 64: exactly
// (q - 32) * sc, |.| <= 4096, in one multiply, against the int16 activations; one float multiply-add per group of
// 32 and row remains, by d * xs. The unpacking interleaves 8-value blocks, so the activations are reordered to
// match once per call (q6k_order). Each row of x is computed with the same operations in the same order whatever
// the number of rows in the call and whatever the SIMD variant (AVX-512's two groups a register are AVX2's chains
// of groups 4h + 0..3), as the q4 and q8 matvecs are. The int8-activation rows are cpu_q6k_act8.h's.
#pragma once

// the code (0..63) of value i of a row
static inline int q6k_code(const uint8_t *ql, const uint8_t *qh, int i) {
    int h = i >> 7, c = (i >> 5) & 3, l = i & 31;
    int low = (ql[64 * h + 32 * (c & 1) + l] >> (4 * (c >> 1))) & 15;
    return low | ((qh[32 * h + l] >> (2 * c)) & 3) << 4;
}

// a row's sub-block scales times mul as int16, and f [M, K/32] = d of the group's block times xs[m][g]
static inline void q6k_row_scales(const int8_t *sc, const half_t *d, const float *xs, int M, int K, int mul,
                                  int16_t *s16, float *f) {
    int i = 0, ng = K / 32;
#ifdef __AVX2__
    for (; i + 16 <= K / 16; i += 16)
        _mm256_storeu_si256((__m256i *)(s16 + i), _mm256_mullo_epi16(_mm256_set1_epi16((int16_t)mul),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sc + i)))));
#endif
    for (; i < K / 16; i++) s16[i] = (int16_t)(sc[i] * mul);
    for (int b = 0; b < K / 256; b++) {          // 8 groups a block
        float db = f16_to_f32(d[b]);
        for (int m = 0; m < M; m++)
            for (int g = 8 * b; g < 8 * b + 8; g++) f[m * ng + g] = db * xs[m * ng + g];
    }
}

#ifdef __AVX2__
// xq [M, K] -> xr: in each 64 values the 8-value blocks 0, 2, 4, 6 then 1, 3, 5, 7 (the order the unpacked codes
// come in: q6k_rows)
static void q6k_order(const int16_t *xq, int M, int K, int16_t *xr) {
    for (size_t i = 0; i < (size_t)M * K; i += 64)
        for (int b = 0; b < 8; b++) memcpy(xr + i + (b & 1) * 32 + (b >> 1) * 8, xq + i + b * 8, 16);
}

// Group c (0-3) of a half-block as 32 bytes ((q ^ 32) << 2) in value order: A0, A1 its ql bytes 0-31 and 32-63,
// qx its qh bytes with the top bit of each 2-bit field flipped (q ^ 32). The 16-bit shifts carry bits across bytes
// only into the positions the masks clear.
static inline __m256i q6k_group(__m256i a0, __m256i a1, __m256i qx, int c) {
    __m256i a = c & 1 ? a1 : a0;
    __m256i low = c >> 1 ? _mm256_srli_epi16(a, 2) : _mm256_slli_epi16(a, 2);        // bits 2-5
    __m256i high = c == 3 ? qx : _mm256_slli_epi16(qx, 6 - 2 * c);                     // bits 6-7
    return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x3C)),
                           _mm256_and_si256(high, _mm256_set1_epi8((char)0xC0)));
}

// [s[2c] x 8 | s[2c + 1] x 8] (int16) from s8, the 8 scales of a half-block in both 128-bit lanes: group c's
// sub-blocks, values 0-15 and 16-31
static inline __m256i q6k_scales(__m256i s8, int c) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(s8, _mm256_add_epi8(pick, _mm256_set1_epi8((char)(4 * c))));
}

// R rows (a constant: the accumulators stay in registers) of int16 activations (xr: q6k_order) against one weight
// row: group g into chain g % 4. Per group, the bytes unpacked into the high byte of 16-bit lanes (values 0-7 and
// 16-23 in one register, 8-15 and 24-31 in the other), times sc * 64 (high half: (q - 32) * sc), against the
// reordered activations.
static inline __attribute__((always_inline)) void q6k_rows(const uint8_t *ql, const uint8_t *qh, const int16_t *s64,
        const float *f, const int16_t *xr, int ng, int K, const int R, float *out) {
    __m256 acc[2][4];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    for (int h = 0; h < ng / 4; h++) {
        _mm_prefetch((const char *)(ql + 64 * h + PREFETCH), _MM_HINT_T0);
        FAR_PREFETCH(ql + 64 * h);
        if (!(h & 1)) _mm_prefetch((const char *)(qh + 32 * h + PREFETCH / 2), _MM_HINT_T0);
        if (!(h & 1)) _mm_prefetch((const char *)(qh + 32 * h) + PF_FAR / 2, _MM_HINT_T1);
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        __m256i qx = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)), _mm256_set1_epi8((char)0xAA));
        __m256i s8 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(s64 + 8 * h)));
        for (int c = 0; c < 4; c++) {
            int g = 4 * h + c;
            __m256i b = q6k_group(a0, a1, qx, c);
            // values 0-7 / 8-15 in 128-bit lane 0 (scale s[2g]), 16-23 / 24-31 in lane 1 (s[2g + 1])
            __m256i s = q6k_scales(s8, c);
            __m256i lo = _mm256_mulhi_epi16(_mm256_unpacklo_epi8(zero, b), s);
            __m256i hi = _mm256_mulhi_epi16(_mm256_unpackhi_epi8(zero, b), s);
            const int16_t *v = xr + (size_t)h * 128 + (c >> 1) * 64 + (c & 1) * 16;     // q6k_order's place of g
            for (int m = 0; m < R; m++) {
                const int16_t *vm = v + (size_t)m * K;
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)vm)),
                                             _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(vm + 32))));
                acc[m][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(f + m * ng + g), acc[m][c]);
            }
        }
    }
    for (int m = 0; m < R; m++)
        out[m] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][2]), _mm256_add_ps(acc[m][1], acc[m][3])));
}

#ifdef KVCHAT_AVX512
// Half-block h's codes as bytes ((q ^ 32) << 2), two ternary-logic ops each: b01 groups 4h, 4h + 1 (bytes 0-31,
// 32-63), b23 groups 4h + 2, 4h + 3. (c ? a : b) = 0xE4, then (t & 0xFC) ^ 0x80 = 0x6A: bits 2-5 the low nibble,
// 6-7 the high bits, the top one flipped.
static inline void q6k_half_512(const uint8_t *ql, const uint8_t *qh, int h, __m512i *b01, __m512i *b23) {
    const __m512i m3c = _mm512_set1_epi8(0x3C), mfc = _mm512_set1_epi8((char)0xFC), x80 = _mm512_set1_epi8((char)0x80);
    // qh to bits 6-7, per 16-bit lane: group 0 (bytes 0-31 of b01) << 6, group 1 << 4; group 2 << 2, group 3 << 0
    const __m512i sh01 = _mm512_inserti64x4(_mm512_set1_epi16(6), _mm256_set1_epi16(4), 1);
    const __m512i sh23 = _mm512_inserti64x4(_mm512_set1_epi16(2), _mm256_setzero_si256(), 1);
    __m512i a = _mm512_loadu_si512((const void *)(ql + 64 * h));
    __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
    *b01 = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(_mm512_slli_epi16(a, 2), _mm512_sllv_epi16(q, sh01),
                                                               m3c, 0xE4), mfc, x80, 0x6A);
    *b23 = _mm512_ternarylogic_epi32(_mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 2), _mm512_sllv_epi16(q, sh23),
                                                               m3c, 0xE4), mfc, x80, 0x6A);
}

// The 8 sub-block scales of a half-block (s: their int8 bytes, taken times 64) for b01's and b23's 128-bit lanes:
// [s0 x 8 | s1 | s2 | s3 x 8] and [s4 x 8 | .. | s7 x 8] (a lane holds 16 values of one sub-block; unpacked, 8 of
// them a register)
static inline void q6k_scales_512(const int8_t *s, __m512i *s01, __m512i *s23) {
    const __m512i idx01 = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                           1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i s8 = _mm512_castsi128_si512(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)s)), 6));
    *s01 = _mm512_permutexvar_epi16(idx01, s8);
    *s23 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx01, _mm512_set1_epi16(4)), s8);
}

// The sum of AVX2's four chains (acc[0] lanes 0-7 and 8-15: chains 0, 1; acc[1]: 2, 3), in its order
static inline float q6k_sum_512(const __m512 acc[2]) {
    return hsum8(_mm256_add_ps(_mm256_add_ps(low8(acc[0]), low8(acc[1])), _mm256_add_ps(high8(acc[0]), high8(acc[1]))));
}

// q6k_rows, a half-block (four groups) a step: groups 4h, 4h + 1 in one register of 64 bytes (4h + 2, 4h + 3 in
// another), whose unpacked halves hold, per 128-bit lane, 8 values of sub-blocks 8h + 0..3 (8h + 4..7). Every int32
// lane sums the same four products as AVX2's; the float lanes 0-7 and 8-15 of acc[m][0] are AVX2's chains 0 and 1,
// those of acc[m][1] chains 2 and 3. The scales (sc, d) are read in the loop: each group's d * xs the product
// q6k_row_scales forms, the same bits.
static inline __attribute__((always_inline)) void q6k_rows_512(const uint8_t *ql, const uint8_t *qh,
        const int8_t *sc, const half_t *d, const float *xs, const int16_t *xr, int ng, int K, const int R,
        float *out) {
    const __m512i lo2 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i hi2 = _mm512_add_epi32(lo2, _mm512_set1_epi32(2));
    float db = 0.f;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[8][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int h = 0; h < ng / 4; h++) {
        _mm_prefetch((const char *)(ql + 64 * h + PREFETCH), _MM_HINT_T0);
        FAR_PREFETCH(ql + 64 * h);
        if (!(h & 1)) _mm_prefetch((const char *)(qh + 32 * h + PREFETCH / 2), _MM_HINT_T0);
        if (!(h & 1)) _mm_prefetch((const char *)(qh + 32 * h) + PF_FAR / 2, _MM_HINT_T1);
        if (!(h & 1)) db = f16_to_f32(d[h >> 1]);
        __m512i b01, b23, s01, s23;
        q6k_half_512(ql, qh, h, &b01, &b23);
        q6k_scales_512(sc + 8 * h, &s01, &s23);
        __m512i p0 = _mm512_mulhi_epi16(_mm512_unpacklo_epi8(zero, b01), s01);
        __m512i p1 = _mm512_mulhi_epi16(_mm512_unpackhi_epi8(zero, b01), s01);
        __m512i p2 = _mm512_mulhi_epi16(_mm512_unpacklo_epi8(zero, b23), s23);
        __m512i p3 = _mm512_mulhi_epi16(_mm512_unpackhi_epi8(zero, b23), s23);
        for (int m = 0; m < R; m++) {
            const int16_t *v = xr + (size_t)m * K + 128 * h;
            __m512 fm = _mm512_castps128_ps512(_mm_mul_ps(_mm_set1_ps(db), _mm_loadu_ps(xs + (size_t)m * ng + 4 * h)));
            __m512i i01 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, p0, _mm512_loadu_si512((const void *)v)),
                                              p1, _mm512_loadu_si512((const void *)(v + 32)));
            __m512i i23 = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, p2, _mm512_loadu_si512((const void *)(v + 64))),
                                              p3, _mm512_loadu_si512((const void *)(v + 96)));
            acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i01), _mm512_permutexvar_ps(lo2, fm), acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i23), _mm512_permutexvar_ps(hi2, fm), acc[m][1]);
        }
    }
    for (int m = 0; m < R; m++) out[m] = q6k_sum_512(acc[m]);
}

// M rows of int16 activations (xr: q6k_order) against one weight row
static __attribute__((noinline)) void q6k_rowsM_512(const uint8_t *ql, const uint8_t *qh, const int8_t *sc,
        const half_t *d, const float *xs, const int16_t *x, int ng, int K, int M, float *out) {
#define Q6K_ROWS(R) q6k_rows_512(ql, qh, sc, d, xs, x, ng, K, R, out)
    switch (M) {        // a constant R per case: the accumulators stay in registers
        case 1: Q6K_ROWS(1); break;
        case 2: Q6K_ROWS(2); break;
        case 3: Q6K_ROWS(3); break;
        case 4: Q6K_ROWS(4); break;
        case 5: Q6K_ROWS(5); break;
        case 6: Q6K_ROWS(6); break;
        case 7: Q6K_ROWS(7); break;
        default: Q6K_ROWS(8); break;
    }
#undef Q6K_ROWS
}
#endif
#endif

// y [M, ldy] (+ resid [M, N]) = prep(x) [M, K] times the Q6_K matrix [N, K]^T; scratch as for q4_gemv: the
// reordered activations take 2 * M * K bytes more than activations() (mode 0: after its pieces; else where the
// prepared float rows were, quantized by then), which q4_gemv's 7 * M * K leave. K % 256 == 0.
static void q6k_gemv8(const float *x, int M, int K, const uint8_t *ql, const uint8_t *qh, const int8_t *sc,
                      const half_t *d, int N, float *y, int ldy, void *scratch, int mode, const float *norm_w,
                      float eps, const float *resid);

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
    int16_t *xr = mode ? (int16_t *)scratch
                       : (int16_t *)(((uintptr_t)(sums + (size_t)M * ng) + 63) & ~(uintptr_t)63);
    q6k_order(xq, M, K, xr);
#endif
    SHARED_STEPS(N, SHARE_ROWS, n) {
        const uint8_t *l = ql + (size_t)n * (K / 2), *h = qh + (size_t)n * (K / 4);
        float out[MAXM];
#ifndef KVCHAT_AVX512
        int16_t s16[2 * MAXG];
        float f[MAXM * MAXG];
#endif
#ifdef KVCHAT_AVX512
        q6k_rowsM_512(l, h, sc + (size_t)n * (K / 16), d + (size_t)n * (K / 256), xs, xr, ng, K, M, out);
#elif defined(__AVX2__)
        q6k_row_scales(sc + (size_t)n * (K / 16), d + (size_t)n * (K / 256), xs, M, K, 64, s16, f);
        for (int m = 0; m < M; m += 2) {
            if (M - m == 1) q6k_rows(l, h, s16, f + (size_t)m * ng, xr + (size_t)m * K, ng, K, 1, out + m);
            else q6k_rows(l, h, s16, f + (size_t)m * ng, xr + (size_t)m * K, ng, K, 2, out + m);
        }
#else
        // plain loops: the integer sum of a group can pass 2^31 (32 products of up to 4096 * 32767): 64 bits
        q6k_row_scales(sc + (size_t)n * (K / 16), d + (size_t)n * (K / 256), xs, M, K, 1, s16, f);
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

#include "cpu_q6k_act8.h"

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
