// Prompt rows against packed 4-, 5-, 6- (Q6_K, at the end) and 8-bit weights with int8 activations
// (EngineConfig(prefill="int8")), included by cpu_quant.c in the AVX-512 VNNI and AVX2 builds.
//
// A prompt's rows are many, so the weights are read once a call, not once a row: sixteen weight rows at a time
// (eight on AVX2) are laid out with one row per 32-bit lane (group g, element 4c..4c+3 of each row in one register),
// and every prompt row's four int8 activations broadcast against them (VNNI's vpdpbusd: unsigned codes times signed
// activations, 64 products an instruction; AVX2's maddubs: pairs of products into int16, summed in int16 as far as
// they cannot overflow, then widened). The activations are rounded per group of 32 as llama.cpp's Q8_0 rounds
// them (quantize_x8), the per-group float work is one multiply-add of the scales and one of the zeros for sixteen
// outputs, and each output's sums run over the groups in order: a row's result depends only on the row, never on
// how many rows share the call (a prompt read whole or after a restored prefix gives the same bits). The integer sums
// are exact and the float steps the same lane by lane, so AVX2 gives AVX-512's bits for 4- and 5-bit codes; 8-bit
// codes stay signed on AVX2 (maddubs would overflow on unsigned ones), their zeros summed in another order.
#pragma once

#ifdef KVCHAT_AVX512
#define GB 16           // weight rows a block: one a lane
#define GR 8            // prompt rows a tile: their sums stay in registers
#else
#define GB 8
#define GR 4            // 16 registers: four sums, four int16 sums, the codes, one activation, the constants
#endif

// 16 bits -> 16 bytes, 16 where the bit is set (q5's fifth bits)
static inline __m128i bits_to16(uint32_t h) {
    __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)h), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, bit), bit), _mm_set1_epi8(16));
}

// The GB rows' 32 code bytes of a group (v[r], a row each) -> w [8][GB]: step c's four bytes of every row, a row a
// lane (two 8 x 8 transposes of 32-bit words: a word at a time, the layout took a fifth of the rows' samples on Zen 4,
// a twelfth so)
static inline void gemm8_transpose(const __m256i *v, uint32_t *w) {
#ifdef KVCHAT_AVX512
    __m512i a[8], t[8], u[8];
    for (int r = 0; r < 8; r++) a[r] = _mm512_inserti64x4(_mm512_castsi256_si512(v[r]), v[r + 8], 1);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // u[j], j < 4: rows 0-3's words j and j + 4 (128-bit lanes 0, 1), rows 8-11's (2, 3); u[j + 4]: rows 4-7, 12-15
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int j = 0; j < 4; j++) {
        _mm512_store_si512((__m512i *)(w + j * GB), _mm512_permutex2var_epi64(u[j], lo, u[j + 4]));
        _mm512_store_si512((__m512i *)(w + (j + 4) * GB), _mm512_permutex2var_epi64(u[j], hi, u[j + 4]));
    }
#else
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {       // u[j]: rows 0-3's words j, j + 4; u[j + 4]: rows 4-7's
        _mm256_store_si256((__m256i *)(w + j * GB), _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
        _mm256_store_si256((__m256i *)(w + (j + 4) * GB), _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
    }
#endif
}

// Row `row`'s 32 code bytes of group g as gemm8_tile reads them (unsigned; q8's signed on AVX2)
static inline __m256i gemm8_codes(const void *codes, int bits, const uint8_t *hrow, size_t row, int g, int K) {
    if (bits == 8) {
        __m256i w = _mm256_loadu_si256((const __m256i *)((const int8_t *)codes + row * K + g * 32));
#ifdef KVCHAT_AVX512
        w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
#endif
        return w;
    }
    __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)codes + row * (K / 2) + g * 16));
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    if (hrow) {
        uint32_t h = q5_bits(hrow, g);
        lo = _mm_or_si128(lo, bits_to16(h & 0xFFFF));
        hi = _mm_or_si128(hi, bits_to16(h >> 16));
    }
    return _mm256_set_m128i(hi, lo);
}

// Block n0.. (nr <= GB rows) laid out: wb [ng][8][GB] the codes as unsigned bytes (q8's int8 codes + 128), sb / zb
// [ng][GB] the scales and zeros (q8 on AVX-512: its zeros less 128 scales, the codes offset; rows past nr: zeros).
// Returns whether any zero is non-zero.
static int gemm8_block(const void *codes, int bits, const uint8_t *high, const void *scale, const void *zero,
                       int kind, const float *ssup, const float *zsup, int per, int n0, int nr, int K,
                       uint32_t *wb, float *sb, float *zb) {
    int ng = K / 32, any_zero = 0;
    for (int r = 0; r < GB; r++) {
        if (r >= nr) {
            for (int g = 0; g < ng; g++) sb[g * GB + r] = zb[g * GB + r] = 0.f;
            continue;
        }
        size_t row = (size_t)(n0 + r);
        float sbuf[MAXG], zbuf[MAXG];
        const uint8_t *hrow = high ? high + row * (K / 8) : NULL;
        const float *sc = row_f32(scale, ssup, per, row, ng, kind, sbuf);
        const float *zr = row_zero(zero, zsup, per, row, ng, kind, sc, zbuf, hrow);
        for (int g = 0; g < ng; g++) {
            float z = zr ? zr[g] : 0.f;
#ifdef KVCHAT_AVX512
            if (bits == 8) z -= 128.f * sc[g];
#endif
            sb[g * GB + r] = sc[g];
            zb[g * GB + r] = z;
            any_zero |= z != 0.f;
        }
    }
    for (int g = 0; g < ng; g++) {
        __m256i v[GB];
        for (int r = 0; r < GB; r++) {
            size_t row = (size_t)(n0 + r);
            v[r] = r < nr ? gemm8_codes(codes, bits, high ? high + row * (K / 8) : NULL, row, g, K)
                          : _mm256_setzero_si256();
        }
        gemm8_transpose(v, wb + (size_t)g * 8 * GB);
    }
    return any_zero;
}

#ifdef KVCHAT_AVX512
// R prompt rows (xq [R, K] int8, xs / sums [R, ng]) against a laid-out block -> y [R, ldy] at the block's columns
static inline __attribute__((always_inline)) void gemm8_tile(const uint32_t *wb, const float *sb, const float *zb,
        int zeros, int span, const int8_t *xq, const float *xs, const float *sums, int K, int ng, const int R, float *y,
        size_t ldy, int nr) {
    (void)span;             // VNNI sums in int32 from the start
    __m512 acc[GR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512i d[GR];
        for (int r = 0; r < R; r++) d[r] = _mm512_setzero_si512();
        const __m512i *w = (const __m512i *)(wb + (size_t)g * 8 * GB);
        for (int c = 0; c < 8; c++) {
            __m512i wc = _mm512_load_si512(w + c);
            for (int r = 0; r < R; r++)
                d[r] = _mm512_dpbusd_epi32(d[r], wc, _mm512_set1_epi32(*(const int32_t *)(xq + (size_t)r * K + g * 32 + 4 * c)));
        }
        __m512 s = _mm512_load_ps(sb + g * GB);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r]), _mm512_mul_ps(s, _mm512_set1_ps(xs[r * ng + g])), acc[r]);
        if (zeros) {
            __m512 z = _mm512_load_ps(zb + g * GB);
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[r * ng + g]), acc[r]);
        }
    }
    __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}
#else
// R prompt rows (xq [R, K] int8, xs / sums [R, ng]) against a laid-out block -> y [R, ldy] at the block's columns.
// span (a constant at each call): how many of a group's eight steps sum in int16 before widening (4-bit codes 8:
// sixteen products of at most 15 x 127; 5-bit 4); 0 for signed 8-bit codes (each step's pairs of |w| x
// sign-carrying x widened at once). The int16 sums are saturating adds that never saturate: the compiler keeps them
// in order in their registers (a plain add it reassociated into a tree of every step's products, spilled).
static inline __attribute__((always_inline)) void gemm8_tile(const uint32_t *wb, const float *sb, const float *zb,
        int zeros, const int span, const int8_t *xq, const float *xs, const float *sums, int K, int ng, const int R,
        float *y, size_t ldy, int nr) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[GR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256i d[GR];
        const __m256i *w = (const __m256i *)(wb + (size_t)g * 8 * GB);
        const int8_t *xg = xq + g * 32;
        for (int r = 0; r < R; r++) d[r] = _mm256_setzero_si256();
        if (span) {
            for (int c0 = 0; c0 < 8; c0 += span) {
                __m256i h[GR];
                for (int r = 0; r < R; r++) h[r] = _mm256_setzero_si256();
                for (int c = c0; c < c0 + span; c++) {
                    __m256i wc = _mm256_load_si256(w + c);
                    for (int r = 0; r < R; r++)
                        h[r] = _mm256_adds_epi16(h[r], _mm256_maddubs_epi16(wc,
                                   _mm256_set1_epi32(*(const int32_t *)(xg + (size_t)r * K + 4 * c))));
                }
                for (int r = 0; r < R; r++) d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(h[r], ones));
            }
        } else {
            for (int c = 0; c < 8; c++) {
                __m256i wc = _mm256_load_si256(w + c), aw = _mm256_abs_epi8(wc);
                for (int r = 0; r < R; r++) {
                    __m256i xr = _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(xg + (size_t)r * K + 4 * c)), wc);
                    d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xr), ones));
                }
            }
        }
        __m256 s = _mm256_load_ps(sb + g * GB);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), _mm256_mul_ps(s, _mm256_set1_ps(xs[r * ng + g])), acc[r]);
        if (zeros) {
            __m256 z = _mm256_load_ps(zb + g * GB);
            for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(z, _mm256_set1_ps(sums[r * ng + g]), acc[r]);
        }
    }
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; r++) _mm256_maskstore_ps(y + r * ldy, keep, acc[r]);
}
#endif

// Every prompt row of a call through TILE(R), t its first row: tiles of GR rows, then the rest with one constant R
// (each case its own copy: the sums stay in registers)
#if GR > 4
#define GEMM8_REST(TILE) case 4: TILE(4); break; case 5: TILE(5); break; case 6: TILE(6); break; case 7: TILE(7); break;
#else
#define GEMM8_REST(TILE)
#endif
#define GEMM8_EACH_TILE(TILE) do { \
        int t = 0; \
        for (; t + GR <= T; t += GR) TILE(GR); \
        switch (T - t) { case 1: TILE(1); break; case 2: TILE(2); break; case 3: TILE(3); break; GEMM8_REST(TILE) \
                         default: break; } \
    } while (0)

// A call's prompt rows rounded once (quantize_x8): xq [T, K], xs / sums [T, K / 32]; with `halves`, xh [T, K / 16]
// 32 times each 16 activations' sum (Q6_K's sub-blocks). 0, or 2 out of memory (nothing held).
typedef struct { int8_t *xq; float *xs, *sums; int32_t *xh; } gemm8_x_t;

static void gemm8_x_free(gemm8_x_t *a) {
    free(a->xq);
    free(a->xs);
    free(a->xh);
}

static int gemm8_x(const float *x, int T, int K, int halves, gemm8_x_t *a) {
    int ng = K / 32;
    a->xq = (int8_t *)aligned_alloc(64, ((size_t)T * K + 63) / 64 * 64);
    a->xs = (float *)malloc(sizeof(float) * (size_t)T * ng * 2);
    a->sums = a->xs ? a->xs + (size_t)T * ng : NULL;
    a->xh = halves ? (int32_t *)malloc(sizeof(int32_t) * (size_t)T * ng * 2) : NULL;
    if (!a->xq || !a->xs || (halves && !a->xh)) {
        gemm8_x_free(a);
        return 2;
    }
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const int8_t *q = a->xq + (size_t)t * K;
        quantize_x8(x + (size_t)t * K, 1, K, a->xq + (size_t)t * K, a->xs + (size_t)t * ng, a->sums + (size_t)t * ng);
        for (int i = 0; halves && i < 2 * ng; i++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += q[16 * i + j];
            a->xh[(size_t)t * 2 * ng + i] = 32 * sum;
        }
    }
    return 0;
}

// x [T, K] fp32 -> y [T, N]: codes q4 ([N, K/2], high: q5's fifth bits or NULL) or q8 ([N, K] int8, groups of 32)
static int gemm8(const float *x, int T, int K, const void *codes, int bits, const uint8_t *high, const void *scale,
                 const void *zero, int kind, const float *ssup, const float *zsup, int per, int N, float *y) {
    int ng = K / 32;
    gemm8_x_t a;
    if (T <= 0 || N <= 0) return 0;
    if (gemm8_x(x, T, K, 0, &a)) return 2;
    const int8_t *xq = a.xq;
    const float *xs = a.xs, *sums = a.sums;
    int failed = 0;
    int nb = (N + GB - 1) / GB;
    #pragma omp parallel
    {
        uint32_t *wb = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)ng * 8 * GB);
        float *sb = (float *)aligned_alloc(64, sizeof(float) * (size_t)ng * GB * 2), *zb = sb + (size_t)ng * GB;
        #pragma omp for schedule(static)
        for (int b = 0; b < nb; b++) {
            if (!wb || !sb) { failed = 1; continue; }
            int n0 = b * GB, nr = N - n0 < GB ? N - n0 : GB;
            int zeros = gemm8_block(codes, bits, high, scale, zero, kind, ssup, zsup, per, n0, nr, K, wb, sb, zb);
            int span = bits == 8 ? 0 : high ? 4 : 8;
#define GEMM8_CALL(R, S) gemm8_tile(wb, sb, zb, zeros, S, xq + (size_t)t * K, xs + (size_t)t * ng, \
                                   sums + (size_t)t * ng, K, ng, R, y + (size_t)t * N + n0, N, nr)
#ifdef KVCHAT_AVX512
#define GEMM8_TILE(R) ((void)span, GEMM8_CALL(R, 0))
#else           // span a constant in each copy: the int16 sums unrolled into registers
#define GEMM8_TILE(R) (span == 8 ? GEMM8_CALL(R, 8) : span == 4 ? GEMM8_CALL(R, 4) : GEMM8_CALL(R, 0))
#endif
            GEMM8_EACH_TILE(GEMM8_TILE);
#undef GEMM8_TILE
#undef GEMM8_CALL
        }
        free(wb);
        free(sb);
    }
    gemm8_x_free(&a);
    return failed ? 2 : 0;
}

// ---- GGUF Q6_K (cpu_q6k.h's arrays: ql [N, K/2], qh [N, K/4], sc [N, K/16] int8, d [N, K/256] float16) ----------
// w = (d sc) (q - 32) with q a 6-bit code and a scale sc a sub-block of 16. A group of 32 spans two sub-blocks: steps
// 0-3 of the layout are the first, 4-7 the second. Each lane sums q . x over each sub-block exactly (VNNI; AVX2's
// pairs at most 2 x 63 x 127, two pairs' sum within int16), takes 32 times the sub-block's activation sum off and
// multiplies by its sc, both sub-blocks in int32 (|.| < 2^26); one float multiply-add by d times the row's scale a
// group. The same integers and float steps in both builds: the same bits.

// Block n0.. (nr <= GB rows) laid out: wb the codes as gemm8_block lays them, k0 / k1 [ng][GB] the two sub-blocks'
// scales (int32), sd [ng][GB] the super-block's d (rows past nr: zeros)
static void gemm8_q6_block(const uint8_t *ql, const uint8_t *qh, const int8_t *sc, const half_t *dd, int n0, int nr,
                           int K, uint32_t *wb, int32_t *k0, int32_t *k1, float *sd) {
    int ng = K / 32;
    const __m256i m0f = _mm256_set1_epi8(15), m03 = _mm256_set1_epi8(3);
    for (int r = 0; r < GB; r++) {
        size_t row = (size_t)(n0 + r);
        const int8_t *s = sc + row * (K / 16);
        for (int g = 0; g < ng; g++) {
            k0[g * GB + r] = r < nr ? s[2 * g] : 0;
            k1[g * GB + r] = r < nr ? s[2 * g + 1] : 0;
            sd[g * GB + r] = r < nr ? f16_to_f32(dd[row * (K / 256) + g / 8]) : 0.f;
        }
    }
    for (int g = 0; g < ng; g++) {
        int b = g / 8, half = (g % 8) / 4, c = g % 4;
        __m256i v[GB];
        for (int r = 0; r < GB; r++) {
            if (r >= nr) {
                v[r] = _mm256_setzero_si256();
                continue;
            }
            size_t row = (size_t)(n0 + r);
            const uint8_t *l = ql + row * (K / 2), *h = qh + row * (K / 4);
            __m256i a = _mm256_loadu_si256((const __m256i *)(l + b * 128 + 64 * half + 32 * (c & 1)));
            __m256i lo = _mm256_and_si256(c >> 1 ? _mm256_srli_epi16(a, 4) : a, m0f);
            __m256i hb = _mm256_loadu_si256((const __m256i *)(h + b * 64 + 32 * half));
            hb = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * c)), m03);
            v[r] = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
        }
        gemm8_transpose(v, wb + (size_t)g * 8 * GB);
    }
}

#ifdef KVCHAT_AVX512
// R prompt rows against a laid-out Q6_K block; xh [R, 2 ng]: each sub-block's activation sum times 32
static inline __attribute__((always_inline)) void gemm8_q6_tile(const uint32_t *wb, const int32_t *k0,
        const int32_t *k1, const float *sd, const int8_t *xq, const int32_t *xh, const float *xs, int K, int ng,
        const int R, float *y, size_t ldy, int nr) {
    __m512 acc[GR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512i v[GR];
        const __m512i *w = (const __m512i *)(wb + (size_t)g * 8 * GB);
        for (int sub = 0; sub < 2; sub++) {
            __m512i d[GR];
            for (int r = 0; r < R; r++) d[r] = _mm512_setzero_si512();
            for (int c = 4 * sub; c < 4 * sub + 4; c++) {
                __m512i wc = _mm512_load_si512(w + c);
                for (int r = 0; r < R; r++)
                    d[r] = _mm512_dpbusd_epi32(d[r], wc, _mm512_set1_epi32(*(const int32_t *)(xq + (size_t)r * K + g * 32 + 4 * c)));
            }
            __m512i k = _mm512_load_si512((const __m512i *)((sub ? k1 : k0) + g * GB));
            for (int r = 0; r < R; r++) {
                __m512i t = _mm512_mullo_epi32(k, _mm512_sub_epi32(d[r], _mm512_set1_epi32(xh[(size_t)r * 2 * ng + 2 * g + sub])));
                v[r] = sub ? _mm512_add_epi32(v[r], t) : t;
            }
        }
        __m512 s = _mm512_load_ps(sd + g * GB);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v[r]), _mm512_mul_ps(s, _mm512_set1_ps(xs[r * ng + g])), acc[r]);
    }
    __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}
#else
static inline __attribute__((always_inline)) void gemm8_q6_tile(const uint32_t *wb, const int32_t *k0,
        const int32_t *k1, const float *sd, const int8_t *xq, const int32_t *xh, const float *xs, int K, int ng,
        const int R, float *y, size_t ldy, int nr) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[GR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256i v[GR];
        const __m256i *w = (const __m256i *)(wb + (size_t)g * 8 * GB);
        const int8_t *xg = xq + g * 32;
        for (int sub = 0; sub < 2; sub++) {
            __m256i d[GR];
            for (int r = 0; r < R; r++) d[r] = _mm256_setzero_si256();
            for (int c0 = 4 * sub; c0 < 4 * sub + 4; c0 += 2) {       // two steps' pairs in int16, then widened
                __m256i h[GR];
                for (int r = 0; r < R; r++) h[r] = _mm256_setzero_si256();
                for (int c = c0; c < c0 + 2; c++) {
                    __m256i wc = _mm256_load_si256(w + c);
                    for (int r = 0; r < R; r++)
                        h[r] = _mm256_adds_epi16(h[r], _mm256_maddubs_epi16(wc,
                                   _mm256_set1_epi32(*(const int32_t *)(xg + (size_t)r * K + 4 * c))));
                }
                for (int r = 0; r < R; r++) d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(h[r], ones));
            }
            __m256i k = _mm256_load_si256((const __m256i *)((sub ? k1 : k0) + g * GB));
            for (int r = 0; r < R; r++) {
                __m256i t = _mm256_mullo_epi32(k, _mm256_sub_epi32(d[r], _mm256_set1_epi32(xh[(size_t)r * 2 * ng + 2 * g + sub])));
                v[r] = sub ? _mm256_add_epi32(v[r], t) : t;
            }
        }
        __m256 s = _mm256_load_ps(sd + g * GB);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[r]), _mm256_mul_ps(s, _mm256_set1_ps(xs[r * ng + g])), acc[r]);
    }
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < R; r++) _mm256_maskstore_ps(y + r * ldy, keep, acc[r]);
}
#endif

// x [T, K] fp32 -> y [T, N] against Q6_K rows (K % 256 == 0)
static int gemm8_q6(const float *x, int T, int K, const uint8_t *ql, const uint8_t *qh, const int8_t *sc,
                    const half_t *dd, int N, float *y) {
    int ng = K / 32;
    gemm8_x_t a;
    if (T <= 0 || N <= 0) return 0;
    if (gemm8_x(x, T, K, 1, &a)) return 2;
    const int8_t *xq = a.xq;
    const int32_t *xh = a.xh;
    const float *xs = a.xs;
    int failed = 0;
    int nb = (N + GB - 1) / GB;
    #pragma omp parallel
    {
        uint32_t *wb = (uint32_t *)aligned_alloc(64, sizeof(uint32_t) * (size_t)ng * 8 * GB);
        int32_t *kk = (int32_t *)aligned_alloc(64, sizeof(int32_t) * (size_t)ng * GB * 2);
        float *sd = (float *)aligned_alloc(64, sizeof(float) * (size_t)ng * GB);
        #pragma omp for schedule(static)
        for (int b = 0; b < nb; b++) {
            if (!wb || !kk || !sd) { failed = 1; continue; }
            int n0 = b * GB, nr = N - n0 < GB ? N - n0 : GB;
            gemm8_q6_block(ql, qh, sc, dd, n0, nr, K, wb, kk, kk + (size_t)ng * GB, sd);
#define GEMM8_Q6(R) gemm8_q6_tile(wb, kk, kk + (size_t)ng * GB, sd, xq + (size_t)t * K, xh + (size_t)t * 2 * ng, \
                                  xs + (size_t)t * ng, K, ng, R, y + (size_t)t * N + n0, N, nr)
            GEMM8_EACH_TILE(GEMM8_Q6);
#undef GEMM8_Q6
        }
        free(wb);
        free(kk);
        free(sd);
    }
    gemm8_x_free(&a);
    return failed ? 2 : 0;
}
