// The opt-in int8-activation matvecs (EngineConfig(activations="int8")), and the four-lane loops the q4 codes' int16
// rows share with them (gemv_q4x), included by cpu_quant.c.
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

// activations() for int8 rows: prep (RMSNorm, SwiGLU) into scratch where mode asks, then xq [M, K] int8 after the
// float rows (or at scratch's start), its scales xs and sums [M, K / 32] after it
static void activations8(const float *x, int M, int K, int mode, const float *norm_w, float eps, void *scratch,
                         int8_t **xq, float **xs, float **sums) {
    float *buf = (float *)scratch;
    *xq = (int8_t *)(mode ? buf + (size_t)M * K : buf);
    *xs = (float *)(*xq + (size_t)M * K);
    *sums = *xs + (size_t)M * (K / 32);
    quantize_x8(prep(x, M, K, mode, norm_w, eps, buf), M, K, *xq, *xs, *sums);
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

// ---- q4 codes against int8 (and int16) activations, four lanes a group ----------------------------------------
// A group's 32 products go to four 32-bit lanes (lane i: its code bytes 4i..4i+3, low nibbles against x[4i..4i+3] and
// high nibbles against x[16 + 4i..]), so a 512-bit register holds four groups and one float multiply-add covers 128
// weights: half the multiplier work a weight of the eight-lane layout above costs, which left a Zen 4 core's matvec at
// 20 GB/s from L2, slower than memory. Group g's float sums run in chain g mod 4 (lanes 4 (g mod 4) .. + 4), the chains
// joined as [0 | 1] + [2 | 3]; AVX2 keeps chains 0-1 and 2-3 in two registers and does the same operations.
// The default int16 activations take the same loops (W 16): x = 256 t + b with t the signed top byte and b the
// unsigned bottom one, a lane's integer is (codes . t) << 8 plus (b . codes), two more u8 x s8 dot products a block
// (the codes, at most 31, are the signed operand of the second): the 16-bit dot product's integer, exactly, without
// widening the codes to 16 bits (which held a Zen 4 core to 15 GB/s).

#ifdef __AVX2__
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT2_256(lo, x0, hi, x1) _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0), hi, x1)
#define DOT2_128(lo, x0, hi, x1) _mm_dpbusd_epi32(_mm_dpbusd_epi32(_mm_setzero_si128(), lo, x0), hi, x1)
#define TOP2_256(lo, x0, hi, x1) _mm256_slli_epi32(DOT2_256(lo, x0, hi, x1), 8)
#define TOP2_128(lo, x0, hi, x1) _mm_slli_epi32(DOT2_128(lo, x0, hi, x1), 8)
#else       // pairs at most 2 * 31 * 127, two pairs' sum within int16: the same integers
#define DOT2_256(lo, x0, hi, x1) _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), \
                                                   _mm256_maddubs_epi16(hi, x1)), _mm256_set1_epi16(1))
#define DOT2_128(lo, x0, hi, x1) _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(lo, x0), _mm_maddubs_epi16(hi, x1)), \
                                                _mm_set1_epi16(1))
// the top bytes' sums times 256 in the widening multiply-add itself, one shift less a block: the same integers
#define TOP2_256(lo, x0, hi, x1) _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), \
                                                   _mm256_maddubs_epi16(hi, x1)), _mm256_set1_epi16(256))
#define TOP2_128(lo, x0, hi, x1) _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(lo, x0), _mm_maddubs_epi16(hi, x1)), \
                                                _mm_set1_epi16(256))
#endif

// x [M, K] int8 -> xl: each block of four groups as [x0-15 of g .. g + 3][x16-31 of g .. g + 3] (128 bytes), the code
// bytes' order; the last ng mod 4 groups as they are
static void quad_layout8(const int8_t *xq, int M, int K, int8_t *xl) {
    int ng = K / 32;
    for (int m = 0; m < M; m++) {
        const int8_t *x = xq + (size_t)m * K;
        int8_t *o = xl + (size_t)m * K;
        int g = 0;
        for (; g + 4 <= ng; g += 4)
            for (int q = 0; q < 4; q++) {
                memcpy(o + g * 32 + q * 16, x + (g + q) * 32, 16);
                memcpy(o + g * 32 + 64 + q * 16, x + (g + q) * 32 + 16, 16);
            }
        memcpy(o + g * 32, x + g * 32, (size_t)(ng - g) * 32);
    }
}

// groups g and g + 1 (32 code bytes c) -> [g's four lanes | g + 1's]; xl: their low halves' activations, xh: high;
// W 16: int16 activations as two byte planes, the signed top bytes at xl, xh and the unsigned bottom ones 128 on
static inline __m256i q4x8_pair(const uint8_t *c, const uint8_t *high, int g, const int8_t *xl, const int8_t *xh,
                                const int W) {
    const __m256i m = _mm256_set1_epi8(15);
    __m256i b = _mm256_loadu_si256((const __m256i *)c);
    __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    if (high) {
        uint32_t h0 = q5_bits(high, g), h1 = q5_bits(high, g + 1);
        lo = _mm256_or_si256(lo, q5_high8((h0 & 0xFFFFu) | h1 << 16));
        hi = _mm256_or_si256(hi, q5_high8((h0 >> 16) | (h1 & 0xFFFF0000u)));
    }
    __m256i x0 = _mm256_loadu_si256((const __m256i *)xl), x1 = _mm256_loadu_si256((const __m256i *)xh);
    if (W == 8) return DOT2_256(lo, x0, hi, x1);
    __m256i b0 = _mm256_loadu_si256((const __m256i *)(xl + 128)), b1 = _mm256_loadu_si256((const __m256i *)(xh + 128));
    return _mm256_add_epi32(TOP2_256(lo, x0, hi, x1), DOT2_256(b0, lo, b1, hi));
}

// one group (of the last ng mod 4) -> its four lanes; x: its 32 activations in element order (W 16: the top bytes,
// then the bottom ones)
static inline __m128i q4x8_one(const uint8_t *c, const uint8_t *high, int g, const int8_t *x, const int W) {
    const __m128i m = _mm_set1_epi8(15);
    __m128i b = _mm_loadu_si128((const __m128i *)c);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    if (high) {
        __m256i e = q5_high8(q5_bits(high, g));
        lo = _mm_or_si128(lo, _mm256_castsi256_si128(e));
        hi = _mm_or_si128(hi, _mm256_extracti128_si256(e, 1));
    }
    __m128i x0 = _mm_loadu_si128((const __m128i *)x), x1 = _mm_loadu_si128((const __m128i *)(x + 16));
    if (W == 8) return DOT2_128(lo, x0, hi, x1);
    __m128i b0 = _mm_loadu_si128((const __m128i *)(x + 32)), b1 = _mm_loadu_si128((const __m128i *)(x + 48));
    return _mm_add_epi32(TOP2_128(lo, x0, hi, x1), DOT2_128(b0, lo, b1, hi));
}

// [f[0] x 4 | f[1] x 4]
static inline __m256 pair4(const float *f) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double *)f))),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// [sc[0] * xs[0] x 4 | sc[1] * xs[1] x 4] straight from float16 scales: pair4 of f16_row_terms' products
static inline __m256 pair4h(const half_t *sc, const float *xs) {
    uint32_t two;
    memcpy(&two, sc, 4);
    __m128 f = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two)), _mm_castpd_ps(_mm_load_sd((const double *)xs)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

#ifdef KVCHAT_AVX512
// groups g .. g + 3 (64 code bytes) -> four lanes each; x: the block's 128 activations in quad_layout8 (W 16: the
// top bytes, then the bottom ones: the top products shifted 8 bits start the bottom ones' sums)
static inline __m512i q4x8_quad(const uint8_t *c, const uint8_t *high, int g, const int8_t *x, const int W) {
    const __m512i m = _mm512_set1_epi8(15);
    __m512i b = _mm512_loadu_si512((const void *)c);
    __m512i lo = _mm512_and_si512(b, m), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m);
    if (high) {
        uint64_t h[4], kl = 0, kh = 0;
        for (int q = 0; q < 4; q++) {
            h[q] = q5_bits(high, g + q);
            kl |= (h[q] & 0xFFFFu) << 16 * q;
            kh |= (h[q] >> 16) << 16 * q;
        }
        const __m512i sixteen = _mm512_set1_epi8(16);
        lo = _mm512_mask_add_epi8(lo, (__mmask64)kl, lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, (__mmask64)kh, hi, sixteen);
    }
    __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)x)),
                                    hi, _mm512_loadu_si512((const void *)(x + 64)));
    if (W == 8) return t;
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), _mm512_loadu_si512((const void *)(x + 128)),
                                                   lo), _mm512_loadu_si512((const void *)(x + 192)), hi);
}

// [f[0] x 4 | f[1] x 4 | f[2] x 4 | f[3] x 4]
static inline __m512 quad4(const float *f) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(_mm_loadu_ps(f)));
}

// quad4 of sc[0..4) * xs[0..4) straight from float16 scales
static inline __m512 quad4h(const half_t *sc, const float *xs) {
    __m128 f = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)sc)), _mm_loadu_ps(xs));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(f));
}
#endif

// A row's four chains: AVX-512 keeps them in one register, AVX2 chains 0-1 in c01 and 2-3 in c23
#ifdef KVCHAT_AVX512
typedef struct { __m512 v; } chains_t;
#else
typedef struct { __m256 c01, c23; } chains_t;
#endif

static inline chains_t chains_zero(void) {
#ifdef KVCHAT_AVX512
    return (chains_t){_mm512_setzero_ps()};
#else
    return (chains_t){_mm256_setzero_ps(), _mm256_setzero_ps()};
#endif
}

// Block g (four groups) of a weight row into its chains, times the blocks' scale products as rowterms_t's SK says:
// t.f (0), t.s times xs (1: the products f16_row_terms forms), or the current super-block's k8 (2)
static inline __attribute__((always_inline)) void q4x8_block(chains_t *c, const uint8_t *row, const uint8_t *high,
        int g, const int8_t *x, rowterms_t t, const int SK, const float *xs, __m256 k8, const int W) {
#ifdef KVCHAT_AVX512
    const __m512i four = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 s = SK == 1 ? quad4h(t.s + g, xs + g)
             : SK == 2 ? _mm512_permutexvar_ps(_mm512_add_epi32(four, _mm512_set1_epi32(g & 4)),
                                               _mm512_castps256_ps512(k8))
             : quad4(t.f + g);
    c->v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4x8_quad(row + g * 16, high, g, x, W)), s, c->v);
#else
    for (int p = 0; p < 2; p++) {           // groups g + 2p, g + 2p + 1: chains 2p, 2p + 1
        int j = g + 2 * p;
        __m256i sel = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(j & 7));
        __m256 s = SK == 1 ? pair4h(t.s + j, xs + j) : SK == 2 ? _mm256_permutevar8x32_ps(k8, sel) : pair4(t.f + j);
        __m256 d = _mm256_cvtepi32_ps(q4x8_pair(row + j * 16, high, j, x + 32 * p, x + 32 * p + 64, W));
        if (p) c->c23 = _mm256_fmadd_ps(d, s, c->c23);
        else c->c01 = _mm256_fmadd_ps(d, s, c->c01);
    }
#endif
}

// group g of the last ng mod 4 into chain g mod 4: lanes 0-3 or 4-7 of c01 or c23
static inline void q4x8_last(__m256 *c01, __m256 *c23, int g, const uint8_t *row, const uint8_t *high,
                             const int8_t *x, float f, const int W) {
    __m256 *c = (g & 2) ? c23 : c01;
    __m128 d = _mm_cvtepi32_ps(q4x8_one(row + g * 16, high, g, x, W)), s = _mm_set1_ps(f);
    if (g & 1) *c = _mm256_insertf128_ps(*c, _mm_fmadd_ps(d, s, _mm256_extractf128_ps(*c, 1)), 1);
    else *c = _mm256_insertf128_ps(*c, _mm_fmadd_ps(d, s, _mm256_castps256_ps128(*c)), 0);
}

// A row's chains after its full blocks, the last ng mod 4 groups added (ng from g), summed to eight lanes
static inline __m256 q4x8_finish(chains_t c, int g, int ng, const uint8_t *row, const uint8_t *high,
                                 const int8_t *xl, rowterms_t t, const int SK, const float *xs, const float *k8,
                                 const int W) {
#ifdef KVCHAT_AVX512
    __m256 c01 = low8(c.v), c23 = high8(c.v);
#else
    __m256 c01 = c.c01, c23 = c.c23;
#endif
    for (; g < ng; g++)         // K-quants never come here: their rows are whole super-blocks of eight groups
        q4x8_last(&c01, &c23, g, row, high, xl + g * 4 * W, TERMS_SCALE(t, SK, g, k8), W);
    return _mm256_add_ps(c01, c23);
}

// R rows of x (quad_layout8) against one weight row of q4 codes; f [R, ng]: sc[g] * xs[m][g]; zr: its zeros
static inline __attribute__((always_inline)) void q4x8_rows(const uint8_t *row, const uint8_t *high, const float *f,
        const float *zr, const int8_t *xl, const float *sums, int ng, int K, const int R, const int W, float *out) {
    chains_t c[4];
    rowterms_t t[4] = {{0}};
    for (int m = 0; m < R; m++) c[m] = chains_zero(), t[m].f = f + (size_t)m * ng, t[m].z = zr;
    int g = 0;
    for (; g + 4 <= ng; g += 4) {
        _mm_prefetch((const char *)row + (size_t)g * 16 + PREFETCH, _MM_HINT_T0);
        FAR_PREFETCH((const char *)row + (size_t)g * 16);
        for (int m = 0; m < R; m++)
            q4x8_block(&c[m], row, high, g, xl + ((size_t)m * K + g * 32) * (W / 8), t[m], 0, NULL,
                       _mm256_setzero_ps(), W);
    }
    for (int m = 0; m < R; m++) {
        const int8_t *x = xl + (size_t)m * K * (W / 8);
        out[m] = terms_join(q4x8_finish(c[m], g, ng, row, high, x, t[m], 0, NULL, NULL, W), t[m],
                            sums + (size_t)m * ng, 1, ng, _mm256_setzero_ps());
    }
}

// One row of x against weight rows a and b (decode): q4x8_rows' operations for each, side by side, the rows
// fetched PF_ROWS rows ahead as the int16 two-row kernels fetch theirs; the scale products and zeros as rowterms_t's
// SK and ZK say (terms_step, terms_join)
static inline __attribute__((always_inline)) void q4x8_row2_h(const uint8_t *ra, const uint8_t *rb,
        const uint8_t *ha, const uint8_t *hb, rowterms_t ta, rowterms_t tb, const float *xs, const int SK,
        const int ZK, const int8_t *xl, const float *sums, int ng, const int W, float *out) {
    chains_t A = chains_zero(), B = chains_zero();
    __m256 za8 = _mm256_setzero_ps(), zb8 = za8, ka8 = za8, kb8 = za8;
    float ka[8], kb[8];
    const long pf = PF_ROWS * 16L * ng;
    int g = 0;
    for (; g + 4 <= ng; g += 4) {
        _mm_prefetch((const char *)(ra + g * 16 + pf), PF_HINT);
        _mm_prefetch((const char *)(rb + g * 16 + pf), PF_HINT);
        terms_step(ta, xs, sums, SK, ZK, g, ng, ka, &za8);
        terms_step(tb, xs, sums, SK, ZK, g, ng, kb, &zb8);
        if (SK == 2 && !(g & 7)) ka8 = _mm256_loadu_ps(ka), kb8 = _mm256_loadu_ps(kb);
        q4x8_block(&A, ra, ha, g, xl + g * 4 * W, ta, SK, xs, ka8, W);
        q4x8_block(&B, rb, hb, g, xl + g * 4 * W, tb, SK, xs, kb8, W);
    }
    out[0] = terms_join(q4x8_finish(A, g, ng, ra, ha, xl, ta, SK, xs, ka, W), ta, sums, ZK, ng, za8);
    out[1] = terms_join(q4x8_finish(B, g, ng, rb, hb, xl, tb, SK, xs, kb, W), tb, sums, ZK, ng, zb8);
}

#define Q4X8_ROW2(H, SK, ZK) q4x8_row2_h(ra, rb, H ? ha : NULL, H ? hb : NULL, ta, tb, xs, SK, ZK, \
                                         (const int8_t *)x, sums, ng, 8, out)
#define Q4X16_ROW2(H, SK, ZK) q4x8_row2_h(ra, rb, H ? ha : NULL, H ? hb : NULL, ta, tb, xs, SK, ZK, \
                                          (const int8_t *)x, sums, ng, 16, out)
ROW2_FNS(q4x8_row2, Q4X8_ROW2)
ROW2_FNS(q4x16_row2, Q4X16_ROW2)
#undef Q4X8_ROW2
#undef Q4X16_ROW2

// 16 int16 values -> their top bytes at o, their bottom ones at o + gap
static inline void planes16(const int16_t *x, int8_t *o, int gap) {
    __m128i a = _mm_loadu_si128((const __m128i *)x), b = _mm_loadu_si128((const __m128i *)(x + 8));
    const __m128i low = _mm_set1_epi16(255);
    _mm_storeu_si128((__m128i *)o, _mm_packs_epi16(_mm_srai_epi16(a, 8), _mm_srai_epi16(b, 8)));
    _mm_storeu_si128((__m128i *)(o + gap), _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low)));
}

// x [M, K] int16 -> xl [M, 2K]: each value as a signed top byte and an unsigned bottom one (x = 256 top + bottom),
// each block of four groups as quad_layout8 of its top bytes, then of its bottom bytes (256 bytes), the last ng mod
// 4 groups as their 32 top bytes then 32 bottom ones: q4x8_quad's and q4x8_one's W 16 operands
static void quad_layout16(const int16_t *xq, int M, int K, int8_t *xl) {
    int ng = K / 32;
    for (int m = 0; m < M; m++) {
        const int16_t *x = xq + (size_t)m * K;
        int8_t *o = xl + (size_t)m * 2 * K;
        int g = 0;
        for (; g + 4 <= ng; g += 4)
            for (int q = 0; q < 8; q++)         // values 0-15 (q even) or 16-31 of group g + q / 2
                planes16(x + (g + q / 2) * 32 + (q & 1) * 16, o + g * 64 + (q & 1) * 64 + (q / 2) * 16, 128);
        for (; g < ng; g++)
            for (int h = 0; h < 2; h++) planes16(x + g * 32 + h * 16, o + g * 64 + h * 16, 32);
    }
}

// q4 codes (bits 4) against rows of activations laid out for the four-lane loops: int8 ones (W 8, quad_layout8) or
// int16 ones as two byte planes (W 16, quad_layout16: the same integers as a 16-bit dot product, exactly); xs, sums
// as quantize_x8 or quantize_x give them. gemv8's loops for q4 codes, and q4_gemv_ld's.
// One step of a decode matvec: weight rows n and b (n + 1, or n again for an odd last row) of a q4 matrix against
// one row of activations -> out[2], their scale terms formed in the loop (gemv_q4x, and cpu_moe.h's experts in one
// loop, so both give the same bits)
static inline __attribute__((always_inline)) void q4x_row_pair(const int8_t *xl, const int W, const float *xs,
        const float *sums, int K, const uint8_t *codes, const void *scale, const void *zero, int kind,
        const float *ssup, const float *zsup, int per, const uint8_t *high, int n, int b, float *out) {
    int ng = K / 32;
    const uint8_t *ha = high ? high + (size_t)n * (K / 8) : NULL, *hb = high ? high + (size_t)b * (K / 8) : NULL;
    const uint8_t *ra = codes + (size_t)n * (K / 2), *rb = codes + (size_t)b * (K / 2);
    float fa[MAXG], fb[MAXG], za[MAXG], zb[MAXG];
    prefetch_scales(scale, zero, ssup, zsup, kind, per, (size_t)n, ng);
    if (W == 8) ROW2_CALL(q4x8_row2, ra, rb, ha, hb, xl);
    else ROW2_CALL(q4x16_row2, ra, rb, ha, hb, xl);
}

static void gemv_q4x(const int8_t *xl, const int W, const float *xs, const float *sums, int M, int K,
                     const uint8_t *codes, const void *scale, const void *zero, int N, float *y, int ldy,
                     const float *resid, int kind, const float *ssup, const float *zsup, int per,
                     const uint8_t *high) {
    int ng = K / 32;
    if (M == 1) {           // decode: two weight rows a step, their scale terms formed in the loop
        SHARED_STEPS((N + 1) / 2, SHARE_ROWS / 2, p) {
            int n = 2 * p, b = n + 1 < N ? n + 1 : n;      // an odd last row: computed twice, stored once
            float out[2];
            q4x_row_pair(xl, W, xs, sums, K, codes, scale, zero, kind, ssup, zsup, per, high, n, b, out);
            y[n] = out[0] + (resid ? resid[n] : 0.f);
            if (b != n) y[b] = out[1] + (resid ? resid[b] : 0.f);
        }
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = codes + (size_t)n * (K / 2), *hrow = high ? high + (size_t)n * (K / 8) : NULL;
        float sbuf[MAXG], zbuf[MAXG], out[MAXM], f[4 * MAXG];
        const float *sc = row_f32(scale, ssup, per, n, ng, kind, sbuf);
        const float *zr = row_zero(zero, zsup, per, n, ng, kind, sc, zbuf, high);
        for (int m0 = 0; m0 < M; m0 += 4) {
            int R = M - m0 < 4 ? M - m0 : 4;
            scale_products(sc, xs + (size_t)m0 * ng, ng, R, f);
            const int8_t *xm = xl + (size_t)m0 * K * (W / 8);
            const float *sm = sums + (size_t)m0 * ng;
#define Q4X_ROWS(R) (W == 8 ? (hrow ? q4x8_rows(row, hrow, f, zr, xm, sm, ng, K, R, 8, out + m0) \
                                    : q4x8_rows(row, NULL, f, zr, xm, sm, ng, K, R, 8, out + m0)) \
                            : (hrow ? q4x8_rows(row, hrow, f, zr, xm, sm, ng, K, R, 16, out + m0) \
                                    : q4x8_rows(row, NULL, f, zr, xm, sm, ng, K, R, 16, out + m0)))
            switch (R) {
                case 1: Q4X_ROWS(1); break;
                case 2: Q4X_ROWS(2); break;
                case 3: Q4X_ROWS(3); break;
                default: Q4X_ROWS(4); break;
            }
#undef Q4X_ROWS
        }
        for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
    }
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
        for (int o = 0; o < 16 * bits; o += 64) {          // the block's 64 (bits 4) or 128 bytes, a line each
            _mm_prefetch((const char *)row + (size_t)g * bits * 4 + o + PREFETCH, _MM_HINT_T0);
            FAR_PREFETCH((const char *)row + (size_t)g * bits * 4 + o);
        }
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
        for (int o = 0; o < 16 * bits; o += 64) {          // the block's 64 (bits 4) or 128 bytes, a line each
            _mm_prefetch((const char *)row + (size_t)g * bits * 4 + o + PREFETCH, _MM_HINT_T0);
            FAR_PREFETCH((const char *)row + (size_t)g * bits * 4 + o);
        }
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
    int8_t *xq;
    float *xs, *sums;
    activations8(x, M, K, mode, norm_w, eps, scratch, &xq, &xs, &sums);
#ifdef __AVX2__
    if (bits == 4) {        // four lanes a group (above); room for the laid-out rows after the sums
        int8_t *xl = (int8_t *)(sums + (size_t)M * ng);
        quad_layout8(xq, M, K, xl);
        gemv_q4x(xl, 8, xs, sums, M, K, (const uint8_t *)codes, scale, zero, N, y, ldy, resid, kind, ssup, zsup, per,
                 high);
        return;
    }
#endif
    size_t row_bytes = (size_t)K * bits / 8;
    SHARED_STEPS(N, SHARE_ROWS, n) {
        const uint8_t *row = (const uint8_t *)codes + (size_t)n * row_bytes;
        const uint8_t *hrow = high ? high + (size_t)n * (K / 8) : NULL;
        float sbuf[MAXG], zbuf[MAXG], out[MAXM];
#ifdef __AVX2__
        if (!(n & 1)) prefetch_scales(scale, zero, ssup, zsup, kind, per, (size_t)n, ng);   // PF_ROWS rows on
#endif
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
