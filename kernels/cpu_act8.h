// The opt-in int8-activation matvecs (EngineConfig(activations="int8")), included by cpu_quant.c.
//
// The activations are rounded to int8 per group of 32 (s = max|x| / 127, as llama.cpp's Q8_0 does) instead of
// int16, so a group's 32 products are one u8 x s8 dot product (VNNI's vpdpbusd, or AVX2's maddubs + madd: the same
// integers). The float sums run in four chains (group g into chain g mod 4, joined as (c0 + c2) + (c1 + c3)), two
// more than the int16 path, because a single row is bound by its chain of multiply-adds. Every SIMD variant gives
// the same bits: AVX-512 does two groups per register, lanes 0-7 and 8-15 being the chains AVX2 keeps in two
// registers. The baseline build sums in plain loops, in another order.
#pragma once

#define ACT8 8          // the bit of `mode` that asks a gemv for int8 activations
#ifdef KVCHAT_AVX512
#define ROWS8 4         // 2 of 32 registers per row
#else
#define ROWS8 2         // 4 of 16 per row
#endif

// x [M, K] -> xq [M, K] int8, with xs [M, K / 32] the scales and sums [M, K / 32] = xs * (sum of the group's xq)
static void quantize_x8(const float *x, int M, int K, int8_t *xq, float *xs, float *sums) {
    int ng = K / 32;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < ng; g++) {
            const float *v = x + (size_t)m * K + g * 32;
            int8_t *o = xq + (size_t)m * K + g * 32;
#ifdef __AVX2__
            __m256 q[4];
            float vmax = load_group(v, q);
            __m256 v0 = q[0], v1 = q[1], v2 = q[2], v3 = q[3];
            if (vmax == vmax) {        // no NaN: the scalar loop below, eight lanes at a time
                __m256 iv = _mm256_set1_ps(vmax > 0 ? 127.f / vmax : 0.f);
                __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv)),
                        i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
                __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
                // the packs interleave 4-byte pieces across the 128-bit lanes: put them back in element order
                __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
                _mm256_storeu_si256((__m256i *)o, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
                xs[m * ng + g] = vmax / 127.f;
                sums[m * ng + g] = (vmax / 127.f) * (float)hsum_epi32(sum);
                continue;
            }
#endif
            float amax = absmax32(v);
            float inv = amax > 0 ? 127.f / amax : 0.f;
            int isum = 0;
            for (int j = 0; j < 32; j++) {
                o[j] = (int8_t)__builtin_lrintf(v[j] * inv);
                isum += o[j];
            }
            xs[m * ng + g] = amax / 127.f;
            sums[m * ng + g] = (amax / 127.f) * (float)isum;
        }
}

#ifdef __AVX2__
// 32 unsigned bytes against 32 signed ones -> 8 int32 sums of 4 products each (exact either way)
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));    // pairs: at most 3810 / 32512
#endif
}

// a q4 group's 32 codes as bytes in element order (low nibbles are elements 0-15, high ones 16-31)
static inline __m256i q4_bytes(const uint8_t *b) {
    __m128i x = _mm_loadu_si128((const __m128i *)b), m = _mm_set1_epi8(15);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(x, m)),
                                   _mm_and_si128(_mm_srli_epi16(x, 4), m), 1);
}

// 32 fifth bits (q5_bits) as 16 or 0 in 32 bytes, element order
static inline __m256i q5_high8(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, sel), _mm256_set1_epi8(16));
}

// group g's dot product: q4 codes (bits 4; with high, q5's 5-bit ones) or int8 codes (bits 8: |w| against x with
// w's sign, llama.cpp's way)
static inline __m256i dot8(const void *row, const uint8_t *high, int bits, int g, const int8_t *v) {
    __m256i x = _mm256_loadu_si256((const __m256i *)v);
    if (bits == 4 && high)         // codes up to 31: pairs at most 7874, within maddubs' int16
        return dot_u8s8(_mm256_or_si256(q4_bytes((const uint8_t *)row + g * 16), q5_high8(q5_bits(high, g))), x);
    if (bits == 4) return dot_u8s8(q4_bytes((const uint8_t *)row + g * 16), x);
    __m256i w = _mm256_loadu_si256((const __m256i *)((const int8_t *)row + g * 32));
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

#ifdef KVCHAT_AVX512
// groups g and g + 1 at once: lanes 0-7 are dot8 of g, 8-15 of g + 1
static inline __m512i dot8_pair(const void *row, const uint8_t *high, int bits, int g, const int8_t *v) {
    __m512i x = _mm512_loadu_si512((const void *)v);
    if (bits == 4) {
        __m256i b = _mm256_loadu_si256((const __m256i *)((const uint8_t *)row + g * 16)), m = _mm256_set1_epi8(15);
        __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, m)),
                                       _mm256_and_si256(_mm256_srli_epi16(b, 4), m), 1);
        // [g low | g+1 low | g high | g+1 high] -> [g low | g high | g+1 low | g+1 high]
        z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
        if (high)       // q5: bit 4 of the 64 codes, now in element order
            z = _mm512_mask_add_epi8(z, (__mmask64)q5_bits(high, g) | (__mmask64)q5_bits(high, g + 1) << 32, z,
                                     _mm512_set1_epi8(16));
        return _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, x);
    }
    __m512i w = _mm512_loadu_si512((const void *)((const int8_t *)row + g * 32));
    __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);    // x with w's sign
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), sx);
}
#endif

// R rows (a constant) of int8 activations against one weight row of ng groups of 32; f [R, ng] = sc[g] * xs[m][g]
static inline __attribute__((always_inline)) void rows8(const void *row, const uint8_t *high, int bits,
        const float *f, const float *zr, const int8_t *xq, const float *sums, int ng, int K, const int R, float *out) {
    __m256 c[4][4];
    int g = 0;
#ifdef KVCHAT_AVX512
    __m512 c01[4], c23[4];
    for (int m = 0; m < R; m++) c01[m] = c23[m] = _mm512_setzero_ps();
    for (; g + 4 <= ng; g += 4) {
        _mm_prefetch((const char *)row + (size_t)g * bits * 4 + PREFETCH, _MM_HINT_T0);
        FAR_PREFETCH((const char *)row + (size_t)g * bits * 4);
        for (int m = 0; m < R; m++) {
            const int8_t *v = xq + (size_t)m * K + g * 32;
            c01[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot8_pair(row, high, bits, g, v)), pair_scale(f + m * ng + g), c01[m]);
            c23[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot8_pair(row, high, bits, g + 2, v + 64)),
                                     pair_scale(f + m * ng + g + 2), c23[m]);
        }
    }
    for (int m = 0; m < R; m++)
        c[m][0] = low8(c01[m]), c[m][1] = high8(c01[m]), c[m][2] = low8(c23[m]), c[m][3] = high8(c23[m]);
#else
    for (int m = 0; m < R; m++) c[m][0] = c[m][1] = c[m][2] = c[m][3] = _mm256_setzero_ps();
    for (; g + 4 <= ng; g += 4) {
        _mm_prefetch((const char *)row + (size_t)g * bits * 4 + PREFETCH, _MM_HINT_T0);
        FAR_PREFETCH((const char *)row + (size_t)g * bits * 4);
        for (int j = 0; j < 4; j++)
            for (int m = 0; m < R; m++)
                c[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot8(row, high, bits, g + j, xq + (size_t)m * K + (g + j) * 32)),
                                          _mm256_broadcast_ss(f + m * ng + g + j), c[m][j]);
    }
#endif
    for (; g < ng; g++)         // the last groups, each to its chain
        for (int m = 0; m < R; m++)
            c[m][g & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot8(row, high, bits, g, xq + (size_t)m * K + g * 32)),
                                          _mm256_broadcast_ss(f + m * ng + g), c[m][g & 3]);
    for (int m = 0; m < R; m++) {
        float tail;
        __m256 z = zero_terms(zr, sums + (size_t)m * ng, ng, &tail);
        __m256 s = _mm256_add_ps(_mm256_add_ps(c[m][0], c[m][2]), _mm256_add_ps(c[m][1], c[m][3]));
        out[m] = hsum8(_mm256_add_ps(s, z)) + tail;
    }
}
#endif

// y [M, ldy] = x' W^T for one packed weight (bits 4, or bits 8 in groups of 32) with int8 activations; the rest
// as q4_gemv_ld. mode: the prep (RMSNorm, SwiGLU) without the ACT8 bit.
static void gemv8(const float *x, int M, int K, const void *codes, int bits, const void *scale, const void *zero,
                  int N, float *y, int ldy, void *scratch, int mode, const float *norm_w, float eps,
                  const float *resid, int kind, const float *ssup, const float *zsup, int per, const uint8_t *high) {
    int ng = K / 32;
    float *buf = (float *)scratch;
    const float *xp = prep(x, M, K, mode, norm_w, eps, buf);
    int8_t *xq = (int8_t *)(mode ? buf + (size_t)M * K : buf);
    float *xs = (float *)(xq + (size_t)M * K), *sums = xs + (size_t)M * ng;
    quantize_x8(xp, M, K, xq, xs, sums);
    size_t row_bytes = (size_t)K * bits / 8;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = (const uint8_t *)codes + (size_t)n * row_bytes;
        const uint8_t *hrow = high ? high + (size_t)n * (K / 8) : NULL;
        float sbuf[MAXG], zbuf[MAXG], out[MAXM];
        const float *sc = row_f32(scale, ssup, per, n, ng, kind, sbuf);
        const float *zr = bits == 4 ? row_zero(zero, zsup, per, n, ng, kind, sc, zbuf, high)
                                    : row_f32(zero, zsup, per, n, ng, kind, zbuf);
#ifdef __AVX2__
        float f[4 * MAXG];
        for (int m0 = 0; m0 < M; m0 += ROWS8) {   // rows a pass: as many as their chains' registers allow
            int R = M - m0 < ROWS8 ? M - m0 : ROWS8;
            scale_products(sc, xs + (size_t)m0 * ng, ng, R, f);
            const int8_t *xm = xq + (size_t)m0 * K;
            const float *sm = sums + (size_t)m0 * ng;
            switch (R) {
                case 1: rows8(row, hrow, bits, f, zr, xm, sm, ng, K, 1, out + m0); break;
                case 2: rows8(row, hrow, bits, f, zr, xm, sm, ng, K, 2, out + m0); break;
                case 3: rows8(row, hrow, bits, f, zr, xm, sm, ng, K, 3, out + m0); break;
                default: rows8(row, hrow, bits, f, zr, xm, sm, ng, K, 4, out + m0); break;
            }
        }
#else
        for (int m = 0; m < M; m++) {
            const int8_t *v = xq + (size_t)m * K;
            float acc = 0.f, z = 0.f;
            for (int g = 0; g < ng; g++) {
                int d = 0;
                for (int j = 0; j < 32; j++) {
                    int w = bits == 4 ? (j < 16 ? row[g * 16 + j] & 15 : row[g * 16 + j - 16] >> 4)
                                      : (int)((const int8_t *)row)[g * 32 + j];
                    if (hrow) w |= (int)(q5_bits(hrow, g) >> j & 1) << 4;
                    d += w * v[g * 32 + j];
                }
                acc += sc[g] * xs[(size_t)m * ng + g] * (float)d;
                if (zr) z += zr[g] * sums[(size_t)m * ng + g];
            }
            out[m] = acc + z;
        }
#endif
        for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
    }
}
