// The AVX-512 variant's weight matvecs (included by cpu_quant.c in builds with AVX-512 F/BW/VL and VNNI).
//
// Each function here gives the same bits as its AVX2 twin in cpu_quant.c: two groups of 32 weights go through
// one 512-bit register, lanes 0-7 doing the AVX2 code's work for the even group (its accumulator a0) and lanes
// 8-15 for the odd one (a1), with the same integer sums (VNNI's vpdpwssd adds the 16-bit products into the
// 32-bit lanes without saturating, as madd + add does) and the same float operations in the same order. So a
// conversation answers the same on an AVX-512 machine as on an AVX2 one (tests/test_kernel_variants.py).
#pragma once

// the activations of two neighbouring groups, 16 of each: v[0, 16) in the low half, v[32, 48) in the high one
static inline __m512i pair16(const int16_t *v) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)v)),
                              _mm256_loadu_si256((const __m256i *)(v + 32)), 1);
}

// [f[0] x 8 | f[1] x 8]
static inline __m512 pair_scale(const float *f) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)f))));
}

// pair_scale of sc[0] * xs[0] and sc[1] * xs[1] straight from float16 scales (f16_row_terms' products)
static inline __m512 pair_scale_h(const half_t *sc, const float *xs) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    uint32_t two;
    memcpy(&two, sc, 4);
    __m128 f = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two)), _mm_castpd_ps(_mm_load_sd((const double *)xs)));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
}

static inline __m256 low8(__m512 a) { return _mm512_castps512_ps256(a); }
static inline __m256 high8(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

// the codes of groups g and g + 1 (32 bytes), unpacked: elements 0-15 of each (low nibbles) and 16-31 (high);
// q5 (high: NULL or the row's fifth bits) adds 16 where bit 4 is set
static inline __attribute__((always_inline)) void q4_unpack_pair(const uint8_t *b, const uint8_t *high, int g,
                                                               __m512i *lo, __m512i *hi) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
    *lo = _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
    *hi = _mm512_srli_epi16(w, 4);
    if (high) {
        uint32_t h0 = q5_bits(high, g), h1 = q5_bits(high, g + 1);
        const __m512i sixteen = _mm512_set1_epi16(16);
        *lo = _mm512_mask_add_epi16(*lo, (__mmask32)((h0 & 0xFFFF) | h1 << 16), *lo, sixteen);
        *hi = _mm512_mask_add_epi16(*hi, (__mmask32)((h0 >> 16) | (h1 & 0xFFFF0000u)), *hi, sixteen);
    }
}

// 16-bit codes of groups g (lanes 0-7) and g + 1 (lanes 8-15) against their activations v in q4_pair_layout
static inline __m512i q4_pair_dot(__m512i lo, __m512i hi, const int16_t *v) {
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)v)),
                               hi, _mm512_loadu_si512((const void *)(v + 32)));
}

// One row of x laid out for q8_row2_512 and the MXFP4 rows: each pair of groups g, g + 1 as [g's 0-15 | g + 1's 0-15] then
// [g's 16-31 | g + 1's 16-31], so a step loads its activations whole (pair16's two halves, put in place once a
// call instead of once a weight row); an odd last group stays as it is.
static inline void q4_pair_layout1(const int16_t *xq, int ng, int16_t *xp) {
    int g = 0;
    for (; g + 2 <= ng; g += 2) {
        _mm512_storeu_si512((void *)(xp + g * 32), pair16(xq + g * 32));
        _mm512_storeu_si512((void *)(xp + g * 32 + 32), pair16(xq + g * 32 + 16));
    }
    if (g < ng) memcpy(xp + g * 32, xq + g * 32, 32 * sizeof(int16_t));
}

// M rows of xq [M, K] in q4_pair_layout1, in scratch where activations() left room (as Q6_K's planes: mode 0
// after its pieces, else where the prepared float rows were, quantized by then)
static inline const int16_t *q4_pair_layout(const int16_t *xq, int M, int K, int mode, void *scratch,
                                           const float *sums) {
    int16_t *xp = mode ? (int16_t *)scratch
                       : (int16_t *)(((uintptr_t)(sums + (size_t)M * (K / 32)) + 63) & ~(uintptr_t)63);
    for (int m = 0; m < M; m++) q4_pair_layout1(xq + (size_t)m * K, K / 32, xp + (size_t)m * K);
    return xp;
}


// int8 codes of groups g and g + 1 as [g's 16 codes from j | g + 1's 16 codes from j], widened to 16 bits
static inline __m512i q8_pair16(const int8_t *w) {
    return _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)w)), _mm_loadu_si128((const __m128i *)(w + 32)), 1));
}

// [s0 x 8 | s1 x 8], each product formed in float as q8_row1 forms it
static inline __m512 pair_of(float s0, float s1) {
    float f[2] = {s0, s1};
    return pair_scale(f);
}

// q8_row1 (G == 32, or G == 16 without zeros) for M rows: groups of 32 two at a time (G == 32, xq the rows in
// q4_pair_layout), or one group of 32 a step whose halves have their own scales (G == 16, xq as it is)
static __attribute__((noinline)) void q8_rowsM_512(const int8_t *row, const float *sc, const float *zr, int G, const int16_t *xq,
                         const float *xs, const float *sums32, int nx, int K, int M, float *out) {
    __m512 acc[MAXM];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int g = 0;
    if (G == 32) {
        for (; g + 2 <= nx; g += 2) {
            _mm_prefetch((const char *)(row + g * 32 + PREFETCH), _MM_HINT_T0);
            __m512i a = q8_pair16(row + g * 32), b = q8_pair16(row + g * 32 + 16);
            for (int m = 0; m < M; m++) {
                const int16_t *v = xq + (size_t)m * K + g * 32;
                __m512i p = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), a,
                                                _mm512_loadu_si512((const void *)v)), b, _mm512_loadu_si512((const void *)(v + 32)));
                const float *sx = xs + (size_t)m * nx + g;
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_of(sc[g] * sx[0], sc[g + 1] * sx[1]), acc[m]);
            }
        }
    } else {
        for (; g < nx; g++) {
            if (!(g & 1)) _mm_prefetch((const char *)(row + g * 32 + PREFETCH), _MM_HINT_T0);
            __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + g * 32)));
            for (int m = 0; m < M; m++) {
                __m512i p = _mm512_madd_epi16(w, _mm512_loadu_si512((const void *)(xq + (size_t)m * K + g * 32)));
                float sx = xs[(size_t)m * nx + g];
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_of(sc[2 * g] * sx, sc[2 * g + 1] * sx), acc[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) {
        __m256 a0 = low8(acc[m]), a1 = high8(acc[m]);
        if (g < nx) {       // G == 32 with an odd number of groups: the last one is even, a0's
            const int16_t *v = xq + (size_t)m * K + g * 32;
            __m256i p0 = q8_half(row + g * 32, v), p1 = q8_half(row + g * 32 + 16, v + 16);
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                                 _mm256_set1_ps(sc[g] * xs[(size_t)m * nx + g]), a0);
        }
        float tail = 0.f;
        __m256 z = zr && G == 32 ? zero_terms(zr, sums32 + (size_t)m * nx, nx, &tail) : _mm256_setzero_ps();
        out[m] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), z)) + tail;
    }
}

// q8_row1 (G == 32) for one row of x against two weight rows at once: each row's sums in its own
// order, the chains side by side. xp: the row in q4_pair_layout; fa, fb: the scale products sc[g] * xs[g].
static inline __attribute__((always_inline)) void q8_row2_512_h(const int8_t *ra, const int8_t *rb,
        const float *fa, const float *fb, const half_t *sa, const half_t *sb, const float *xs, const float *za,
        const float *zb, const int16_t *xp, const float *sums32, int nx, float *out) {
    __m512 A = _mm512_setzero_ps(), B = _mm512_setzero_ps();
    const long pf = PF_ROWS * 32L * nx;
    int g = 0;
    for (; g + 2 <= nx; g += 2) {
        _mm_prefetch((const char *)(ra + g * 32 + pf), PF_HINT);
        _mm_prefetch((const char *)(rb + g * 32 + pf), PF_HINT);
        __m512i x0 = _mm512_loadu_si512((const void *)(xp + g * 32));
        __m512i x1 = _mm512_loadu_si512((const void *)(xp + g * 32 + 32));
        __m512i pa = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), q8_pair16(ra + g * 32), x0),
                                         q8_pair16(ra + g * 32 + 16), x1);
        __m512i pb = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), q8_pair16(rb + g * 32), x0),
                                         q8_pair16(rb + g * 32 + 16), x1);
        A = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pa), sa ? pair_scale_h(sa + g, xs + g) : pair_scale(fa + g), A);
        B = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pb), sb ? pair_scale_h(sb + g, xs + g) : pair_scale(fb + g), B);
    }
    const int8_t *r[2] = {ra, rb};
    const float *f[2] = {fa, fb}, *z[2] = {za, zb};
    const half_t *sh[2] = {sa, sb};
    __m512 acc[2] = {A, B};
    for (int i = 0; i < 2; i++) {
        __m256 a0 = low8(acc[i]), a1 = high8(acc[i]);
        if (g < nx) {       // an odd number of groups: the last one is even, a0's
            __m256i p0 = q8_half(r[i] + g * 32, xp + g * 32), p1 = q8_half(r[i] + g * 32 + 16, xp + g * 32 + 16);
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(sh[i] ? f16_to_f32(sh[i][g]) * xs[g] : f[i][g]), a0);
        }
        float tail = 0.f;
        __m256 zt = z[i] ? zero_terms(z[i], sums32, nx, &tail) : _mm256_setzero_ps();
        out[i] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), zt)) + tail;
    }
}

static __attribute__((noinline)) void q8_row2_512(const int8_t *ra, const int8_t *rb, const float *fa,
        const float *fb, const float *za, const float *zb, const int16_t *xp, const float *sums32, int nx,
        float *out) {
    q8_row2_512_h(ra, rb, fa, fb, NULL, NULL, NULL, za, zb, xp, sums32, nx, out);
}

// Q8_0 (float16 scales, no zeros): the scale products formed in the loop
static __attribute__((noinline)) void q8_row2_512_f16(const int8_t *ra, const int8_t *rb, const half_t *sa,
        const half_t *sb, const float *xs, const int16_t *xp, const float *sums32, int nx, float *out) {
    q8_row2_512_h(ra, rb, NULL, NULL, sa, sb, xs, NULL, NULL, xp, sums32, nx, out);
}
