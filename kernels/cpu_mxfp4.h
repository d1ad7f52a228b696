// GGUF MXFP4 weights (GGML type 39, gpt-oss's experts) at their own 4.25 bits a value: matvecs for decode rows and
// dequantization for prefill. Included by cpu_quant.c after the activation quantizers (int16: activations; int8:
// cpu_act8.h) and store_bf16.
//
// A block of 32 values is 17 bytes: an E8M0 exponent e, then 16 bytes of 4-bit codes, byte j holding value j in
// its low nibble and value j + 16 in its high one (the q4 kernels' order). The value of code c is
// MXFP4_KV[c] * 2^(e - 128): MXFP4_KV holds the E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives,
// code 8 a second zero), and 2^(e - 128) is gguf's e8m0_to_fp32_half (a subnormal float for e < 2). The loader
// (engine/gguf/blocks.py: mxfp4_blocks) splits the blocks into codes [N, K/2] and e8m0 [N, K/32], bytes unchanged.
//
// Dequantization is gguf's bit for bit: the one float product 2^(e - 128) * value (exact, but for e >= 253, where
// gguf's overflows to infinity as well). The values fit int8, so a byte shuffle (pshufb) looks 16 codes up at
// once in a 16-byte table. The matvecs multiply those values, widened to 16 bits, with the int16 activations
// (|a group's sum| <= 32 * 12 * 32767 < 2^31), or with int8 activations |value| against x with the value's sign
// (u8 x s8 pairs, at most 2 * 12 * 127); then one float multiply-add per group of 32 and row, by
// 2^(e - 128) * xs. Each row of x is computed with the same operations in the same order whatever the number of
// rows in the call and whatever the SIMD variant (AVX-512 lanes 0-7 / 8-15 are AVX2's even / odd group chains;
// the int8 path is one 256-bit loop in both), as the q4 and q8 matvecs are; the baseline build sums in plain loops,
// in another order.
#pragma once

static const int8_t MXFP4_KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) as gguf's e8m0_to_fp32_half builds it: the float's bits, a subnormal for e < 2
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// f [M, ng] = 2^(e[g] - 128) * xs[m][g] for one weight row's exponents e [ng] (e8m0_half's bits eight at a time: a
// share of every decode row's time in the scalar loop)
static inline void mxfp4_row_scales(const uint8_t *e, const float *xs, int M, int ng, float *f) {
    float d[MAXG];
    int g = 0;
#ifdef __AVX2__
    const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2), sub = _mm256_set1_epi32(0x00200000);
    for (; g + 8 <= ng; g += 8) {
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + g)));
        __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, one), 23);
        __m256i tiny = _mm256_sllv_epi32(sub, _mm256_min_epu32(v, one));         // e 0 or 1: 2^-128 or 2^-127
        _mm256_storeu_si256((__m256i *)(d + g), _mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(two, v)));
    }
#endif
    for (; g < ng; g++) d[g] = e8m0_half(e[g]);
    for (int m = 0; m < M; m++)
        for (g = 0; g < ng; g++) f[m * ng + g] = d[g] * xs[m * ng + g];
}

#ifdef __AVX2__
// one group's 16 code bytes -> its values as int8: lo values 0-15, hi values 16-31
static inline void mxfp4_values16(const uint8_t *b, __m128i *lo, __m128i *hi) {
    const __m128i t = _mm_loadu_si128((const __m128i *)MXFP4_KV), m = _mm_set1_epi8(0x0F);
    __m128i x = _mm_loadu_si128((const __m128i *)b);
    *lo = _mm_shuffle_epi8(t, _mm_and_si128(x, m));
    *hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(x, 4), m));
}

// groups g and g + 1 (32 code bytes): lo = [g's values 0-15 | g + 1's values 0-15], hi = their values 16-31. The
// 16-bit shift carries bits across bytes only into the positions the mask clears.
static inline void mxfp4_values32(const uint8_t *b, __m256i *lo, __m256i *hi) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_KV));
    const __m256i m = _mm256_set1_epi8(0x0F);
    __m256i x = _mm256_loadu_si256((const __m256i *)b);
    *lo = _mm256_shuffle_epi8(t, _mm256_and_si256(x, m));
    *hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(x, 4), m));
}

// a group's 32 products with int16 activations v, in pairs: 8 int32 (lo, hi: its values widened to 16 bits)
static inline __m256i mxfp4_dot16(__m256i lo, __m256i hi, const int16_t *v) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)v)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(v + 16))));
}

// the last group of a row with an odd number of groups, into chain a0 (even groups), for R rows
static inline __attribute__((always_inline)) void mxfp4_tail16(const uint8_t *b, const float *f, const int16_t *xq,
        int ng, int K, const int R, __m256 *a0) {
    __m128i lo, hi;
    mxfp4_values16(b, &lo, &hi);
    __m256i wl = _mm256_cvtepi8_epi16(lo), wh = _mm256_cvtepi8_epi16(hi);
    for (int m = 0; m < R; m++)
        a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mxfp4_dot16(wl, wh, xq + (size_t)m * K)),
                                _mm256_broadcast_ss(f + m * ng), a0[m]);
}

// R rows (a constant: the accumulators stay in registers) of int16 activations against one weight row: group g
// into chain a0 (even g) or a1 (odd g); the values looked up once for the R rows
static inline __attribute__((always_inline)) void mxfp4_rows(const uint8_t *row, const float *f, const int16_t *xq,
        int ng, int K, const int R, float *out) {
    __m256 a0[4], a1[4];
    for (int m = 0; m < R; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 2 <= ng; g += 2) {
        if (!(g & 3)) _mm_prefetch((const char *)(row + g * 16 + PREFETCH), _MM_HINT_T0);
        if (!(g & 3)) FAR_PREFETCH(row + g * 16);
        __m256i lo, hi;
        mxfp4_values32(row + g * 16, &lo, &hi);
        __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi));
        __m256i w2 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1));
        __m256i w3 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1));
        for (int m = 0; m < R; m++) {
            const int16_t *v = xq + (size_t)m * K + g * 32;
            a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mxfp4_dot16(w0, w1, v)), _mm256_broadcast_ss(f + m * ng + g),
                                    a0[m]);
            a1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mxfp4_dot16(w2, w3, v + 32)),
                                    _mm256_broadcast_ss(f + m * ng + g + 1), a1[m]);
        }
    }
    if (g < ng) mxfp4_tail16(row + g * 16, f + g, xq + g * 32, ng, K, R, a0);
    for (int m = 0; m < R; m++) out[m] = hsum8(_mm256_add_ps(a0[m], a1[m]));
}

#ifdef KVCHAT_AVX512
// The same, two groups a register: int16 lanes 0-15 values 0-15 of group g, lanes 16-31 those of group g + 1 (the
// next register their values 16-31), against the activations in q4_pair_layout: every int32 lane sums the
// same products as AVX2's, float lanes 0-7 are its chain a0 and 8-15 its a1.
static inline __attribute__((always_inline)) void mxfp4_rows_512(const uint8_t *row, const float *f,
        const int16_t *xq, int ng, int K, const int R, float *out) {
    __m512 acc[8];
    for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
    int g = 0;
    for (; g + 2 <= ng; g += 2) {
        if (!(g & 3)) _mm_prefetch((const char *)(row + g * 16 + PREFETCH), _MM_HINT_T0);
        if (!(g & 3)) FAR_PREFETCH(row + g * 16);
        __m256i lo, hi;
        mxfp4_values32(row + g * 16, &lo, &hi);
        __m512i wl = _mm512_cvtepi8_epi16(lo), wh = _mm512_cvtepi8_epi16(hi);
        for (int m = 0; m < R; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_pair_dot(wl, wh, xq + (size_t)m * K + g * 32)),
                                     pair_scale(f + m * ng + g), acc[m]);
    }
    __m256 a0[8], a1[8];
    for (int m = 0; m < R; m++) a0[m] = low8(acc[m]), a1[m] = high8(acc[m]);
    if (g < ng) mxfp4_tail16(row + g * 16, f + g, xq + g * 32, ng, K, R, a0);
    for (int m = 0; m < R; m++) out[m] = hsum8(_mm256_add_ps(a0[m], a1[m]));
}
#endif

// int8 activations: R rows against one weight row, chains as mxfp4_rows; |value| (u8) against x with the value's
// sign (s8), so a group is one dot_u8s8 (VNNI in the AVX-512 build, maddubs + madd in AVX2's: the same integers)
static inline __attribute__((always_inline)) void mxfp4_rows8(const uint8_t *row, const float *f, const int8_t *xq,
        int ng, int K, const int R, float *out) {
    __m256 a0[4], a1[4];
    for (int m = 0; m < R; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 2 <= ng; g += 2) {
        if (!(g & 3)) _mm_prefetch((const char *)(row + g * 16 + PREFETCH), _MM_HINT_T0);
        if (!(g & 3)) FAR_PREFETCH(row + g * 16);
        __m256i lo, hi;
        mxfp4_values32(row + g * 16, &lo, &hi);
        __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20), w1 = _mm256_permute2x128_si256(lo, hi, 0x31);  // in order
        __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
        for (int m = 0; m < R; m++) {
            const int8_t *v = xq + (size_t)m * K + g * 32;
            __m256i p0 = dot_u8s8(u0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)v), w0));
            __m256i p1 = dot_u8s8(u1, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(v + 32)), w1));
            a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcast_ss(f + m * ng + g), a0[m]);
            a1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcast_ss(f + m * ng + g + 1), a1[m]);
        }
    }
    if (g < ng) {
        __m128i lo, hi;
        mxfp4_values16(row + g * 16, &lo, &hi);
        __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1), u = _mm256_abs_epi8(w);
        for (int m = 0; m < R; m++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (size_t)m * K + g * 32));
            a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, _mm256_sign_epi8(x, w))),
                                    _mm256_broadcast_ss(f + m * ng + g), a0[m]);
        }
    }
    for (int m = 0; m < R; m++) out[m] = hsum8(_mm256_add_ps(a0[m], a1[m]));
}
#endif

#if !defined(__AVX2__)
// The builds without AVX2: a group's 32 values as int16 in order, and their dot products with int16 or int8
// activations, exact integers (so the same as plain loops, bit for bit), on SSE2 where the build has it (every
// x86-64 CPU does). SSE2 has no byte shuffle: a value is computed from its code c, magnitude
// m + max(m - 4, 0) + 2 max(m - 6, 0) of m = c & 7 (0, 1, 2, 3, 4, 6, 8, 12), negated where c & 8.
#ifdef __SSE2__
static inline __m128i mxfp4_decode8(__m128i c) {
    const __m128i z = _mm_setzero_si128();
    __m128i m = _mm_and_si128(c, _mm_set1_epi16(7));
    __m128i a = _mm_max_epi16(_mm_sub_epi16(m, _mm_set1_epi16(4)), z);
    __m128i b = _mm_max_epi16(_mm_sub_epi16(m, _mm_set1_epi16(6)), z);
    __m128i mag = _mm_add_epi16(_mm_add_epi16(m, a), _mm_add_epi16(b, b));
    __m128i s = _mm_sub_epi16(z, _mm_srli_epi16(c, 3));           // -1 where c & 8 (c < 16)
    return _mm_sub_epi16(_mm_xor_si128(mag, s), s);
}
#endif

static inline void mxfp4_group16(const uint8_t *b, int16_t *w) {
#ifdef __SSE2__
    __m128i x = _mm_loadu_si128((const __m128i *)b), z = _mm_setzero_si128(), m = _mm_set1_epi16(0x0F);
    __m128i lo = _mm_unpacklo_epi8(x, z), hi = _mm_unpackhi_epi8(x, z);     // bytes 0-7 and 8-15, 16 bits each
    _mm_storeu_si128((__m128i *)w, mxfp4_decode8(_mm_and_si128(lo, m)));
    _mm_storeu_si128((__m128i *)(w + 8), mxfp4_decode8(_mm_and_si128(hi, m)));
    _mm_storeu_si128((__m128i *)(w + 16), mxfp4_decode8(_mm_srli_epi16(lo, 4)));
    _mm_storeu_si128((__m128i *)(w + 24), mxfp4_decode8(_mm_srli_epi16(hi, 4)));
#else
    for (int j = 0; j < 16; j++) {
        w[j] = MXFP4_KV[b[j] & 15];
        w[j + 16] = MXFP4_KV[b[j] >> 4];
    }
#endif
}

static inline int mxfp4_dot_x16(const int16_t *w, const int16_t *v) {
#ifdef __SSE2__
    __m128i s = _mm_setzero_si128();
    for (int j = 0; j < 32; j += 8)
        s = _mm_add_epi32(s, _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(w + j)),
                                            _mm_loadu_si128((const __m128i *)(v + j))));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
#else
    int d = 0;
    for (int j = 0; j < 32; j++) d += w[j] * v[j];
    return d;
#endif
}

static inline int mxfp4_dot_x8(const int16_t *w, const int8_t *v) {
#ifdef __SSE2__
    __m128i s = _mm_setzero_si128(), z = _mm_setzero_si128();
    for (int j = 0; j < 32; j += 16) {
        __m128i c = _mm_loadu_si128((const __m128i *)(v + j)), sign = _mm_cmpgt_epi8(z, c);
        s = _mm_add_epi32(s, _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(w + j)), _mm_unpacklo_epi8(c, sign)));
        s = _mm_add_epi32(s, _mm_madd_epi16(_mm_loadu_si128((const __m128i *)(w + j + 8)), _mm_unpackhi_epi8(c, sign)));
    }
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
#else
    int d = 0;
    for (int j = 0; j < 32; j++) d += w[j] * v[j];
    return d;
#endif
}
#endif

// y [M, ldy] (+ resid [M, N]) = prep(x) [M, K] times the MXFP4 matrix [N, K]^T with int8 activations
// (EngineConfig(activations="int8"), cpu_act8.h's quantize_x8); the rest as mxfp4_gemv_ld
static void mxfp4_gemv8(const float *x, int M, int K, const uint8_t *codes, const uint8_t *e8m0, int N, float *y,
                        int ldy, void *scratch, int mode, const float *norm_w, float eps, const float *resid) {
    int ng = K / 32;
    int8_t *xq;
    float *xs, *sums;
    activations8(x, M, K, mode, norm_w, eps, scratch, &xq, &xs, &sums);
    SHARED_STEPS(N, SHARE_ROWS, n) {
        const uint8_t *row = codes + (size_t)n * (K / 2);
        float f[MAXM * MAXG], out[MAXM];
        mxfp4_row_scales(e8m0 + (size_t)n * ng, xs, M, ng, f);
#ifdef __AVX2__
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int8_t *xm = xq + (size_t)m0 * K;
            const float *fm = f + (size_t)m0 * ng;
            switch (M - m0 < 4 ? M - m0 : 4) {
                case 1: mxfp4_rows8(row, fm, xm, ng, K, 1, out + m0); break;
                case 2: mxfp4_rows8(row, fm, xm, ng, K, 2, out + m0); break;
                case 3: mxfp4_rows8(row, fm, xm, ng, K, 3, out + m0); break;
                default: mxfp4_rows8(row, fm, xm, ng, K, 4, out + m0); break;
            }
        }
#else
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int g = 0; g < ng; g++) {
            int16_t w[32];
            mxfp4_group16(row + g * 16, w);
            for (int m = 0; m < M; m++)
                out[m] += f[m * ng + g] * (float)mxfp4_dot_x8(w, xq + (size_t)m * K + g * 32);
        }
#endif
        for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
    }
}

// y [M, ldy] (ldy >= N: one part of a concatenated output; + resid [M, N]) = prep(x) [M, K] times the MXFP4 matrix
// [N, K]^T: codes [N, K/2], e8m0 [N, K/32]. mode: the prep (RMSNorm, SwiGLU), with ACT8 for int8 activations;
// scratch as for q4_gemv.
static void mxfp4_gemv_ld(const float *x, int M, int K, const uint8_t *codes, const uint8_t *e8m0, int N, float *y,
                          int ldy, void *scratch, int mode, const float *norm_w, float eps, const float *resid) {
    if (mode & ACT8) {
        mxfp4_gemv8(x, M, K, codes, e8m0, N, y, ldy, scratch, mode & ~ACT8, norm_w, eps, resid);
        return;
    }
    int ng = K / 32;
    int16_t *xq;
    float *xs, *sums;
    activations(x, M, K, mode, norm_w, eps, scratch, &xq, &xs, &sums);
#ifdef KVCHAT_AVX512
    const int16_t *xp = q4_pair_layout(xq, M, K, mode, scratch, sums);       // q4_pair_dot reads pairs
#endif
    SHARED_STEPS(N, SHARE_ROWS, n) {
        const uint8_t *row = codes + (size_t)n * (K / 2);
        float f[MAXM * MAXG], out[MAXM];
        mxfp4_row_scales(e8m0 + (size_t)n * ng, xs, M, ng, f);
#ifdef KVCHAT_AVX512
        switch (M) {        // a constant R per case: the accumulators stay in registers
            case 1: mxfp4_rows_512(row, f, xp, ng, K, 1, out); break;
            case 2: mxfp4_rows_512(row, f, xp, ng, K, 2, out); break;
            case 3: mxfp4_rows_512(row, f, xp, ng, K, 3, out); break;
            case 4: mxfp4_rows_512(row, f, xp, ng, K, 4, out); break;
            case 5: mxfp4_rows_512(row, f, xp, ng, K, 5, out); break;
            case 6: mxfp4_rows_512(row, f, xp, ng, K, 6, out); break;
            case 7: mxfp4_rows_512(row, f, xp, ng, K, 7, out); break;
            default: mxfp4_rows_512(row, f, xp, ng, K, 8, out); break;
        }
#elif defined(__AVX2__)
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int16_t *xm = xq + (size_t)m0 * K;
            const float *fm = f + (size_t)m0 * ng;
            switch (M - m0 < 4 ? M - m0 : 4) {
                case 1: mxfp4_rows(row, fm, xm, ng, K, 1, out + m0); break;
                case 2: mxfp4_rows(row, fm, xm, ng, K, 2, out + m0); break;
                case 3: mxfp4_rows(row, fm, xm, ng, K, 3, out + m0); break;
                default: mxfp4_rows(row, fm, xm, ng, K, 4, out + m0); break;
            }
        }
#else
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int g = 0; g < ng; g++) {
            int16_t w[32];
            mxfp4_group16(row + g * 16, w);
            for (int m = 0; m < M; m++)
                out[m] += f[m * ng + g] * (float)mxfp4_dot_x16(w, xq + (size_t)m * K + g * 32);
        }
#endif
        for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
    }
}

void mxfp4_gemv(const float *x, int M, int K, const uint8_t *codes, const uint8_t *e8m0, int N, float *y,
                void *scratch, int mode, const float *norm_w, float eps, const float *resid) {
    mxfp4_gemv_ld(x, M, K, codes, e8m0, N, y, N, scratch, mode, norm_w, eps, resid);
}

// Rows as float32 (out) or bf16 (out16: each value as torch's .bfloat16() of the float32 one), a group a step
static void mxfp4_dequant_to(const uint8_t *codes, const uint8_t *e8m0, int N, int K, float *out, uint16_t *out16) {
    int ng = K / 32;
    #pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++)
        for (int g = 0; g < ng; g++) {
            const uint8_t *b = codes + (size_t)n * (K / 2) + g * 16;
            float d = e8m0_half(e8m0[(size_t)n * ng + g]), tmp[32];
            float *o = out16 ? tmp : out + (size_t)n * K + g * 32;
#ifdef __AVX2__
            __m128i lo, hi;
            mxfp4_values16(b, &lo, &hi);
            __m256 dv = _mm256_set1_ps(d);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};    // values 0-7, 8-15, ...
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i]))));
#else
            int16_t w[32];
            mxfp4_group16(b, w);
            for (int j = 0; j < 32; j++) o[j] = d * (float)w[j];
#endif
            if (out16) store_bf16(tmp, out16 + (size_t)n * K + g * 32, 32);
        }
}

void mxfp4_dequant(const uint8_t *codes, const uint8_t *e8m0, int N, int K, float *out) {
    mxfp4_dequant_to(codes, e8m0, N, K, out, NULL);
}

void mxfp4_dequant_bf16(const uint8_t *codes, const uint8_t *e8m0, int N, int K, uint16_t *out) {
    mxfp4_dequant_to(codes, e8m0, N, K, NULL, out);
}
