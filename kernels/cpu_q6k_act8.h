// Q6_K rows against int8 activations (EngineConfig(activations="int8"), cpu_act8.h's quantize_x8), and against int16
// ones as two byte planes through the same loop. Included by cpu_q6k.h, whose block layout it reads.
//
// The codes go in unsigned, q (0..63) as the file stores them, so maddubs takes them with no sign trick, and the
// -32 comes back per int16 lane from the activations alone (x32: 32 times the sum of the four activations the lane
// covers, formed once a call). Half-block h (four groups c, values 32c + l) unpacks to P = [group 0 | group 1]
// from ql's low nibbles and Q = [group 2 | group 3] from its high ones; their 64-bit pieces are then interleaved so
// that P' and Q' hold, at each position, values of the same sub-block of 16 (128-bit lane j: groups j >> 1 and
// (j >> 1) + 2, values 16 (j & 1) + 0..7 in P', + 8..15 in Q'). Two maddubs added lane by lane give four products
// an int16 lane (|.| <= 4 * 63 * 127, no saturation), minus x32 exactly (q - 32) times x, and one madd by the
// sub-block scales gives eight products an int32 lane: four lanes a group, one float multiply-add per 128 weights
// by d * xs, the scales and d read inside the loop. Lanes 0-7 come from ql bytes 0-31 (groups 0 and 2), 8-15 from
// bytes 32-63; AVX2 keeps them in two registers, AVX-512 in one, summed as (lanes 0-7) + (lanes 8-15) at the end:
// the same bits in every variant and for every number of rows. The baseline sums in plain loops.
//
// int16 activations x = 256 t + b (t = x >> 8 signed, b = x & 255 unsigned) take two planes laid out alike. The top
// plane is the int8 one (|4 (q - 32) t| <= 16384). The bottom plane's bytes go in as maddubs' unsigned operand and
// the codes (<= 63) as its signed one: a pair is at most 2 * 255 * 63 = 32130, so no saturation; the two maddubs'
// sum may wrap but the lane after x32 is (q - 32) b summed over four, |.| <= 32640, exact in 16-bit arithmetic.
// An int32 lane is then 256 madd(top) + madd(bottom), |.| <= 2^30 + 2^23: the exact integer of its eight values.
#pragma once

#ifdef __AVX2__
// One half-block's 128 activations x -> o in P' then Q' order, and x32 [32]: per int16 lane i (128-bit lane i / 8,
// pair i % 8), 32 times its four activations' sum (U: the bytes read unsigned)
static inline void q6x8_half(const int8_t *x, int8_t *o, int16_t *x32, const int U) {
    for (int j = 0; j < 4; j++) {
        const int8_t *a = x + 32 * (j >> 1) + 16 * (j & 1), *b = a + 64;          // groups j >> 1 and + 2
        memcpy(o + 16 * j, a, 8), memcpy(o + 16 * j + 8, b, 8);
        memcpy(o + 64 + 16 * j, a + 8, 8), memcpy(o + 64 + 16 * j + 8, b + 8, 8);
    }
    for (int i = 0; i < 32; i++) {
        const int8_t *p = o + 16 * (i / 8) + 2 * (i % 8), *q = p + 64;
        x32[i] = (int16_t)(32 * (U ? (uint8_t)p[0] + (uint8_t)p[1] + (uint8_t)q[0] + (uint8_t)q[1]
                                   : p[0] + p[1] + q[0] + q[1]));
    }
}

// xq [M, K] int8 -> xl [M, K] and x32 [M, K / 4] (q6x8_half)
static void q6x8_layout(const int8_t *xq, int M, int K, int8_t *xl, int16_t *x32) {
    for (size_t h = 0; h < (size_t)M * K / 128; h++) q6x8_half(xq + 128 * h, xl + 128 * h, x32 + 32 * h, 0);
}

// xq [M, K] int16 -> xl [M, 2, K]: row m's top bytes laid out (q6x8_half), then its bottom ones; x32 [M, 2, K / 4]
static void q6x16_layout(const int16_t *xq, int M, int K, int8_t *xl, int16_t *x32) {
    for (int m = 0; m < M; m++)
        for (int h = 0; h < K / 128; h++) {
            int8_t t[128], b[128];
            const int16_t *x = xq + (size_t)m * K + 128 * h;
            for (int i = 0; i < 128; i++) t[i] = (int8_t)(x[i] >> 8), b[i] = (int8_t)(x[i] & 255);
            q6x8_half(t, xl + 2 * (size_t)m * K + 128 * h, x32 + 2 * (size_t)m * (K / 4) + 32 * h, 0);
            q6x8_half(b, xl + (2 * (size_t)m + 1) * K + 128 * h, x32 + (2 * (size_t)m + 1) * (K / 4) + 32 * h, 1);
        }
}

#ifdef KVCHAT_AVX512
// x32 (q6x16_layout's) -> x32s [M, K / 8] int32: per int32 lane k of a half-block (int16 lanes 2k, 2k + 1 of both
// planes), 32 times its eight activations' sum, 256 * top + bottom: exact (|.| <= 2^23)
static void q6x16_sums(const int16_t *x32, int M, int K, int32_t *x32s) {
    for (int m = 0; m < M; m++) {
        const int16_t *t = x32 + 2 * (size_t)m * (K / 4), *b = t + K / 4;
        for (int k = 0; k < K / 8; k++)
            x32s[(size_t)m * (K / 8) + k] = 256 * (t[2 * k] + t[2 * k + 1]) + b[2 * k] + b[2 * k + 1];
    }
}
#endif

// Lanes 0-7 (c = 0: groups 0, 2 from ql bytes a = 0-31) or 8-15 (c = 1: groups 1, 3, bytes 32-63) of half-block
// h: p, q the interleaved codes, s the int16 scales [s_j x 4, s_{j+4} x 4] of 128-bit lanes j = 2c, 2c + 1
static inline void q6x8_codes(__m256i a, __m256i hb, int c, __m256i *p, __m256i *q) {
    const __m256i m0f = _mm256_set1_epi8(15), m33 = _mm256_set1_epi8(0x33);
    // t: bits 0-1 group c's high bits, 4-5 group c + 2's (the 16-bit shift's spill lands in the bits the mask drops)
    __m256i t = _mm256_and_si256(c ? _mm256_srli_epi16(hb, 2) : hb, m33);
    __m256i lo = _mm256_or_si256(_mm256_and_si256(a, m0f), _mm256_andnot_si256(m0f, _mm256_slli_epi16(t, 4)));
    __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m0f), _mm256_andnot_si256(m0f, t));
    *p = _mm256_unpacklo_epi64(lo, hi), *q = _mm256_unpackhi_epi64(lo, hi);
}

// the int32 lanes of one row: (P' x xp + Q' x xq - x32) by the sub-block scales; W 16: the planes (q6x16_layout),
// the bottom one K bytes (K / 4 sums) after the top
static inline __m256i q6x8_dot(__m256i p, __m256i q, __m256i s, const int8_t *x, const int16_t *x32, int K,
                               const int W) {
    __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(p, _mm256_loadu_si256((const __m256i *)x)),
                                 _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(x + 64))));
    __m256i t = _mm256_madd_epi16(_mm256_sub_epi16(d, _mm256_loadu_si256((const __m256i *)x32)), s);
    if (W == 8) return t;
    const int8_t *y = x + K;
    __m256i e = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)y), p),
                                 _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(y + 64)), q));
    __m256i b = _mm256_madd_epi16(_mm256_sub_epi16(e, _mm256_loadu_si256((const __m256i *)(x32 + K / 4))), s);
    return _mm256_add_epi32(_mm256_slli_epi32(t, 8), b);
}

#ifdef KVCHAT_AVX512
static inline __m512i q6x8_dot_512(__m512i p, __m512i q, __m512i s, const int8_t *x, const int16_t *x32, int K,
                                   const int W) {
    __m512i d = _mm512_add_epi16(_mm512_maddubs_epi16(p, _mm512_loadu_si512((const void *)x)),
                                 _mm512_maddubs_epi16(q, _mm512_loadu_si512((const void *)(x + 64))));
    __m512i t = _mm512_madd_epi16(_mm512_sub_epi16(d, _mm512_loadu_si512((const void *)x32)), s);
    if (W == 8) return t;
    const int8_t *y = x + K;
    __m512i e = _mm512_add_epi16(_mm512_maddubs_epi16(_mm512_loadu_si512((const void *)y), p),
                                 _mm512_maddubs_epi16(_mm512_loadu_si512((const void *)(y + 64)), q));
    __m512i b = _mm512_sub_epi16(e, _mm512_loadu_si512((const void *)(x32 + K / 4)));
    return _mm512_dpwssd_epi32(_mm512_slli_epi32(t, 8), b, s);
}

// W 16 with VNNI: the same int32 lanes (s times the exact sum of the lane's eight (q - 32) x, x = 256 t + b) as
// 256 dpbusd(codes, t) + dpbusd(b, codes) - x32s, times s32 (the lanes' scales as int32): four dot products and no
// 16-bit lanes to correct, the same bits as q6x8_dot_512's (every step exact: |.| < 2^31)
static inline __m512i q6x16_dot_vnni(__m512i p, __m512i q, __m512i s32, const int8_t *x, const int32_t *x32s,
                                     int K) {
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), p, _mm512_loadu_si512((const void *)x));
    t = _mm512_dpbusd_epi32(t, q, _mm512_loadu_si512((const void *)(x + 64)));
    const int8_t *y = x + K;
    __m512i v = _mm512_sub_epi32(_mm512_slli_epi32(t, 8), _mm512_loadu_si512((const void *)x32s));
    v = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(v, _mm512_loadu_si512((const void *)y), p),
                            _mm512_loadu_si512((const void *)(y + 64)), q);
    return _mm512_mullo_epi32(v, s32);
}
#endif

// R rows (a constant) of xl / x32 (q6x8_layout; W 16: q6x16_layout) against one weight row; xs [R, ng] the rows'
// group scales
static inline __attribute__((always_inline)) void q6x8_rows(const uint8_t *ql, const uint8_t *qh,
        const int8_t *sc, const half_t *d, const int8_t *xl, const int16_t *x32, const int32_t *x32s,
        const float *xs, int ng, int K, const int R, const int W, float *out) {
#ifdef KVCHAT_AVX512
    const __m512i pick = _mm512_set_epi16(7, 7, 7, 7, 3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2,
                                          5, 5, 5, 5, 1, 1, 1, 1, 4, 4, 4, 4, 0, 0, 0, 0);     // lanes 31 .. 0
    const __m512i fpick = _mm512_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2, 1, 1, 3, 3, 1, 1, 3, 3);
    const __m512i fpick4 = _mm512_add_epi32(fpick, _mm512_set1_epi32(4));
    __m512 f8[4];
    const __m512i m0f = _mm512_set1_epi8(15), m33 = _mm512_set1_epi8(0x33);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i pick32 = _mm512_setr_epi32(0, 0, 4, 4, 1, 1, 5, 5, 2, 2, 6, 6, 3, 3, 7, 7);
    __m512 acc[4];
    for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
#else
    const __m256i pick0 = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 8, 9, 8, 9, 8, 9, 8, 9,
                                           2, 3, 2, 3, 2, 3, 2, 3, 10, 11, 10, 11, 10, 11, 10, 11);
    const __m256i pick1 = _mm256_add_epi8(pick0, _mm256_set1_epi8(4));
    const __m256i fpick0 = _mm256_setr_epi32(0, 0, 2, 2, 0, 0, 2, 2), fpick1 = _mm256_setr_epi32(1, 1, 3, 3, 1, 1, 3, 3);
    __m256 acc[4][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
#endif
    float db = 0.f;
    for (int h = 0; h < ng / 4; h++) {
        _mm_prefetch((const char *)(ql + 64 * h + PREFETCH), _MM_HINT_T0);
        FAR_PREFETCH(ql + 64 * h);
        if (!(h & 1)) {
            _mm_prefetch((const char *)(qh + 32 * h + PREFETCH / 2), _MM_HINT_T0);
            _mm_prefetch((const char *)(qh + 32 * h) + PF_FAR / 2, _MM_HINT_T1);
            db = f16_to_f32(d[h >> 1]);
        }
        __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
#ifdef KVCHAT_AVX512
        __m512i a = _mm512_loadu_si512((const void *)(ql + 64 * h));
        __m512i t = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(hb), shift), m33);
        // (m ? a : b) = 0xCA: the low nibble from a (a >> 4), bits 4-7 from t << 4 (t), whose bits 6-7 are clear
        __m512i lo = _mm512_ternarylogic_epi32(m0f, a, _mm512_slli_epi16(t, 4), 0xCA);
        __m512i hi = _mm512_ternarylogic_epi32(m0f, _mm512_srli_epi16(a, 4), t, 0xCA);
        __m512i p = _mm512_unpacklo_epi64(lo, hi), q = _mm512_unpackhi_epi64(lo, hi);
        __m128i s8x = _mm_loadl_epi64((const __m128i *)(sc + 8 * h));
        __m512i s = W == 16 ? _mm512_permutexvar_epi32(pick32, _mm512_castsi256_si512(_mm256_cvtepi8_epi32(s8x)))
                            : _mm512_permutexvar_epi16(pick, _mm512_castsi128_si512(_mm_cvtepi8_epi16(s8x)));
        if (!(h & 1))               // a super-block's eight group factors d * xs, for both its half-blocks
            for (int m = 0; m < R; m++)
                f8[m] = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(db), _mm256_loadu_ps(xs + (size_t)m * ng
                                                                                                  + 4 * h)));
        for (int m = 0; m < R; m++) {
            size_t o = (size_t)m * K * (W / 8) + 128 * h;
            __m512 f = _mm512_permutexvar_ps((h & 1) ? fpick4 : fpick, f8[m]);
            __m512i v = W == 16 ? q6x16_dot_vnni(p, q, s, xl + o, x32s + (size_t)m * (K / 8) + 16 * h, K)
                                : q6x8_dot_512(p, q, s, xl + o, x32 + o / 4, K, W);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), f, acc[m]);
        }
#else
        __m128i s8 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * h)));
        __m256i s2 = _mm256_broadcastsi128_si256(s8), p0, q0, p1, q1;
        __m256i s0 = _mm256_shuffle_epi8(s2, pick0), s1 = _mm256_shuffle_epi8(s2, pick1);
        q6x8_codes(_mm256_loadu_si256((const __m256i *)(ql + 64 * h)), hb, 0, &p0, &q0);
        q6x8_codes(_mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32)), hb, 1, &p1, &q1);
        for (int m = 0; m < R; m++) {
            size_t o = (size_t)m * K * (W / 8) + 128 * h;
            __m256 f4 = _mm256_castps128_ps256(_mm_mul_ps(_mm_set1_ps(db), _mm_loadu_ps(xs + (size_t)m * ng + 4 * h)));
            __m256i d0 = q6x8_dot(p0, q0, s0, xl + o, x32 + o / 4, K, W);
            __m256i d1 = q6x8_dot(p1, q1, s1, xl + o + 32, x32 + o / 4 + 16, K, W);
            acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_permutevar8x32_ps(f4, fpick0), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_permutevar8x32_ps(f4, fpick1), acc[m][1]);
        }
#endif
    }
#ifdef KVCHAT_AVX512
    for (int m = 0; m < R; m++) out[m] = hsum8(_mm256_add_ps(low8(acc[m]), high8(acc[m])));
#else
    for (int m = 0; m < R; m++) out[m] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
#endif
}

// M rows against one weight row, four at a time (W: q6x8_rows')
static inline __attribute__((always_inline)) void q6x8_rowsM(const uint8_t *ql, const uint8_t *qh,
        const int8_t *sc, const half_t *d, const int8_t *xl, const int16_t *x32, const int32_t *x32s,
        const float *xs, int ng, int K, int M, const int W, float *out) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int8_t *xm = xl + (size_t)m0 * K * (W / 8);
        const int16_t *x32m = x32 + (size_t)m0 * (K / 4) * (W / 8);
        const int32_t *x32sm = x32s ? x32s + (size_t)m0 * (K / 8) : NULL;
        const float *xsm = xs + (size_t)m0 * ng;
        switch (M - m0) {   // a constant R per case: the accumulators stay in registers
            case 1: q6x8_rows(ql, qh, sc, d, xm, x32m, x32sm, xsm, ng, K, 1, W, out + m0); break;
            case 2: q6x8_rows(ql, qh, sc, d, xm, x32m, x32sm, xsm, ng, K, 2, W, out + m0); break;
            case 3: q6x8_rows(ql, qh, sc, d, xm, x32m, x32sm, xsm, ng, K, 3, W, out + m0); break;
            default: q6x8_rows(ql, qh, sc, d, xm, x32m, x32sm, xsm, ng, K, 4, W, out + m0); break;
        }
    }
}
#endif

// y [M, ldy] (+ resid) = prep(x) times the Q6_K matrix with int8 activations; scratch as q6k_gemv_ld's: the laid-out
// rows and x32 (1.5 M K bytes) after quantize_x8's, within q4_gemv's 7 M K. K % 256 == 0.
static void q6k_gemv8(const float *x, int M, int K, const uint8_t *ql, const uint8_t *qh, const int8_t *sc,
                      const half_t *d, int N, float *y, int ldy, void *scratch, int mode, const float *norm_w,
                      float eps, const float *resid) {
    int ng = K / 32;
    int8_t *xq;
    float *xs, *sums;
    activations8(x, M, K, mode, norm_w, eps, scratch, &xq, &xs, &sums);
#ifdef __AVX2__
    int8_t *xl = (int8_t *)(sums + (size_t)M * ng);
    int16_t *x32 = (int16_t *)(xl + (size_t)M * K);
    q6x8_layout(xq, M, K, xl, x32);
#endif
    SHARED_STEPS(N, SHARE_ROWS, n) {
        const uint8_t *l = ql + (size_t)n * (K / 2), *h = qh + (size_t)n * (K / 4);
        const int8_t *s = sc + (size_t)n * (K / 16);
        const half_t *dn = d + (size_t)n * (K / 256);
        float out[MAXM];
#ifdef __AVX2__
        q6x8_rowsM(l, h, s, dn, xl, x32, NULL, xs, ng, K, M, 8, out);
#else
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int g = 0; g < ng; g++) {
            float f = f16_to_f32(dn[g / 8]);
            for (int m = 0; m < M; m++) {
                const int8_t *v = xq + (size_t)m * K + g * 32;
                int dot = 0;            // at most 32 * 4096 * 127: int32 holds it
                for (int j = 0; j < 32; j++) dot += (q6k_code(l, h, g * 32 + j) - 32) * s[2 * g + j / 16] * v[j];
                out[m] += f * xs[(size_t)m * ng + g] * (float)dot;
            }
        }
#endif
        for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
    }
}
