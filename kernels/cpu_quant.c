// Matrix-vector products over quantized weights, for CPU decode; and dequantization for prefill.
//
// Weights are read in their packed form and never expanded in memory:
//   q4: codes packed two per byte, groups of 32 along K; byte j of a group holds element j in its
//       low nibble and element j + 16 in its high nibble (the layout of GGUF Q4_0 / Q4_1).
//       w = code * scale + zero, one scale and zero per group.
//   q5: q4's nibbles and a fifth bit per code beside them (GGUF Q5_0, Q5_1, Q5_K at their own 5.5 bits):
//       `high` [N, K/8], a little-endian uint32 per group whose bit j is element j's bit 4; the q4 functions
//       take it as their last argument (NULL: 4-bit codes) and OR it into the unpacked codes, 0..31.
//   q8: int8 codes, groups of G (16 or 32) along K; w = code * scale (+ zero when given).
// x: [M, K] float32 with K a multiple of 32, y: [M, N] float32. Output rows are split across
// OpenMP threads.
// Built at first use by kernels/cpu_quant.py with the machine's C compiler (-O3 -march=native).
#include <stdlib.h>
#include "cpu_common.h"

#define MAXM 8
#define MAXG 1024          // groups per row: K up to 32768 (groups of 32) or 16384 (groups of 16)
#define PREFETCH 2048      // bytes ahead of the weight row being read (into the next rows): +5-10% over the
                           // hardware prefetcher alone for two threads streaming the 1B shape's weights
// How far ahead the two-row kernels prefetch, and into which cache: the same place PF_ROWS weight rows on, into L2.
// A fixed distance in bytes (PREFETCH) lands in the row being read beside once rows are read in pairs. On the Xeon
// (weights mostly in its 480 MB L3) 4 rows into L1 took Llama-3.2-3B's decode 11.0 -> 12.3 tok/s (2: 12.1, 8: 12.0);
// on a Zen 4 (32 MB L3: the weights come from memory) 4 rows into L1 left a 134 MB q4 matvec at 17 GB/s where int8
// activations streamed 31: 64 rows into L2 reads it at 29-31 GB/s (16: 25, 32: 23-29, 96: 31), and the Llama-3.2-1B
// preset decodes 28 -> 41.6 tok/s.
#define PF_ROWS 64
#define SHARE_ROWS 16      // weight rows a claim of a decode matvec's shared rows (SHARED_STEPS)
#define PF_HINT _MM_HINT_T1
// The one-row kernels (Q6_K, MXFP4, int8 activations) stream as far ahead into L2 beside their near PREFETCH
#define PF_FAR 65536
#define FAR_PREFETCH(p) _mm_prefetch((const char *)(p) + PF_FAR, _MM_HINT_T1)

// How scales and zeros are stored (`kind`), each widened into a stack buffer once per row:
//   0: float32; 1: float16, where the file's values are exactly float16 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0);
//   2: uint8 codes times a float32 per super-block of `per` groups (Q4_K, Q5_K: d * sc, -dmin * m);
//   3: int8 codes times a float32 per super-block (Q6_K). Kinds 2 and 3 rebuild the products in
//   float32 exactly as gguf computes them, at 0.25-0.5 bit per weight instead of 2.
//   4: float16 scales as kind 1 and no zeros stored: zero = -8 * scale (Q4_0), or -16 * scale for 5-bit codes
//   (Q5_0), exact in float32.
//   5: the K-quants' own 12 bytes a super-block of 8 groups (eight 6-bit scales and eight 6-bit mins, packed as
//   the file packs them; scale and zero point at the same bytes) with float16 d and dmin per super-block (ssup,
//   zsup): Q4_K and Q5_K at exactly the file's bytes, the products d * sc and -(dmin * m) as kind 2 forms them.

// kind 5: a row's n scales (mins = 0: d * sc) or zeros (mins = 1: (-dmin) * m, as kind 2 forms them) into buf.
// A super-block's 12 bytes hold scales 0-3 and mins 0-3 in the low 6 bits of bytes 0-3 and 4-7, and scales / mins
// 4-7 as the nibbles of bytes 8-11 with their top 2 bits in the top bits of bytes 0-3 / 4-7 (llama.cpp's
// get_scale_min_k4): four bytes at a time in a 32-bit word.
static inline const float *kpack_row(const uint8_t *p, const half_t *sup, size_t row, int n, int mins, float *buf) {
    const uint8_t *s = p + row * (size_t)(n / 8) * 12;
    const half_t *d = sup + row * (size_t)(n / 8);
    for (int b = 0; b < n / 8; b++) {
        uint32_t a, m, c, lo, hi;
        memcpy(&a, s + 12 * b, 4);
        memcpy(&m, s + 12 * b + 4, 4);
        memcpy(&c, s + 12 * b + 8, 4);
        if (mins) {
            lo = m & 0x3F3F3F3Fu;
            hi = ((c >> 4) & 0x0F0F0F0Fu) | ((m >> 2) & 0x30303030u);
        } else {
            lo = a & 0x3F3F3F3Fu;
            hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
        }
        float db = f16_to_f32(d[b]);
        db = mins ? -db : db;
        uint64_t codes = lo | (uint64_t)hi << 32;
#ifdef __AVX2__
        __m256i w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)codes));
        _mm256_storeu_ps(buf + 8 * b, _mm256_mul_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(w)));
#else
        for (int j = 0; j < 8; j++) buf[8 * b + j] = db * (float)(int)((codes >> (8 * j)) & 0xFF);
#endif
    }
    return buf;
}

static inline const float *row_f32(const void *p, const float *sup, int per, size_t row, int n, int kind,
                                   float *buf) {
    if (!p) return NULL;
    size_t off = row * n;
    if (kind == 0) return (const float *)p + off;
    if (kind == 5) return kpack_row((const uint8_t *)p, (const half_t *)sup, row, n, 0, buf);
    if (kind == 1 || kind == 4) {
        const half_t *h = (const half_t *)p + off;
        int i = 0;
#ifdef __F16C__
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) buf[i] = f16_to_f32(h[i]);
    } else {
        const float *s = sup + row * (n / per);
        for (int b = 0; b < n / per; b++) {          // one super-block at a time: no division per element
            float d = s[b];
            float *o = buf + b * per;
            const uint8_t *q = (const uint8_t *)p + off + b * per;     // kind 2: uint8 codes, 3: int8
            int i = 0;
#ifdef __AVX2__
            // the loop below eight at a time: the same one rounding (d * q, q exact in float)
            for (; i + 8 <= per; i += 8) {
                __m128i c = _mm_loadl_epi64((const __m128i *)(q + i));
                __m256i w = kind == 2 ? _mm256_cvtepu8_epi32(c) : _mm256_cvtepi8_epi32(c);
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(w)));
            }
#endif
            for (; i < per; i++) o[i] = d * (float)(kind == 2 ? (int)q[i] : (int)(int8_t)q[i]);
        }
    }
    return buf;
}

// A row's zeros: as row_f32, or for kind 4 made from the row's scales sc: -8 * sc, -16 * sc for 5-bit codes (high)
static inline const float *row_zero(const void *p, const float *sup, int per, size_t row, int n, int kind,
                                    const float *sc, float *buf, const uint8_t *high) {
    if (kind == 5) return p ? kpack_row((const uint8_t *)p, (const half_t *)sup, row, n, 1, buf) : NULL;
    if (kind != 4) return row_f32(p, sup, per, row, n, kind, buf);
    float c = high ? -16.f : -8.f;
    for (int i = 0; i < n; i++) buf[i] = c * sc[i];
    return buf;
}

// group g's fifth bits (q5): bit j is element j's bit 4
static inline uint32_t q5_bits(const uint8_t *high, int g) {
    uint32_t b;
    memcpy(&b, high + 4 * (size_t)g, 4);
    return b;
}


#ifdef __AVX2__
// a group of 32 floats as four vectors, and its largest |x| (NaN where the group holds a NaN: the quantizers then
// take their scalar loops, whose max skips it)
static inline float load_group(const float *v, __m256 q[4]) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) q[i] = _mm256_loadu_ps(v + 8 * i);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(q[0], absmask), _mm256_and_ps(q[1], absmask)),
                              _mm256_max_ps(_mm256_and_ps(q[2], absmask), _mm256_and_ps(q[3], absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    return _mm_cvtss_f32(m4);
}

static inline int hsum_epi32(__m256i sum) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}
#endif

static inline float absmax32(const float *v) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) {
        float a = v[j] < 0 ? -v[j] : v[j];
        amax = a > amax ? a : amax;
    }
    return amax;
}

static void quantize_x(const float *x, int M, int K, int16_t *xq, float *xs, float *sums) {
    // per row and group of 32: xq = round(x / s) in [-32767, 32767], s = max|x| / 32767, and
    // sums = s * sum of xq. 16-bit activations keep the products exact to about 1e-5 (8-bit ones, as
    // llama.cpp uses, flipped near-tied greedy choices of the default model). The sums come from the
    // quantized x so that code and zero terms see the same input: with the exact sum, a zero point of
    // -8 * scale (Q4_0) would not cancel the codes' offset.
    int ng = K / 32;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < ng; g++) {
            const float *v = x + (size_t)m * K + g * 32;
#ifdef __AVX2__
            // the scalar loop below, eight lanes at a time: the same max, the same rounding (to nearest even)
            __m256 q[4];
            float vmax = load_group(v, q);
            __m256 v0 = q[0], v1 = q[1], v2 = q[2], v3 = q[3];
            if (vmax == vmax) {        // no NaN: NaN inputs take the scalar loop, whose max skips them
                float inv_v = vmax > 0 ? 32767.f / vmax : 0.f;
                __m256 iv = _mm256_set1_ps(inv_v);
                __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv)),
                        i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
                __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
                int16_t *o = xq + (size_t)m * K + g * 32;
                // packs interleave 128-bit lanes: permute back to element order
                __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
                __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
                _mm256_storeu_si256((__m256i *)o, p01);
                _mm256_storeu_si256((__m256i *)(o + 16), p23);
                xs[m * ng + g] = vmax / 32767.f;
                sums[m * ng + g] = (vmax / 32767.f) * (float)hsum_epi32(sum);
                continue;
            }
#endif
            float amax = absmax32(v);
            float s = amax / 32767.f, inv = amax > 0 ? 32767.f / amax : 0.f;
            int16_t *o = xq + (size_t)m * K + g * 32;
            int isum = 0;
            for (int j = 0; j < 32; j++) {
                o[j] = (int16_t)__builtin_lrintf(v[j] * inv);
                isum += o[j];
            }
            xs[m * ng + g] = s;
            sums[m * ng + g] = s * (float)isum;
        }
}

// What a decode step does to x before and after a matmul, fused here to save a dozen small torch
// ops per layer: mode 1 applies RMSNorm with weight norm_w, mode 2 SwiGLU (x has 2K columns:
// silu(x[:, :K]) * x[:, K:]); resid, when given, is added to the output.
static const float *prep(const float *x, int M, int K, int mode, const float *norm_w, float eps, float *buf) {
    if (mode == 0) return x;
    for (int m = 0; m < M; m++) {
        float *o = buf + (size_t)m * K;
        if (mode == 1) {
            const float *v = x + (size_t)m * K;
            double ss = 0;
            for (int j = 0; j < K; j++) ss += (double)v[j] * v[j];
            float r = 1.f / sqrtf((float)(ss / K) + eps);
            for (int j = 0; j < K; j++) o[j] = v[j] * r * norm_w[j];
        } else {
            const float *a = x + (size_t)m * 2 * K, *b = a + K;
            int j = 0;
#ifdef __AVX2__
            // eight at a time through exp8 (a serial piece of every decode layer: the other threads wait on it)
            const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
            for (; j + 8 <= K; j += 8) {
                __m256 v = _mm256_loadu_ps(a + j);
                __m256 e = exp8(_mm256_sub_ps(zero, v));
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + j)));
            }
#endif
            for (; j < K; j++) o[j] = a[j] / (1.f + expf(-a[j])) * b[j];
        }
    }
    return buf;
}

#ifdef __AVX2__
static inline __m256 zero_terms(const float *zr, const float *sums, int ng, float *tail) {
    // sum over groups of zero * sum(x), eight groups a step; the remainder goes to *tail. No zeros: 0
    __m256 z = _mm256_setzero_ps();
    *tail = 0.f;
    if (!zr) return z;
    int h = 0;
    for (; h + 8 <= ng; h += 8) z = _mm256_fmadd_ps(_mm256_loadu_ps(zr + h), _mm256_loadu_ps(sums + h), z);
    float t = 0.f;
    for (; h < ng; h++) t += zr[h] * sums[h];
    *tail = t;
    return z;
}

// The two-row kernels' zeros formed in their loops from float16, as zero_terms sums them: zk 2, c * the row's
// scales p (Q4_0, Q5_0: c = -8 or -16); zk 3, the file's float16 zeros p (Q4_1, Q5_1). zero8_h: groups h .. h + 8
// into the eight lanes; zero_tail_h: the groups past the last eight, in zero_terms' scalar order.
static inline __m256 zero8_h(const half_t *p, int zk, float c, const float *sums, int h, __m256 z) {
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + h)));
    if (zk == 2) v = _mm256_mul_ps(_mm256_set1_ps(c), v);
    return _mm256_fmadd_ps(v, _mm256_loadu_ps(sums + h), z);
}

static inline float zero_tail_h(const half_t *p, int zk, float c, const float *sums, int ng) {
    float t = 0.f;
    for (int h = ng / 8 * 8; h < ng; h++) t += (zk == 2 ? c * f16_to_f32(p[h]) : f16_to_f32(p[h])) * sums[h];
    return t;
}

// f [R, ng] = sc[g] * xs[m][g]
static inline void scale_products(const float *sc, const float *xs, int ng, int R, float *f) {
    for (int m = 0; m < R; m++) {
        const float *x = xs + (size_t)m * ng;
        float *o = f + (size_t)m * ng;
        int g = 0;
        for (; g + 8 <= ng; g += 8) _mm256_storeu_ps(o + g, _mm256_mul_ps(_mm256_loadu_ps(sc + g), _mm256_loadu_ps(x + g)));
        for (; g < ng; g++) o[g] = sc[g] * x[g];
    }
}

// Kinds 1 and 4 (float16 scales, and zeros or none) for the two-row kernels: row n's scale products f = sc * xs and
// zeros zr (kind 4: -8 or -16 * sc) in one pass (the products and roundings row_f32, row_zero and scale_products
// make). Returns zr, or NULL where the row has no zeros.
static inline const float *f16_row_terms(const void *scale, const void *zero, int kind, const uint8_t *high,
        const float *xs, size_t n, int ng, float *f, float *zr) {
    const half_t *s = (const half_t *)scale + n * ng, *z = zero ? (const half_t *)zero + n * ng : NULL;
    if (kind == 1 && !z) zr = NULL;
    const float c = high ? -16.f : -8.f;
    int g = 0;
#ifdef __F16C__
    for (; g + 8 <= ng; g += 8) {
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g)));
        _mm256_storeu_ps(f + g, _mm256_mul_ps(sc, _mm256_loadu_ps(xs + g)));
        if (kind == 4) _mm256_storeu_ps(zr + g, _mm256_mul_ps(_mm256_set1_ps(c), sc));
        else if (zr) _mm256_storeu_ps(zr + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(z + g))));
    }
#endif
    for (; g < ng; g++) {
        float sc = f16_to_f32(s[g]);
        f[g] = sc * xs[g];
        if (kind == 4) zr[g] = c * sc;
        else if (zr) zr[g] = f16_to_f32(z[g]);
    }
    return zr;
}

#ifdef __AVX2__
// One K-quant super-block's terms (12 packed bytes s, float16 d and dmin dm): the scale products (d * sc) * xs
// returned, the zeros (-dmin) * m into *zr where dm is not NULL; kpack_row's and scale_products' roundings.
static inline __m256 k_terms8(const uint8_t *s, half_t d, const half_t *dm, const float *xs, __m256 *zr) {
    uint32_t a, m, c;
    memcpy(&a, s, 4);
    memcpy(&m, s + 4, 4);
    memcpy(&c, s + 8, 4);
    uint64_t sc8 = (a & 0x3F3F3F3Fu) | (uint64_t)((c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
    __m256 sc = _mm256_mul_ps(_mm256_set1_ps(f16_to_f32(d)),
                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8))));
    if (dm) {
        uint64_t m8 = (m & 0x3F3F3F3Fu) | (uint64_t)(((c >> 4) & 0x0F0F0F0Fu) | ((m >> 2) & 0x30303030u)) << 32;
        *zr = _mm256_mul_ps(_mm256_set1_ps(-f16_to_f32(*dm)),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8))));
    }
    return _mm256_mul_ps(sc, _mm256_loadu_ps(xs));
}

#endif

// Where a two-row kernel's scale products and zeros come from (one per weight row)
typedef struct {
    const float *f, *z;         // formed before: products f [ng] and zeros z (zero_terms' floats; NULL: none)
    const half_t *s, *zh;       // float16 scales s [ng] and zeros zh (Q4_1, Q5_1)
    float c;                    // the implicit zero's factor (Q4_0: -8, Q5_0: -16) times s
    const uint8_t *kp;          // the K-quants' packed bytes [ng / 8][12] with d, dm [ng / 8] (dm NULL: no mins)
    const half_t *d, *dm;
} rowterms_t;

#ifdef __AVX2__
// The terms' sources (SK, ZK) of the two-row kernels, formed in their loops as they go (q4x8_row2_h says which):
// group g's scale product
#define TERMS_SCALE(t, SK, g, k8) ((SK) == 1 ? f16_to_f32((t).s[g]) * xs[g] : (SK) == 2 ? (k8)[(g) & 7] : (t).f[g])

// At group g of a two-row loop (g a multiple of its step, 2 or 4): where eight groups begin, a K-quant super-block's
// products into k8 (and its mins into z8), or the float16 zeros of the eight into z8 (zero_terms' order: the groups
// past the last eight are zero_tail_h's)
static inline void terms_step(rowterms_t t, const float *xs, const float *sums, int SK, int ZK, int g, int ng,
                              float *k8, __m256 *z8) {
    if (g & 7) return;
    if (SK == 2) {
        __m256 zr;
        _mm256_storeu_ps(k8, k_terms8(t.kp + 12 * (g / 8), t.d[g / 8], ZK == 4 ? t.dm + g / 8 : NULL, xs + g, &zr));
        if (ZK == 4) *z8 = _mm256_fmadd_ps(zr, _mm256_loadu_ps(sums + g), *z8);
    }
    if ((ZK == 2 || ZK == 3) && g + 8 <= ng) *z8 = zero8_h(ZK == 2 ? t.s : t.zh, ZK, t.c, sums, g, *z8);
}

// A two-row kernel's end: the chains' sum and the zeros (ZK 1: zero_terms of t.z; 2, 3: z8 and zero_tail_h; 4: z8)
static inline float terms_join(__m256 sum, rowterms_t t, const float *sums, int ZK, int ng, __m256 z8) {
    float tail = 0.f;
    if (ZK == 2 || ZK == 3) tail = zero_tail_h(ZK == 2 ? t.s : t.zh, ZK, t.c, sums, ng);
    else if (ZK != 4) z8 = zero_terms(ZK ? t.z : NULL, sums, ng, &tail);
    return hsum8(_mm256_add_ps(sum, z8)) + tail;
}

// The two-row kernels for each source of terms, the fifth bits' branch out of the loop: ROW2_FNS(prefix, body)
// defines prefix (terms formed before), prefix_q4_0 (Q4_0, Q5_0), prefix_q4_1 (Q4_1, Q5_1), prefix_f16 (float16
// scales alone) and prefix_k (Q4_K, Q5_K), each calling body(H, SK, ZK) with constants.
#define ROW2_FN(name, body, SK, ZK) \
    static __attribute__((noinline)) void name(const uint8_t *ra, const uint8_t *rb, const uint8_t *ha, \
            const uint8_t *hb, const rowterms_t *pta, const rowterms_t *ptb, const float *xs, const void *x, \
            const float *sums, int ng, float *out) { \
        const rowterms_t ta = *pta, tb = *ptb;      /* by address: no 128 bytes copied onto the stack a call */ \
        if (ha) body(1, SK, ZK); \
        else body(0, SK, ZK); \
    }
#define ROW2_FNS(prefix, body) \
    ROW2_FN(prefix, body, 0, 1) ROW2_FN(prefix##_q4_0, body, 1, 2) ROW2_FN(prefix##_q4_1, body, 1, 3) \
    ROW2_FN(prefix##_f16, body, 1, 0) ROW2_FN(prefix##_k, body, 2, 4)


// One step of a decode matvec's loop over weight rows n and b (n + 1, or n for an odd last row): their terms set out
// for the two-row kernels `prefix` (ROW2_FNS) and the kernel called; fa, fb, za, zb: room for terms formed before
#define ROW2_CALL(prefix, ra, rb, ha, hb, x) do { \
        rowterms_t ta = {0}, tb = {0}; \
        if (kind == 1 || kind == 4) { \
            const half_t *s16 = (const half_t *)scale, *z16 = (const half_t *)zero; \
            ta.s = s16 + (size_t)n * ng, tb.s = s16 + (size_t)b * ng; \
            ta.c = tb.c = high ? -16.f : -8.f; \
            if (kind == 4) prefix##_q4_0(ra, rb, ha, hb, &ta, &tb, xs, x, sums, ng, out); \
            else if (z16) { \
                ta.zh = z16 + (size_t)n * ng, tb.zh = z16 + (size_t)b * ng; \
                prefix##_q4_1(ra, rb, ha, hb, &ta, &tb, xs, x, sums, ng, out); \
            } else prefix##_f16(ra, rb, ha, hb, &ta, &tb, xs, x, sums, ng, out); \
        } else if (kind == 5 && zero) { \
            size_t nb = (size_t)ng / 8; \
            ta.kp = (const uint8_t *)scale + n * nb * 12, tb.kp = (const uint8_t *)scale + b * nb * 12; \
            ta.d = (const half_t *)ssup + n * nb, tb.d = (const half_t *)ssup + b * nb; \
            ta.dm = (const half_t *)zsup + n * nb, tb.dm = (const half_t *)zsup + b * nb; \
            prefix##_k(ra, rb, ha, hb, &ta, &tb, xs, x, sums, ng, out); \
        } else { \
            float sa_[MAXG], sb_[MAXG]; \
            const float *sca = row_f32(scale, ssup, per, n, ng, kind, sa_); \
            const float *scb = row_f32(scale, ssup, per, b, ng, kind, sb_); \
            ta.z = row_zero(zero, zsup, per, n, ng, kind, sca, za, high); \
            tb.z = row_zero(zero, zsup, per, b, ng, kind, scb, zb, high); \
            scale_products(sca, xs, ng, 1, fa); \
            scale_products(scb, xs, ng, 1, fb); \
            ta.f = fa, tb.f = fb; \
            prefix(ra, rb, ha, hb, &ta, &tb, xs, x, sums, ng, out); \
        } \
    } while (0)
#endif

// The scales (and zeros, and super-block scales) of rows n and n + 1 fetched PF_ROWS rows ahead into L2, as the
// two-row kernels fetch the codes: they are streams of their own (a Q4_K row's 144 bytes of packed scales).
static inline void prefetch_scales(const void *scale, const void *zero, const void *ssup, const void *zsup, int kind,
                                   int per, size_t n, int ng) {
    size_t row = n + PF_ROWS;
    size_t bytes = kind == 5 ? (size_t)ng / 8 * 12 : kind == 1 || kind == 4 ? (size_t)ng * 2
                 : kind == 0 ? (size_t)ng * 4 : (size_t)ng;
    for (size_t o = row * bytes; o < (row + 2) * bytes; o += 64) {
        _mm_prefetch((const char *)scale + o, _MM_HINT_T1);
        if (zero && zero != scale) _mm_prefetch((const char *)zero + o, _MM_HINT_T1);
    }
    if (kind == 2 || kind == 3 || kind == 5) {      // the super-blocks' floats (2, 3) or halves (5)
        size_t sb = (size_t)ng / per * (kind == 5 ? 2 : 4);
        _mm_prefetch((const char *)ssup + row * sb, _MM_HINT_T1);
        if (zsup) _mm_prefetch((const char *)zsup + row * sb, _MM_HINT_T1);
    }
}

static inline __m256i q8_half(const int8_t *w, const int16_t *v) {
    // 16 int8 codes against 16 int16 activations -> 8 int32 partial sums
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)),
                             _mm256_loadu_si256((const __m256i *)v));
}

static float q8_row1(const int8_t *row, const float *sc, const float *zr, int G, const int16_t *xq, const float *xs,
                     const float *sums32, int nx) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int g = 0; g < nx; g++) {
        if (!(g & 1)) _mm_prefetch((const char *)(row + g * 32 + PREFETCH), _MM_HINT_T0);
        __m256i p0 = q8_half(row + g * 32, xq + g * 32), p1 = q8_half(row + g * 32 + 16, xq + g * 32 + 16);
        if (G == 32) {
            __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
            if (g & 1) a1 = _mm256_fmadd_ps(f, _mm256_set1_ps(sc[g] * xs[g]), a1);
            else a0 = _mm256_fmadd_ps(f, _mm256_set1_ps(sc[g] * xs[g]), a0);
        } else {
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(sc[2 * g] * xs[g]), a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(sc[2 * g + 1] * xs[g]), a1);
        }
    }
    float tail = 0.f;
    __m256 z = zr && G == 32 ? zero_terms(zr, sums32, nx, &tail) : _mm256_setzero_ps();
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), z)) + tail;
}

// q8_row1 (G == 32) for one row of x against two weight rows at once: each row's sums in its own order
// (even groups in a0, odd in a1), the four chains side by side. fa, fb: the scale products sc[g] * xs[g].
static inline __attribute__((always_inline)) void q8_row2_h(const int8_t *ra, const int8_t *rb, const float *fa,
        const float *fb, const half_t *sa, const half_t *sb, const float *xs, const float *za, const float *zb,
        const int16_t *xq, const float *sums32, int nx, float *out) {
#define FA(g) (sa ? f16_to_f32(sa[g]) * xs[g] : fa[g])
#define FB(g) (sb ? f16_to_f32(sb[g]) * xs[g] : fb[g])
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    const long pf = PF_ROWS * 32L * nx;
    int g = 0;
    for (; g + 2 <= nx; g += 2) {
        _mm_prefetch((const char *)(ra + g * 32 + pf), PF_HINT);
        _mm_prefetch((const char *)(rb + g * 32 + pf), PF_HINT);
        const int16_t *v = xq + g * 32;
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(q8_half(ra + g * 32, v), q8_half(ra + g * 32 + 16, v + 16))),
                             _mm256_set1_ps(FA(g)), a0);
        b0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(q8_half(rb + g * 32, v), q8_half(rb + g * 32 + 16, v + 16))),
                             _mm256_set1_ps(FB(g)), b0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(q8_half(ra + g * 32 + 32, v + 32),
                                                                 q8_half(ra + g * 32 + 48, v + 48))),
                             _mm256_set1_ps(FA(g + 1)), a1);
        b1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(q8_half(rb + g * 32 + 32, v + 32),
                                                                 q8_half(rb + g * 32 + 48, v + 48))),
                             _mm256_set1_ps(FB(g + 1)), b1);
    }
    if (g < nx) {       // an odd number of groups: the last one is even, a0's
        const int16_t *v = xq + g * 32;
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(q8_half(ra + g * 32, v), q8_half(ra + g * 32 + 16, v + 16))),
                             _mm256_set1_ps(FA(g)), a0);
        b0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(q8_half(rb + g * 32, v), q8_half(rb + g * 32 + 16, v + 16))),
                             _mm256_set1_ps(FB(g)), b0);
    }
    float tail = 0.f;
    __m256 z = za ? zero_terms(za, sums32, nx, &tail) : _mm256_setzero_ps();
    out[0] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), z)) + tail;
    tail = 0.f;
    z = zb ? zero_terms(zb, sums32, nx, &tail) : _mm256_setzero_ps();
    out[1] = hsum8(_mm256_add_ps(_mm256_add_ps(b0, b1), z)) + tail;
#undef FA
#undef FB
}

static __attribute__((noinline)) void q8_row2(const int8_t *ra, const int8_t *rb, const float *fa, const float *fb,
        const float *za, const float *zb, const int16_t *xq, const float *sums32, int nx, float *out) {
    q8_row2_h(ra, rb, fa, fb, NULL, NULL, NULL, za, zb, xq, sums32, nx, out);
}

// Q8_0 (float16 scales, no zeros): the scale products formed in the loop
static __attribute__((noinline)) void q8_row2_f16(const int8_t *ra, const int8_t *rb, const half_t *sa,
        const half_t *sb, const float *xs, const int16_t *xq, const float *sums32, int nx, float *out) {
    q8_row2_h(ra, rb, NULL, NULL, sa, sb, xs, NULL, NULL, xq, sums32, nx, out);
}


// The same for int8 codes, mirroring q8_row1 (which serves G == 32, or G == 16 without zeros).
static void q8_rowsM(const int8_t *row, const float *sc, const float *zr, int G, const int16_t *xq, const float *xs,
                     const float *sums32, int nx, int K, int M, float *out) {
    __m256 a0[MAXM], a1[MAXM];
    for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    for (int g = 0; g < nx; g++) {
        if (!(g & 1)) _mm_prefetch((const char *)(row + g * 32 + PREFETCH), _MM_HINT_T0);
        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + g * 32)));
        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + g * 32 + 16)));
        for (int m = 0; m < M; m++) {
            const int16_t *v = xq + (size_t)m * K + g * 32;
            __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)v));
            __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(v + 16)));
            float sx = xs[m * nx + g];
            if (G == 32) {
                __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
                if (g & 1) a1[m] = _mm256_fmadd_ps(f, _mm256_set1_ps(sc[g] * sx), a1[m]);
                else a0[m] = _mm256_fmadd_ps(f, _mm256_set1_ps(sc[g] * sx), a0[m]);
            } else {
                a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(sc[2 * g] * sx), a0[m]);
                a1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(sc[2 * g + 1] * sx), a1[m]);
            }
        }
    }
    for (int m = 0; m < M; m++) {
        float tail = 0.f;
        __m256 z = zr && G == 32 ? zero_terms(zr, sums32 + (size_t)m * nx, nx, &tail) : _mm256_setzero_ps();
        out[m] = hsum8(_mm256_add_ps(_mm256_add_ps(a0[m], a1[m]), z)) + tail;
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KVCHAT_AVX512 1     // the matvecs below take their 512-bit twins, same bits (cpu_avx512.h)
#include "cpu_avx512.h"
#endif

// The activations a matvec reads: x prepared (mode) and quantized to int16 per group of 32, so inner
// products are integer multiply-adds (16 per instruction on AVX2) with one float multiply-add per
// group. scratch: 6 * M * K bytes + 2 * M * K / 32 floats (mode 0: 2 * M * K bytes + the floats), carved into
// the pieces returned.
static void activations(const float *x, int M, int K, int mode, const float *norm_w, float eps, void *scratch,
                        int16_t **xq, float **xs, float **sums) {
    float *buf = (float *)scratch;
    *xq = (int16_t *)(mode ? buf + (size_t)M * K : buf);      // mode 0 prepares nothing: no float rows
    *xs = (float *)(*xq + (size_t)M * K);
    *sums = *xs + (size_t)M * (K / 32);
    quantize_x(prep(x, M, K, mode, norm_w, eps, buf), M, K, *xq, *xs, *sums);
}

#if !defined(__AVX2__)
// The builds without AVX2: the integer dot products of 32 codes with 32 int16 activations, exact (so the same as
// the plain loops they replace, bit for bit), on SSE2 where the build has it (every x86-64 CPU does).
static inline int q4_dot32(const uint8_t *b, const int16_t *v) {
#ifdef __SSE2__
    __m128i w = _mm_loadu_si128((const __m128i *)b), z = _mm_setzero_si128(), m = _mm_set1_epi16(0x0F);
    __m128i lo = _mm_unpacklo_epi8(w, z), hi = _mm_unpackhi_epi8(w, z);     // bytes 0-7 and 8-15, 16 bits each
    __m128i s = _mm_add_epi32(_mm_madd_epi16(_mm_and_si128(lo, m), _mm_loadu_si128((const __m128i *)v)),
                              _mm_madd_epi16(_mm_and_si128(hi, m), _mm_loadu_si128((const __m128i *)(v + 8))));
    s = _mm_add_epi32(s, _mm_madd_epi16(_mm_srli_epi16(lo, 4), _mm_loadu_si128((const __m128i *)(v + 16))));
    s = _mm_add_epi32(s, _mm_madd_epi16(_mm_srli_epi16(hi, 4), _mm_loadu_si128((const __m128i *)(v + 24))));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
#else
    int d = 0;
    for (int j = 0; j < 16; j++) d += (b[j] & 15) * v[j] + (b[j] >> 4) * v[j + 16];
    return d;
#endif
}

// q5: the fifth bits' part of a group's dot product, 16 * the activations where the bit is set (exact)
static inline int q5_dot_high(uint32_t bits, const int16_t *v) {
    int d = 0;
    for (; bits; bits &= bits - 1) d += v[__builtin_ctz(bits)];
    return 16 * d;
}

static inline int q8_dot(const int8_t *w, const int16_t *v, int n) {
    int j = 0, d = 0;
#ifdef __SSE2__
    __m128i s = _mm_setzero_si128(), z = _mm_setzero_si128();
    for (; j + 16 <= n; j += 16) {
        __m128i c = _mm_loadu_si128((const __m128i *)(w + j)), sign = _mm_cmpgt_epi8(z, c);
        s = _mm_add_epi32(s, _mm_madd_epi16(_mm_unpacklo_epi8(c, sign), _mm_loadu_si128((const __m128i *)(v + j))));
        s = _mm_add_epi32(s, _mm_madd_epi16(_mm_unpackhi_epi8(c, sign), _mm_loadu_si128((const __m128i *)(v + j + 8))));
    }
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    d = _mm_cvtsi128_si32(s);
#endif
    for (; j < n; j++) d += w[j] * v[j];
    return d;
}
#endif

#include "cpu_act8.h"

// y: [M, ldy] (ldy >= N: one part of a concatenated output); resid [M, N]. mode: the prep, with ACT8 for int8
// activations (gemv8)
static void q4_gemv_ld(const float *x, int M, int K, const uint8_t *codes, const void *scale, const void *zero,
                       int N, float *y, int ldy, void *scratch, int mode, const float *norm_w, float eps,
                       const float *resid, int kind, const float *ssup, const float *zsup, int per,
                       const uint8_t *high) {
    if (mode & ACT8) {
        gemv8(x, M, K, codes, 4, scale, zero, N, y, ldy, scratch, mode & ~ACT8, norm_w, eps, resid, kind, ssup, zsup, per,
              high);
        return;
    }
    int ng = K / 32;
    int16_t *xq;
    float *xs, *sums;
    activations(x, M, K, mode, norm_w, eps, scratch, &xq, &xs, &sums);
#ifdef __AVX2__
    // the four-lane loops of the int8 rows (cpu_act8.h) over two byte planes: the laid-out rows (2 M K bytes) where
    // the prepared float rows were (mode), or after activations()'s pieces
    int8_t *xl = mode ? (int8_t *)scratch : (int8_t *)(sums + (size_t)M * ng);
    quad_layout16(xq, M, K, xl);
    gemv_q4x(xl, 16, xs, sums, M, K, codes, scale, zero, N, y, ldy, resid, kind, ssup, zsup, per, high);
#else
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = codes + (size_t)n * (K / 2), *hrow = high ? high + (size_t)n * (K / 8) : NULL;
        float sbuf[MAXG], zbuf[MAXG];
        const float *sc = row_f32(scale, ssup, per, n, ng, kind, sbuf);
        const float *zr = row_zero(zero, zsup, per, n, ng, kind, sc, zbuf, high);
        float out[MAXM];
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int g = 0; g < ng; g++) {
            const uint8_t *b = row + g * 16;
            for (int m = 0; m < M; m++) {
                const int16_t *v = xq + (size_t)m * K + g * 32;
                int d = q4_dot32(b, v) + (hrow ? q5_dot_high(q5_bits(hrow, g), v) : 0);
                out[m] += sc[g] * xs[m * ng + g] * (float)d;
            }
        }
        for (int m = 0; m < M; m++) {
            float z = 0.f;
            const float *sm = sums + (size_t)m * ng;
            for (int g = 0; zr && g < ng; g++) z += zr[g] * sm[g];
            y[(size_t)m * ldy + n] = out[m] + z + (resid ? resid[(size_t)m * N + n] : 0.f);
        }
    }
#endif
}

static void q8_gemv_ld(const float *x, int M, int K, const int8_t *codes, const void *scale, const void *zero, int G,
                       int N, float *y, int ldy, void *scratch, int mode, const float *norm_w, float eps,
                       const float *resid, int kind, const float *ssup, const float *zsup, int per) {
    // G is 16 or 32; zero may be NULL (symmetric); scratch as for q4_gemv. Groups of 16 keep int16 activations.
    if (mode & ACT8) {
        if (G == 32) {
            gemv8(x, M, K, codes, 8, scale, zero, N, y, ldy, scratch, mode & ~ACT8, norm_w, eps, resid, kind, ssup,
                  zsup, per, NULL);
            return;
        }
        mode &= ~ACT8;
    }
    int ng = K / G, nx = K / 32;
    int16_t *xq;
    float *xs, *sums32;
    activations(x, M, K, mode, norm_w, eps, scratch, &xq, &xs, &sums32);
#ifdef KVCHAT_AVX512
    const int16_t *xp = G == 32 ? q4_pair_layout(xq, M, K, mode, scratch, sums32) : xq;      // as the rows read
#elif defined(__AVX2__)
    const int16_t *xp = xq;
#endif
#ifdef __AVX2__
    if (M == 1 && G == 32) {        // decode: two weight rows a step (q8_row2, q8_row2_512), as q4_gemv_ld
        SHARED_STEPS((N + 1) / 2, SHARE_ROWS / 2, p) {
            int n = 2 * p, b = n + 1 < N ? n + 1 : n;      // an odd last row: computed twice, stored once
            float fa[MAXG], fb[MAXG], zba[MAXG], zbb[MAXG], out[2];
            const float *za, *zb;
            prefetch_scales(scale, zero, ssup, zsup, kind, per, (size_t)n, nx);
            if (kind == 1 && !zero) {           // Q8_0: the scale products formed in the loop
                const half_t *s16 = (const half_t *)scale;
#ifdef KVCHAT_AVX512
                q8_row2_512_f16(
#else
                q8_row2_f16(
#endif
                    codes + (size_t)n * K, codes + (size_t)b * K, s16 + (size_t)n * nx, s16 + (size_t)b * nx, xs, xp,
                    sums32, nx, out);
                y[n] = out[0] + (resid ? resid[n] : 0.f);
                if (b != n) y[b] = out[1] + (resid ? resid[b] : 0.f);
                continue;
            } else if (kind == 1) {
                za = f16_row_terms(scale, zero, kind, NULL, xs, n, nx, fa, zba);
                zb = f16_row_terms(scale, zero, kind, NULL, xs, b, nx, fb, zbb);
            } else {
                float sa[MAXG], sb[MAXG];
                const float *sca = row_f32(scale, ssup, per, n, nx, kind, sa), *scb = row_f32(scale, ssup, per, b, nx, kind, sb);
                za = row_f32(zero, zsup, per, n, nx, kind, zba);
                zb = row_f32(zero, zsup, per, b, nx, kind, zbb);
                scale_products(sca, xs, nx, 1, fa);
                scale_products(scb, xs, nx, 1, fb);
            }
#ifdef KVCHAT_AVX512
            q8_row2_512(codes + (size_t)n * K, codes + (size_t)b * K, fa, fb, za, zb, xp, sums32, nx, out);
#else
            q8_row2(codes + (size_t)n * K, codes + (size_t)b * K, fa, fb, za, zb, xp, sums32, nx, out);
#endif
            y[n] = out[0] + (resid ? resid[n] : 0.f);
            if (b != n) y[b] = out[1] + (resid ? resid[b] : 0.f);
        }
        return;
    }
#endif
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *row = codes + (size_t)n * K;
        float sbuf[MAXG], zbuf[MAXG];
        const float *sc = row_f32(scale, ssup, per, n, ng, kind, sbuf);
        const float *zrow = row_f32(zero, zsup, per, n, ng, kind, zbuf);
        float out[MAXM];
#ifdef __AVX2__
#ifdef KVCHAT_AVX512
        if (M > 1 && (!zero || G == 32)) {      // one row: the AVX2 loop below is faster (one chain either way)
            q8_rowsM_512(row, sc, zrow, G, xp, xs, sums32, nx, K, M, out);
            for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
            continue;
        }
#endif
        if (M == 1 && (!zero || G == 32)) {
            y[n] = q8_row1(row, sc, zrow, G, xq, xs, sums32, nx) + (resid ? resid[n] : 0.f);
            continue;
        }
        if (!zero || G == 32) {
            q8_rowsM(row, sc, zrow, G, xq, xs, sums32, nx, K, M, out);
            for (int m = 0; m < M; m++) y[(size_t)m * ldy + n] = out[m] + (resid ? resid[(size_t)m * N + n] : 0.f);
            continue;
        }
        __m256 acc[MAXM];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int g32 = 0; g32 < nx; g32++) {
            __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + g32 * 32)));
            __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + g32 * 32 + 16)));
            float s0 = G == 32 ? sc[g32] : sc[2 * g32], s1 = G == 32 ? sc[g32] : sc[2 * g32 + 1];
            for (int m = 0; m < M; m++) {
                const int16_t *v = xq + (size_t)m * K + g32 * 32;
                __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)v));
                __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(v + 16)));
                float sx = xs[m * nx + g32];
                __m256 f;
                if (G == 32)
                    f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(s0 * sx));
                else
                    f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(s0 * sx),
                                        _mm256_mul_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(s1 * sx)));
                acc[m] = _mm256_add_ps(acc[m], f);
            }
        }
        for (int m = 0; m < M; m++) out[m] = hsum8(acc[m]);
#else
        for (int m = 0; m < M; m++) out[m] = 0.f;
        for (int g = 0; g < ng; g++)
            for (int m = 0; m < M; m++) {
                int d = q8_dot(row + g * G, xq + (size_t)m * K + g * G, G);
                out[m] += sc[g] * xs[m * nx + g * G / 32] * (float)d;
            }
#endif
        for (int m = 0; m < M; m++) {
            float z = 0.f;
            if (zero) {   // sums over groups of G of the quantized x
                const float *zr = zrow;
                const int16_t *xr = xq + (size_t)m * K;
                if (G == 32)
                    for (int g = 0; g < ng; g++) z += zr[g] * sums32[m * nx + g];
                else
                    for (int g = 0; g < ng; g++) {
                        int s = 0;
                        for (int j = 0; j < G; j++) s += xr[g * G + j];
                        z += zr[g] * xs[m * nx + g * G / 32] * (float)s;
                    }
            }
            y[(size_t)m * ldy + n] = out[m] + z + (resid ? resid[(size_t)m * N + n] : 0.f);
        }
    }
}

void q4_gemv(const float *x, int M, int K, const uint8_t *codes, const void *scale, const void *zero,
             int N, float *y, void *scratch, int mode, const float *norm_w, float eps, const float *resid, int kind,
             const float *ssup, const float *zsup, int per, const uint8_t *high) {
    q4_gemv_ld(x, M, K, codes, scale, zero, N, y, N, scratch, mode, norm_w, eps, resid, kind, ssup, zsup, per, high);
}

void q8_gemv(const float *x, int M, int K, const int8_t *codes, const void *scale, const void *zero, int G,
             int N, float *y, void *scratch, int mode, const float *norm_w, float eps, const float *resid, int kind,
             const float *ssup, const float *zsup, int per) {
    q8_gemv_ld(x, M, K, codes, scale, zero, G, N, y, N, scratch, mode, norm_w, eps, resid, kind, ssup, zsup, per);
}

// n floats to bf16, rounded to nearest even as torch rounds (NaN kept a NaN): to_bf16, eight at a time
static inline void store_bf16(const float *x, uint16_t *o, int n) {
    int j = 0;
#ifdef __AVX512BF16__
    // one instruction rounds 16 to nearest even, as below; it reads subnormal inputs as 0, so a vector holding one
    // (no weight of a real file: the smallest is a code times a float16 scale) takes the exact loop
    const __m512 tiny = _mm512_set1_ps(1.17549435e-38f);
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j), a = _mm512_abs_ps(v);
        if (_mm512_cmp_ps_mask(a, tiny, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ)) break;
        if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;          // NaN: the exact loop's quiet NaN
        _mm256_storeu_si256((__m256i *)(o + j), (__m256i)_mm512_cvtneps_pbh(v));
    }
#endif
#ifdef __AVX2__
    const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; j + 16 <= n; j += 16) {
        __m256i r[2];
        for (int h = 0; h < 2; h++) {
            __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + j + 8 * h));
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i up = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
            __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
            r[h] = _mm256_blendv_epi8(up, quiet, nan);
        }
        // packus interleaves 128-bit lanes: put them back in order
        _mm256_storeu_si256((__m256i *)(o + j), _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8));
    }
#endif
    for (; j < n; j++) o[j] = to_bf16(x[j]);
}

// Dequantization into float32 (out) or, for bf16 prefill, bf16 (out16: each value as torch's .bfloat16() of the
// float32 one)
static void q4_dequant_to(const uint8_t *codes, const void *scale, const void *zero, int N, int K, float *out,
                          uint16_t *out16, int kind, const float *ssup, const float *zsup, int per,
                          const uint8_t *high) {
    int ng = K / 32;
    #pragma omp parallel for schedule(static) if (N > 1)     // one row (an embedding lookup): no team
    for (int n = 0; n < N; n++) {
        float sbuf[MAXG], zbuf[MAXG];
        const float *sr = row_f32(scale, ssup, per, n, ng, kind, sbuf);
        const float *zrr = row_zero(zero, zsup, per, n, ng, kind, sr, zbuf, high);
        const uint8_t *hrow = high ? high + (size_t)n * (K / 8) : NULL;
        for (int g = 0; g < ng; g++) {
            const uint8_t *b = codes + (size_t)n * (K / 2) + g * 16;
            uint32_t hb = hrow ? q5_bits(hrow, g) : 0;
            float s = sr[g], z = zrr[g], tmp[32];
            float *o = out16 ? tmp : out + (size_t)n * K + g * 32;
#if defined(KVCHAT_AVX512)
            // the AVX2 loop below 16 at a time, the fifth bits added under a mask (1.6x faster for Gemma's Q5_0)
            __m128i x = _mm_loadu_si128((const __m128i *)b), m = _mm_set1_epi8(15);
            __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(x, m)),
                                                _mm_and_si128(_mm_srli_epi16(x, 4), m), 1);     // element order
            q = _mm256_mask_add_epi8(q, (__mmask32)hb, q, _mm256_set1_epi8(16));
            __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q))), sv), zv));
            _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1))), sv), zv));
#elif defined(__AVX2__)
            // code * scale, then + zero: two roundings, as the scalar loop (and torch) does; a fifth bit as 16
            __m128i x = _mm_loadu_si128((const __m128i *)b), m = _mm_set1_epi8(15);
            __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
            if (hb) {
                const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
                const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
                __m128i bl = _mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)(hb & 0xFFFF)), spread), sel);
                __m128i bh = _mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)(hb >> 16)), spread), sel);
                lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(bl, sel), _mm_set1_epi8(16)));
                hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(bh, sel), _mm_set1_epi8(16)));
            }
            __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), sv), zv));
#else
            for (int j = 0; j < 16; j++) {
                o[j] = (float)((b[j] & 15) | ((hb >> j) & 1) << 4) * s + z;
                o[j + 16] = (float)((b[j] >> 4) | ((hb >> (j + 16)) & 1) << 4) * s + z;
            }
#endif
            if (out16) store_bf16(tmp, out16 + (size_t)n * K + g * 32, 32);
        }
    }
}

void q4_dequant(const uint8_t *codes, const void *scale, const void *zero, int N, int K, float *out, int kind,
                const float *ssup, const float *zsup, int per, const uint8_t *high) {
    q4_dequant_to(codes, scale, zero, N, K, out, NULL, kind, ssup, zsup, per, high);
}

void q4_dequant_bf16(const uint8_t *codes, const void *scale, const void *zero, int N, int K, uint16_t *out,
                     int kind, const float *ssup, const float *zsup, int per, const uint8_t *high) {
    q4_dequant_to(codes, scale, zero, N, K, NULL, out, kind, ssup, zsup, per, high);
}

static void q8_dequant_to(const int8_t *codes, const void *scale, const void *zero, int G, int N, int K, float *out,
                          uint16_t *out16, int kind, const float *ssup, const float *zsup, int per) {
    int ng = K / G;
    #pragma omp parallel for schedule(static) if (N > 1)
    for (int n = 0; n < N; n++) {
        float sbuf[MAXG], zbuf[MAXG];
        const float *sr = row_f32(scale, ssup, per, n, ng, kind, sbuf), *zrr = row_f32(zero, zsup, per, n, ng, kind, zbuf);
        for (int g = 0; g < ng; g++) {
            float s = sr[g], z = zrr ? zrr[g] : 0.f;
            const int8_t *b = codes + (size_t)n * K + g * G;
            float tmp[32];
            float *o = out16 ? tmp : out + (size_t)n * K + g * G;
            int j = 0;
#ifdef __AVX512F__
            __m512 sw = _mm512_set1_ps(s), zw = _mm512_set1_ps(z);
            for (; j + 16 <= G; j += 16)
                _mm512_storeu_ps(o + j, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + j)))), sw), zw));
#endif
#ifdef __AVX2__
            __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
            for (; j + 8 <= G; j += 8)
                _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + j)))), sv), zv));
#endif
            for (; j < G; j++) o[j] = b[j] * s + z;
            if (out16) store_bf16(tmp, out16 + (size_t)n * K + g * G, G);
        }
    }
}

void q8_dequant(const int8_t *codes, const void *scale, const void *zero, int G, int N, int K, float *out, int kind,
                const float *ssup, const float *zsup, int per) {
    q8_dequant_to(codes, scale, zero, G, N, K, out, NULL, kind, ssup, zsup, per);
}

void q8_dequant_bf16(const int8_t *codes, const void *scale, const void *zero, int G, int N, int K, uint16_t *out,
                     int kind, const float *ssup, const float *zsup, int per) {
    q8_dequant_to(codes, scale, zero, G, N, K, NULL, out, kind, ssup, zsup, per);
}

#ifdef __AVX2__
#include "cpu_gemm8.h"      // prompt rows with int8 activations, a weight row a lane (prefill="int8")
#endif

// Prompt rows x [T, K] against q4 / q5 (bits 4, high) or q8 (bits 8, groups of 32) codes with int8 activations
// -> y [T, N]. 0 done; 1 this build has no such kernel (it needs AVX2); 2 out of memory.
int gemm8_rows(const float *x, int T, int K, const void *codes, int bits, const uint8_t *high, const void *scale,
               const void *zero, int N, float *y, int kind, const float *ssup, const float *zsup, int per) {
#ifdef __AVX2__
    return gemm8(x, T, K, codes, bits, high, scale, zero, kind, ssup, zsup, per, N, y);
#else
    (void)x; (void)T; (void)K; (void)codes; (void)bits; (void)high; (void)scale; (void)zero; (void)N; (void)y;
    (void)kind; (void)ssup; (void)zsup; (void)per;
    return 1;
#endif
}

// Prompt rows x [T, K] against Q6_K rows (cpu_q6k.h's arrays) with int8 activations -> y [T, N]: gemm8_rows' codes.
int gemm8_q6k_rows(const float *x, int T, int K, const uint8_t *ql, const uint8_t *qh, const int8_t *sc,
                   const half_t *d, int N, float *y) {
#ifdef __AVX2__
    return gemm8_q6(x, T, K, ql, qh, sc, d, N, y);
#else
    (void)x; (void)T; (void)K; (void)ql; (void)qh; (void)sc; (void)d; (void)N; (void)y;
    return 1;
#endif
}

#include "cpu_q6k.h"        // GGUF Q6_K kept at its own 6.5625 bits a value (bits 6 in lin_apply)
#include "cpu_mxfp4.h"      // GGUF MXFP4 (gpt-oss's experts) at its own 4.25 bits a value
#define KIND_MXFP4 8        // a qlin_t of bits 4 and this kind is MXFP4 (lin_apply): scale holds its E8M0 exponents

// Decode attention of one new token over full-precision (fp32) pages, keys stored before RoPE.
// q: [Hq, D] before RoPE; qcos, qsin: [D] for the new token; pages k, v: [R, Hkv, D]; rows: [L] page
// rows of the slots attended (the new token's last); cos, sin: [L, D]. sin is sign-folded, so that
// rope(x) = x * cos + swap_halves(x) * sin. out: [Hq, D]; scratch: Hq * L floats. D <= 512, Hq / Hkv <= 8.
// Each key is rotated once in registers and shared by the g query heads of its group: nothing is
// re-rotated in memory and no [L, Hkv, D] temporaries are made.

static inline void load_row(const void *base, int64_t row, int bf16, int D, float *dst, const float **src) {
    // a page row as fp32: fp32 pages are read in place, bf16 pages widened (a 16-bit shift) into dst
    if (!bf16) { *src = (const float *)base + (size_t)row * D; return; }
    const uint16_t *s = (const uint16_t *)base + (size_t)row * D;
    for (int d = 0; d < D; d++) { union { uint32_t u; float f; } v; v.u = (uint32_t)s[d] << 16; dst[d] = v.f; }
    *src = dst;
}

// The weighted V sum of attn_span for NJ query heads (j0 .. j0 + NJ - 1 of kv head h) and dimensions [d0, d0 + 4
// vectors): o[d] = o[d] + w[p] * v[p][d] for p in [lo, hi) in order, a multiply and an add per element as the plain
// loop makes them (no contraction), with the sums held in registers across the span instead of stored every row.
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf_t;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VBF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VJ 4
#elif defined(__AVX2__)
#define VW 8
typedef __m256 vf_t;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VBF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VJ 2
#endif
// The decode attention's prefetches go to L2: into L1 they held a core to the fill buffers' few lines in flight (a
// quarter slower at 2,500 cached rows). Keys are asked for KEYS_AHEAD bytes on; values a tile on (span_values).
#define KEYS_AHEAD 4096
#ifdef VW
static inline __attribute__((always_inline)) void span_values_nj(const float *scores, int L, const void *vp, int bf16,
        const int64_t *rows, int Hkv, int h, int D, int d0, float *const *o, const int NJ, int lo, int hi, int end) {
    vf_t acc[VJ][4];
    for (int j = 0; j < NJ; j++)
        for (int k = 0; k < 4; k++) acc[j][k] = VLOAD(o[j] + d0 + k * VW);
    const int es = bf16 ? 2 : 4, ahead = hi - lo;
    for (int p = lo; p < hi; p++) {
        size_t at = ((size_t)rows[p] * Hkv + h) * D + d0;
#ifdef __SSE__
        if (p + ahead < end) {          // this chunk of the next tile's row, a tile's work before it is read
            const char *next = (const char *)vp + (((size_t)rows[p + ahead] * Hkv + h) * D + d0) * es;
            for (int c = 0; c < 4 * VW * es; c += 64) _mm_prefetch(next + c, _MM_HINT_T1);
        }
#endif
        vf_t v[4];
        for (int k = 0; k < 4; k++)
            v[k] = bf16 ? VBF16((const uint16_t *)vp + at + k * VW) : VLOAD((const float *)vp + at + k * VW);
        for (int j = 0; j < NJ; j++) {
            vf_t w = VSET1(scores[(size_t)j * L + p]);
            for (int k = 0; k < 4; k++) acc[j][k] = VADD(acc[j][k], VMUL(w, v[k]));
        }
    }
    for (int j = 0; j < NJ; j++)
        for (int k = 0; k < 4; k++) VSTORE(o[j] + d0 + k * VW, acc[j][k]);
}
#endif

// part[h * g + j][d] += the span's weighted values (the (D + 2)-float rows of attn_span), for every query head
static void span_values(const float *scores, int L, int Hkv, int g, int D, const void *vp, int bf16,
                        const int64_t *rows, float *part, int lo, int hi) {
    int dv = 0;
#ifdef VW
    dv = D - D % (4 * VW);          // whole chunks of four vectors here, the rest in the plain loop below
    // The span in tiles of about 16 KB of values, each (head, chunk) pass over a tile asking for its chunk of the next
    // tile's rows. A pass over the whole span, 4 * VW values of each row's Hkv * D, strides past the prefetchers, and
    // its own prefetch a few rows on kept few lines in flight: 8-12 GB/s where memory streams 28. The sums keep their
    // order (row by row, stored and reloaded between tiles): the same bits.
    const size_t row_bytes = (size_t)Hkv * D * (bf16 ? 2 : 4);
    const int tile = row_bytes >= 2048 ? 8 : (int)(16384 / row_bytes);
    for (int t0 = lo; t0 < hi; t0 += tile) {
        int t1 = t0 + tile < hi ? t0 + tile : hi;
        for (int h = 0; h < Hkv; h++)
            for (int j0 = 0; j0 < g; j0 += VJ) {
                float *o[VJ];
                int nj = g - j0 < VJ ? g - j0 : VJ;
                for (int j = 0; j < nj; j++) o[j] = part + (size_t)(h * g + j0 + j) * (D + 2);
                const float *sc = scores + (size_t)(h * g + j0) * L;
                for (int d0 = 0; d0 < dv; d0 += 4 * VW)
                    switch (nj) {       // a constant count per case: the sums stay in registers
                        case 1: span_values_nj(sc, L, vp, bf16, rows, Hkv, h, D, d0, o, 1, t0, t1, hi); break;
#if VJ > 2
                        case 2: span_values_nj(sc, L, vp, bf16, rows, Hkv, h, D, d0, o, 2, t0, t1, hi); break;
                        case 3: span_values_nj(sc, L, vp, bf16, rows, Hkv, h, D, d0, o, 3, t0, t1, hi); break;
#endif
                        default: span_values_nj(sc, L, vp, bf16, rows, Hkv, h, D, d0, o, VJ, t0, t1, hi); break;
                    }
            }
    }
#endif
    if (dv == D) return;
    float buf[512];
    const float *vr;
    for (int p = lo; p < hi; p++)
        for (int h = 0; h < Hkv; h++) {
            load_row(vp, rows[p] * Hkv + h, bf16, D, buf, &vr);
            for (int j = 0; j < g; j++) {
                float w = scores[(size_t)(h * g + j) * L + p], *o = part + (size_t)(h * g + j) * (D + 2);
                for (int d = dv; d < D; d++) o[d] += w * vr[d];
            }
        }
}

#ifdef __AVX2__
// One page row's scores for every query head (g of them a key head): each head's keys (bf16 or fp32, D a multiple of
// 16) read in place and shared by up to four of its queries at once, the sums dot_f32's exactly (two eight-lane
// chains: an AVX-512 register's halves, or two AVX2 registers), times sm_scale, to scores[i * L] for query head i.
static inline __attribute__((always_inline)) void row_scores_n(const float *q, const char *krow, int bf16, int h,
        int D, const int N, float sm_scale, float *scores, int L, int i0) {
    const float *qh = q + (size_t)i0 * D;
#ifdef KVCHAT_AVX512
    __m512 acc[4];
    for (int j = 0; j < N; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m512 k = bf16 ? VBF16((const uint16_t *)krow + (size_t)h * D + d)
                        : _mm512_loadu_ps((const float *)krow + (size_t)h * D + d);
        for (int j = 0; j < N; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + (size_t)j * D + d), k, acc[j]);
    }
    for (int j = 0; j < N; j++)
        scores[(size_t)(i0 + j) * L] = hsum8(_mm256_add_ps(low8(acc[j]), high8(acc[j]))) * sm_scale;
#else
    __m256 a0[4], a1[4];
    for (int j = 0; j < N; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        __m256 k0, k1;
        if (bf16) {
            const uint16_t *kb = (const uint16_t *)krow + (size_t)h * D + d;
            k0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)kb)), 16));
            k1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(kb + 8))), 16));
        } else {
            k0 = _mm256_loadu_ps((const float *)krow + (size_t)h * D + d);
            k1 = _mm256_loadu_ps((const float *)krow + (size_t)h * D + d + 8);
        }
        for (int j = 0; j < N; j++) {
            a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + (size_t)j * D + d), k0, a0[j]);
            a1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + (size_t)j * D + d + 8), k1, a1[j]);
        }
    }
    for (int j = 0; j < N; j++) scores[(size_t)(i0 + j) * L] = hsum8(_mm256_add_ps(a0[j], a1[j])) * sm_scale;
#endif
}

static void row_scores(const float *q, const char *krow, int bf16, int Hkv, int D, int g, float sm_scale,
                       float *scores, int L) {
    for (int h = 0; h < Hkv; h++)
        for (int j0 = 0; j0 < g; j0 += 4)
            switch (g - j0 < 4 ? g - j0 : 4) {      // a constant count per case: the sums stay in registers
                case 1: row_scores_n(q, krow, bf16, h, D, 1, sm_scale, scores, L, h * g + j0); break;
                case 2: row_scores_n(q, krow, bf16, h, D, 2, sm_scale, scores, L, h * g + j0); break;
                case 3: row_scores_n(q, krow, bf16, h, D, 3, sm_scale, scores, L, h * g + j0); break;
                default: row_scores_n(q, krow, bf16, h, D, 4, sm_scale, scores, L, h * g + j0); break;
            }
}
#endif

// One span [lo, hi) of one sequence's rows: scores (soft-capped where cap > 0: cap * tanh(s / cap), as attn_prompt
// caps them), their exp (sum and max kept), and the weighted V sum, into part (Hq x (D + 2): the sum over the span,
// then its max and its exp-sum).
static void attn_span(const float *q, const float *qs, int n_sink, int Hq, int Hkv, int D, const void *kp,
                      const void *vp, int bf16, const int64_t *rows, int L, float sm_scale, float cap, float *scores,
                      float *part, int lo, int hi) {
    int g = Hq / Hkv;
    float buf[512];
    const float *kr;
    const int es = bf16 ? 2 : 4;
    const int ahead = Hkv * D * es >= KEYS_AHEAD ? 1 : KEYS_AHEAD / (Hkv * D * es);
    for (int p = lo; p < hi; p++) {
        const float *qq = p < n_sink ? qs : q;
#ifdef __SSE__
        if (p + ahead < hi) {           // the keys KEYS_AHEAD bytes on, all heads (one page row)
            const char *next = (const char *)kp + (size_t)rows[p + ahead] * Hkv * D * es;
            for (int c = 0; c < Hkv * D * es; c += 64) _mm_prefetch(next + c, _MM_HINT_T1);
        }
#endif
#ifdef __AVX2__
        if (D % 16 == 0) {              // the keys read in place, not widened into buf first
            row_scores(qq, (const char *)kp + (size_t)rows[p] * Hkv * D * es, bf16, Hkv, D, g, sm_scale, scores + p, L);
            continue;
        }
#endif
        for (int h = 0; h < Hkv; h++) {
            load_row(kp, rows[p] * Hkv + h, bf16, D, buf, &kr);
            for (int j = 0; j < g; j++)
                scores[(size_t)(h * g + j) * L + p] = dot_f32(qq + (h * g + j) * D, kr, D) * sm_scale;
        }
    }
    for (int i = 0; i < Hq; i++) {
        float *si = scores + (size_t)i * L, mx = -INFINITY, sum = 0.f;
        float *o = part + (size_t)i * (D + 2);
        if (cap > 0.f)
            for (int p = lo; p < hi; p++) si[p] = cap * tanhf(si[p] / cap);
        for (int p = lo; p < hi; p++) mx = si[p] > mx ? si[p] : mx;
        if (hi > lo) sum = exp_span(si, lo, hi, mx);
        o[D] = mx;
        o[D + 1] = sum;
        for (int d = 0; d < D; d++) o[d] = 0.f;
    }
    span_values(scores, L, Hkv, g, D, vp, bf16, rows, part, lo, hi);
}

static inline int attn_spans(int L) { return L >= 256 ? 4 : L >= 64 ? 2 : 1; }

// Decode attention for B sequences at once (one new token each), over rotated fp32 or bf16 pages.
// Sequence b: q [Hq, D] at q + b * Hq * D (rotated at its new token's position), qs likewise for its
// first n_sink[b] rows (attention sinks, whose positions do not move with the window), its page rows
// rows[off[b] : off[b + 1]]. Each sequence's rows are cut into 1, 2 or 4 spans by its own length only
// and merged by log-sum-exp, so a sequence's output is the same bits whatever else is in the batch.
// sink_logits [Hq] (NULL: none): the layer's learned sink logits, joining each head's softmax at the merge.
// softcap > 0: the scores capped (Gemma 2), 0: as they are.
// mass (NULL: not measured): [B, Hq, mcols], where each sequence's row put its attention (spans_mass), its rows'
// columns at cols[off[b] : off[b + 1]].
// scratch: sum over b of (Hq * L_b + 4 * Hq * (D + 2)) floats.
void attn_decode_batch(int B, const float *q, const float *qs, const int *n_sink, int Hq, int Hkv, int D,
                       const void *kp, const void *vp, int bf16, const int64_t *rows, const int64_t *off,
                       float sm_scale, float softcap, const float *sink_logits, float *out, float *scratch,
                       const int *cols, int mcols, float *mass) {
    int total = 0;
    for (int b = 0; b < B; b++) total += attn_spans((int)(off[b + 1] - off[b]));
    #pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < total; t++) {
        int b = 0, first = 0;       // which sequence and span task t is
        while (t >= first + attn_spans((int)(off[b + 1] - off[b]))) first += attn_spans((int)(off[b + 1] - off[b])), b++;
        int L = (int)(off[b + 1] - off[b]), S = attn_spans(L), c = t - first;
        size_t base = 0;
        for (int i = 0; i < b; i++) base += (size_t)Hq * (off[i + 1] - off[i]) + 4 * (size_t)Hq * (D + 2);
        float *scores = scratch + base, *part = scores + (size_t)Hq * L + (size_t)c * Hq * (D + 2);
        int lo = (int)((long)L * c / S), hi = (int)((long)L * (c + 1) / S);
        attn_span(q + (size_t)b * Hq * D, qs + (size_t)b * Hq * D, n_sink[b], Hq, Hkv, D, kp, vp, bf16,
                  rows + off[b], L, sm_scale, softcap, scores, part, lo, hi);
    }
    size_t base = 0;
    for (int b = 0; b < B; b++) {
        int L = (int)(off[b + 1] - off[b]), S = attn_spans(L);
        merge_spans(scratch + base + (size_t)Hq * L, S, Hq, D, sink_logits, out + (size_t)b * Hq * D);
        if (mass)
            spans_mass(scratch + base, L, scratch + base + (size_t)Hq * L, S, Hq, D, sink_logits, cols + off[b],
                       mcols, mass + (size_t)b * Hq * mcols);
        base += (size_t)Hq * L + 4 * (size_t)Hq * (D + 2);
    }
}

void attn_decode_rot(const float *q, const float *qs, int n_sink, int Hq, int Hkv, int D,
                     const void *kp, const void *vp, int bf16, const int64_t *rows, int L,
                     float sm_scale, float *out, float *scratch) {
    // one sequence: the batch of one
    int64_t off[2] = {0, L};
    attn_decode_batch(1, q, qs, &n_sink, Hq, Hkv, D, kp, vp, bf16, rows, off, sm_scale, 0.f, NULL, out, scratch, NULL,
                      0, NULL);
}

#include "cpu_prompt_attn.h"  // prompt rows over full-precision pages (attn_prompt)

// ---- one decode token per sequence, from the projections to the attention output ----------------------

static inline void rope_full(const float *x, const float *c, const float *s, int D, float *o) {
    // rotate-half RoPE of one head: o = x * cos + rotate_half(x) * sin
    int h = D / 2;
    for (int d = 0; d < h; d++) o[d] = x[d] * c[d] + x[d + h] * -s[d];
    for (int d = h; d < D; d++) o[d] = x[d] * c[d] + x[d - h] * s[d];
}

// B sequences' new tokens: q, k, v rows (row b at q + b * ldq etc., keys before RoPE) are rotated at their
// positions (cos, sin [B, D]; scos, ssin the sinks' view of the query, or NULL when no sequence has
// sinks), the rotated key and the value are written to page rows new_rows[b] (fp32 or bf16 pages), and
// each sequence attends over its rows rows[off[b] : off[b + 1]] (the new row last), with the layer's sink
// logits [Hq] or NULL, the soft-cap (0: none) and mass as attn_decode_batch's (cols, mcols, mass: NULL, 0, NULL not
// measured). out: [B, Hq, D].
// Everything a sequence gets depends on that sequence only: the same bits alone or in any batch.
// scratch: 2 * B * Hq * D + (sum of Hq * L_b + 4 * Hq * (D + 2)) floats.
void decode_attend(int B, const float *q, const float *k, const float *v, int ldq, int ldk, int ldv, int Hq, int Hkv, int D,
                   const float *cos, const float *sin, const float *scos, const float *ssin, const int *n_sink,
                   void *kp, void *vp, int bf16, const int64_t *new_rows, const int64_t *rows, const int64_t *off,
                   float sm_scale, float softcap, const float *sink_logits, float *out, float *scratch, const int *cols,
                   int mcols, float *mass) {
    float *qr = scratch, *qs = scratch + (size_t)B * Hq * D;
    float kbuf[512];
    for (int b = 0; b < B; b++) {
        const float *c = cos + (size_t)b * D, *s = sin + (size_t)b * D;
        for (int h = 0; h < Hq; h++) {
            rope_full(q + (size_t)b * ldq + h * D, c, s, D, qr + ((size_t)b * Hq + h) * D);
            if (scos && n_sink[b])
                rope_full(q + (size_t)b * ldq + h * D, scos + (size_t)b * D, ssin + (size_t)b * D, D,
                         qs + ((size_t)b * Hq + h) * D);
        }
        size_t row = (size_t)new_rows[b] * Hkv * D;
        for (int h = 0; h < Hkv; h++) {
            rope_full(k + (size_t)b * ldk + h * D, c, s, D, kbuf);
            const float *vv = v + (size_t)b * ldv + h * D;
            if (bf16) {
                uint16_t *kd = (uint16_t *)kp + row + h * D, *vd = (uint16_t *)vp + row + h * D;
                for (int d = 0; d < D; d++) { kd[d] = to_bf16(kbuf[d]); vd[d] = to_bf16(vv[d]); }
            } else {
                memcpy((float *)kp + row + h * D, kbuf, sizeof(float) * D);
                memcpy((float *)vp + row + h * D, vv, sizeof(float) * D);
            }
        }
    }
    attn_decode_batch(B, qr, scos ? qs : qr, n_sink, Hq, Hkv, D, kp, vp, bf16, rows, off, sm_scale, softcap,
                      sink_logits, out, scratch + 2 * (size_t)B * Hq * D, cols, mcols, mass);
}

// ---- a whole decode step of the decoder layers in one call -------------------------------------------

// One packed linear, or one part of a concatenation (q | k | v of mixed GGUF types): bits 4 or 8.
typedef struct {
    const void *codes, *scale, *zero;
    const float *ssup, *zsup;
    int bits, kind, per, group, N, K;
    int act;                    // activation bits: 8 for int8 (gemv8), anything else int16
    const uint8_t *high;        // bits 4: q5's fifth bits [N, K/8], or NULL
    const float *bias;          // [N] added to the product before any residual (gpt-oss's q | k | v and o), or NULL
} qlin_t;

// One decoder layer: the four linears (qkv, o, gate_up, down), each up to 3 parts side by side.
typedef struct {
    qlin_t lin[4][3];
    int nparts[4];
    const float *norm_attn, *norm_mlp;
    const float *q_norm, *k_norm;        // Qwen3's RMSNorm of each q and k head before RoPE, [D] each; NULL: none
    const struct moe_s *moe;             // a routed MLP (cpu_moe.h) in place of gate_up / down; NULL: dense
    const struct shared_s *shared;       // a shared expert beside it (cpu_moe.h), or NULL
    const float *post_attn, *post_mlp;   // Gemma's RMSNorms of the attention's and the MLP's outputs; NULL: none
    int act;                             // the gate's activation: 0 SiLU (SwiGLU), 1 GELU with tanh (Gemma)
    int mix_in, mix_out;                 // > 0: the token mixer is the caller's (an attend callback: Qwen3.5's
                                         // Gated DeltaNet and gated attention), between projections of these widths
    const struct gdn_s *gdn;             // a Gated DeltaNet mixer run here (cpu_gdn.h) where the step brings its
    int state;                           // states (decode_layers_grouped), state `state` of them; else called back
    const int64_t *mix_order;            // [mix_out]: the mixer's outputs in the order o reads them (a GGUF's stored
                                         // columns), or NULL
    qlin_t ple[2];                       // Gemma 4's per-layer input after the MLP: gate [w, H] and proj [H, w], one
    const float *ple_norm;               // part each (N 0: none); x += RMSNorm(proj(gelu(gate(x)) * input)) * norm
    const float *scalar;                 // [1]: the layer's output times this (Gemma 4's layer scalar), or NULL
    int gate;                            // > 0: Qwen3.5's output gate, Hq * D wide, between q and k of the
                                         // projection (q | gate | k | v); the output times its sigmoid
    const float *beside[3];              // Gemma 4: the routed MLP (moe) beside the dense one (gate_up / down), the
                                         // dense output's norm, the experts' input norm, their output's norm (the
                                         // sum's is post_mlp: beside_rows); NULL: moe replaces the dense MLP
    int hd, kvh;                         // > 0 (Gemma 4): a mixer (mix_in, mix_out) C attends where the layer's group
                                         // holds pages, at the layer's own head size and KV heads (own_attention); a
                                         // callback group gets the raw projection and does the norms itself
    int vk, vnorm;                       // values taken from the keys (before their norm); values RMS-normed per head
    int keep, from;                      // > 0: the layer's normed keys and values kept as slot keep - 1 for layers
                                         // over its KV; the layer projects q only and reads slot from - 1 (its
                                         // source's pages, the source's bytes stored again as decode_attend goes)
} qlayer_t;

// y [B, H] = x + RMSNorm(y) * w, in place: a post-norm and its residual (Gemma), the one both paths call (the
// Python forward for every fp32 row on the CPU: norm_add), so they give the same bits
void norm_add_rows(float *y, const float *x, int B, int H, const float *w, float eps) {
    for (int b = 0; b < B; b++) {
        float *r = y + (size_t)b * H, ss = 0.0f;
        const float *xr = x + (size_t)b * H;
        for (int d = 0; d < H; d++) ss += r[d] * r[d];
        float k = 1.0f / sqrtf(ss / (float)H + eps);
        for (int d = 0; d < H; d++) r[d] = xr[d] + r[d] * k * w[d];
    }
}

// o [F] = gelu_tanh(g) * u (o may be g itself): 0.5 g (1 + tanh(t)), t = sqrt(2 / pi) (g + 0.044715 g^3),
// tanh(t) = 1 - 2 / (exp(2t) + 1); the one GELU of every path (gelu_gate_rows, a GELU expert's rows)
static void gelu_mul(const float *g, const float *u, int F, float *o) {
    const float c = 0.7978845608028654f, k = 0.044715f;
    int i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(.5f);
    for (; i + 8 <= F; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 t = _mm256_mul_ps(_mm256_set1_ps(c), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(k),
                                 _mm256_mul_ps(x, _mm256_mul_ps(x, x)))));
        __m256 e = exp8(_mm256_mul_ps(two, t));
        __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, th)),
                                              _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < F; i++) {
        float x = g[i], t = c * (x + k * (x * (x * x)));
        float th = 1.f - 2.f / (expf(2.f * t) + 1.f);
        o[i] = 0.5f * x * (1.f + th) * u[i];
    }
}

// out [B, F] = gelu_tanh(gate) * up of gu [B, 2F] (gate | up), the Python forward's too on the CPU (gelu_gate)
void gelu_gate_rows(const float *gu, int B, int F, float *out) {
    for (int b = 0; b < B; b++)
        gelu_mul(gu + (size_t)b * 2 * F, gu + (size_t)b * 2 * F + F, F, out + (size_t)b * F);
}

// out [B, H] = x + RMSNorm(RMSNorm(dense) * pd + RMSNorm(routed) * pe) * pm: Gemma 4's MLP and its experts side by
// side, each output normed, their sum normed and added (dense is overwritten with the sum; out may be x). The call
// of both paths (the Python forward for every fp32 row on the CPU: beside_add), so they give the same bits.
void beside_rows(float *dense, const float *routed, const float *x, int B, int H, const float *pd, const float *pe,
                 const float *pm, float eps, float *out) {
    for (int b = 0; b < B; b++) {
        float *s = dense + (size_t)b * H, sd = 0.0f, sr = 0.0f, ss = 0.0f;
        const float *r = routed + (size_t)b * H, *xr = x + (size_t)b * H;
        float *o = out + (size_t)b * H;
        for (int d = 0; d < H; d++) sd += s[d] * s[d];
        for (int d = 0; d < H; d++) sr += r[d] * r[d];
        float kd = 1.0f / sqrtf(sd / (float)H + eps), kr = 1.0f / sqrtf(sr / (float)H + eps);
        for (int d = 0; d < H; d++) {
            s[d] = s[d] * kd * pd[d] + r[d] * kr * pe[d];
            ss += s[d] * s[d];
        }
        float k = 1.0f / sqrtf(ss / (float)H + eps);
        for (int d = 0; d < H; d++) o[d] = xr[d] + s[d] * k * pm[d];
    }
}

// x [n] = cap * tanh(x / cap) in place (Gemma's final soft-cap of the logits): tanh(t) = 1 - 2 / (exp(2t) + 1) as
// gelu_gate_rows forms it, eight at a time; a NaN stays a NaN (exp8 would clamp it)
void softcap_rows(float *x, int64_t n, float cap) {
    const float inv = 1.0f / cap;
    int64_t chunks = (n + 8191) / 8192;
    #pragma omp parallel for schedule(static) if (chunks > 1)
    for (int64_t k = 0; k < chunks; k++) {
        int64_t i = k * 8192, hi = i + 8192 < n ? i + 8192 : n;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), c = _mm256_set1_ps(cap);
        const __m256 r = _mm256_set1_ps(inv);
        for (; i + 8 <= hi; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            __m256 e = exp8(_mm256_mul_ps(two, _mm256_mul_ps(v, r)));
            __m256 y = _mm256_mul_ps(c, _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one))));
            _mm256_storeu_ps(x + i, _mm256_blendv_ps(y, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
        }
#endif
        for (; i < hi; i++) {
            float e = expf(2.f * (x[i] * inv));
            x[i] = x[i] != x[i] ? x[i] : cap * (1.f - 2.f / (e + 1.f));
        }
    }
}

// The q and k heads of B rows of qkv [B, ld] (q: Hq heads of D, then k: Hkv heads) RMS-normed over D in place,
// times q_w / k_w [D]: the one q/k norm of both paths (the Python forward calls it for every row on the CPU in
// fp32, decode_layers between the qkv projection and attention), so they give the same bits
void qk_norm_rows(float *qkv, int B, int ld, int Hq, int Hkv, int D, const float *q_w, const float *k_w, float eps) {
    for (int b = 0; b < B; b++)
        for (int h = 0; h < Hq + Hkv; h++) {
            float *x = qkv + (size_t)b * ld + (size_t)h * D;
            const float *w = h < Hq ? q_w : k_w;
            float ss = 0.0f;
            for (int d = 0; d < D; d++) ss += x[d] * x[d];
            float r = 1.0f / sqrtf(ss / (float)D + eps);
            for (int d = 0; d < D; d++) x[d] = x[d] * r * w[d];
        }
}

// o [n] *= sigmoid(g [n]), 1 / (1 + exp(-g)) in float: the output gate of both paths (Qwen3.5's gated attention;
// the Python forward's on the CPU in fp32: cpu_quant.sigmoid_mul_), so they give the same bits
void sigmoid_mul_rows(float *o, const float *g, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] *= 1.0f / (1.0f + expf(-g[i]));
}

// Qwen3.5's rows q | gate | k | v [B, ld] -> q | k | v [B, ld - gate] in place, the gates to out [B, gate]: the
// model's layout for the norms and the attention (each row moves down over rows already moved: memmove)
static void gate_aside(float *qkv, int B, int ld, int nq, int gate, float *out) {
    int n = ld - gate;
    for (int b = 0; b < B; b++) {
        float *r = qkv + (size_t)b * ld, *to = qkv + (size_t)b * n;
        memcpy(out + (size_t)b * gate, r + nq, sizeof(float) * gate);
        memmove(to, r, sizeof(float) * nq);
        memmove(to + nq, r + nq + gate, sizeof(float) * (n - nq));
    }
}

// y [M, sum of the parts' N] = parts(x [M, K] ([M, 2K] with SwiGLU)) (+ resid [M, N], one part only), MAXM
// rows a call as cpu_quant.py's fused() splits them
static void lin_apply(const qlin_t *parts, int np, const float *x, int M, float *y, void *scratch, int mode,
                      const float *norm_w, float eps, const float *resid) {
    int ldy = 0;
    for (int p = 0; p < np; p++) ldy += parts[p].N;
    for (int m0 = 0; m0 < M; m0 += MAXM) {
        int rows = M - m0 < MAXM ? M - m0 : MAXM;
        for (int p = 0, col = 0; p < np; col += parts[p].N, p++) {
            const qlin_t *l = parts + p;
            const float *xm = x + (size_t)m0 * l->K * (mode == 2 ? 2 : 1);
            float *ym = y + (size_t)m0 * ldy + col;
            const float *rm = resid ? resid + (size_t)m0 * l->N : NULL;
            int lm = mode | (l->act == 8 ? ACT8 : 0);
            if (l->bias) rm = NULL;                     // the product, then its bias, then the residual (below)
            if (l->bits == 4 && l->kind != KIND_MXFP4)
                q4_gemv_ld(xm, rows, l->K, l->codes, l->scale, l->zero, l->N, ym, ldy, scratch, lm, norm_w, eps,
                           rm, l->kind, l->ssup, l->zsup, l->per, l->high);
            else if (l->bits == 4 && l->kind == KIND_MXFP4)    // cpu_mxfp4.h: scale holds the E8M0 exponents
                mxfp4_gemv_ld(xm, rows, l->K, l->codes, l->scale, l->N, ym, ldy, scratch, lm, norm_w, eps, rm);
            else if (l->bits == 6)         // cpu_q6k.h: codes ql, zero qh, scale sc, ssup d
                q6k_gemv_ld(xm, rows, l->K, l->codes, l->zero, l->scale, (const half_t *)l->ssup, l->N, ym, ldy,
                            scratch, lm, norm_w, eps, rm);
            else
                q8_gemv_ld(xm, rows, l->K, l->codes, l->scale, l->zero, l->group, l->N, ym, ldy, scratch, lm,
                           norm_w, eps, rm, l->kind, l->ssup, l->zsup, l->per);
            if (l->bias)                                // the Python path's order: y += bias, then y += residual
                for (int m = 0; m < rows; m++)
                    for (int n = 0; n < l->N; n++) {
                        float *o = ym + (size_t)m * ldy + n;
                        *o += l->bias[n];
                        if (resid) *o += resid[(size_t)(m0 + m) * l->N + n];
                    }
        }
    }
}

#include "cpu_moe.h"
#include "cpu_gdn.h"        // Gated DeltaNet's recurrence (linear-attention layers)

// Whether layer L's own attention (qlayer_t.hd) chains: q [Hq, hd], keys and values at its KV heads (none where it
// reads another layer's), the output Hq * hd wide, heads decode_attend takes
static int own_heads_ok(const qlayer_t *L, int Hq) {
    int hd = L->hd, kvh = L->kvh, kv = L->from ? 0 : kvh * hd * (L->vk ? 1 : 2);
    return kvh > 0 && Hq % kvh == 0 && hd % 2 == 0 && hd <= 512 && !L->gate && !L->gdn && !(L->keep && L->from)
           && L->keep >= 0 && L->from >= 0 && L->mix_in == Hq * hd + kv && L->mix_out == Hq * hd;
}

// Whether layer L's linears chain at widths H (the residual), Hq * D (attention) and its own intermediate: a
// table built from a damaged file's header must fail here, not read past an activation row
static int layer_widths_ok(const qlayer_t *L, int H, int Hq, int Hkv, int D) {
    int mixer = L->mix_out > 0;                  // the caller's mixer: its own widths, no q / k norm here (but for
    if (mixer && (L->mix_in < 1 || (L->q_norm && !L->hd))) return 0;       // its own attention's, hd > 0)
    if (L->hd && (!mixer || !own_heads_ok(L, Hq))) return 0;
    if (L->gate && (mixer || L->gate != Hq * D)) return 0;
    int want_n[4] = {mixer ? L->mix_in : (Hq + 2 * Hkv) * D + L->gate, H, 0, H}, n[4] = {0, 0, 0, 0};
    int attn_k = mixer ? L->mix_out : Hq * D;
    if (L->moe && L->beside[0]) {                // Gemma 4: the experts beside a dense MLP checked below
        if (!moe_ok(L->moe, H) || L->shared || !L->beside[1] || !L->beside[2] || !L->post_mlp) return 0;
    } else if (L->moe) {                         // attention's two linears here, the MLP the experts'
        if (L->nparts[2] || L->nparts[3] || !moe_ok(L->moe, H)) return 0;
        for (int s = 0; s < 2; s++) {
            if (L->nparts[s] < 1 || L->nparts[s] > 3 || (s == 1 && L->nparts[s] != 1)) return 0;
            for (int p = 0; p < L->nparts[s]; p++) {
                const qlin_t *l = &L->lin[s][p];
                if (!moe_bits_ok(l) || l->N < 1 || l->K != (s ? attn_k : H)) return 0;
                n[s] += l->N;
            }
            if (n[s] != want_n[s]) return 0;
        }
        return L->norm_attn && L->norm_mlp && !L->q_norm == !L->k_norm && (!L->shared || shared_ok(L->shared, H));
    }
    if ((L->shared && !L->moe) || (L->beside[0] && !L->moe)) return 0;    // each sits beside a routed MLP
    for (int s = 0; s < 4; s++) {
        if (L->nparts[s] < 1 || L->nparts[s] > 3 || ((s == 1 || s == 3) && L->nparts[s] != 1)) return 0;
        for (int p = 0; p < L->nparts[s]; p++) {
            const qlin_t *l = &L->lin[s][p];
            if (!moe_bits_ok(l) || l->N < 1 || l->K < 1 || l->K % 32 || l->group < 1) return 0;
            n[s] += l->N;
        }
    }
    if (n[2] % 2) return 0;                      // gate | up: two halves of the intermediate width
    int want_k[4] = {H, attn_k, H, n[2] / 2};
    for (int s = 0; s < 4; s++) {
        if (s != 2 && n[s] != want_n[s]) return 0;
        for (int p = 0; p < L->nparts[s]; p++)
            if (L->lin[s][p].K != want_k[s]) return 0;
    }
    return L->norm_attn && L->norm_mlp && !L->q_norm == !L->k_norm;
}

// attend(ctx, layer, qkv [B, n_qkv], out [B, Hq * D]): attention for pages no kernel here reads (quantized
// caches): the other library's attend_quant_layer, or the caller's own through a callback; nonzero stops the step.
// A layer whose mixer is the caller's (mix_out > 0) has qkv [B, mix_in] and out [B, mix_out].
typedef int (*attend_fn)(void *ctx, int layer, float *qkv, float *out);

// B sequences' decode tokens through all layers: x [B, H] (the embeddings) becomes the last
// layer's output. Each layer runs exactly the calls a step through Python makes (q4_gemv / q8_gemv with
// RMSNorm, SwiGLU and residual fused, decode_attend), in the same order, so the bits are the same; what
// goes is the interpreter between them. Each layer attends through one group (a KV layout of the step): a group
// either holds decode_attend's arguments for its sequences (rows, positions, RoPE rows), its layers' pages (kp[i],
// vp[i]; bf16[i]: 16-bit), sink logits (sinks[i], gpt-oss's) and soft-cap (Gemma 2's), or an attend function called
// instead (the quantized-KV library's attend_quant_layer, or the caller's own through a callback) with the layer's
// index in the group. Gemma's sliding and global layers are two groups.
// 0 on success, -1 when out of memory, -2 when an attend function failed, -3 when a linear's width does not chain
// with H, Hq, Hkv and D (or D is past decode_attend's 256) or a layer's group is out of range, before anything runs.
// mass (NULL: not measured): [nl, B, Hq, mcols], each layer's decode_attend mass (cols as decode_attend's; the
// groups with pages only).
typedef struct {
    const float *cos, *sin, *scos, *ssin;
    const int *n_sink;
    const int64_t *new_rows, *rows, *off;
    void *const *kp, *const *vp;
    const int *bf16;
    attend_fn attend;       // not NULL: called for the group's layers instead of decode_attend
    void *ctx;
    const float *const *sinks;  // [layers] each layer's sink logits [Hq] or NULL (gpt-oss); NULL: no layer has them
    float softcap;              // the group's layers' soft-cap of their scores (Gemma 2), 0: none
    int normed;                 // 1: attend takes a layer's own attention (qlayer_t.hd) as q | k | v after its norms,
                                // (Hq + 2 kvh) * hd wide (the quantized-KV library's); 0: the raw projection
} attn_group_t;

static int run_layers(int nl, const qlayer_t *layers, int B, float *x, int H, float eps, int Hq, int Hkv, int D,
                      int ng, const attn_group_t *groups, const int *lgrp, const int *lidx, float sm_scale,
                      const int *cols, int mcols, float *mass, const void *states);

// every layer through one group: the pages and arguments given, or attend(ctx, layer, ...) where attend is not NULL
int decode_layers(int nl, const qlayer_t *layers, int B, float *x, int H, float eps, int Hq, int Hkv, int D,
                  void *const *kp, void *const *vp, const int *bf16, const float *cos, const float *sin,
                  const float *scos, const float *ssin, const int *n_sink, const int64_t *new_rows,
                  const int64_t *rows, const int64_t *off, float sm_scale, attend_fn attend, void *ctx,
                  const int *cols, int mcols, float *mass) {
    attn_group_t one = {cos, sin, scos, ssin, n_sink, new_rows, rows, off, kp, vp, bf16, attend, ctx, NULL, 0.f, 0};
    return run_layers(nl, layers, B, x, H, eps, Hq, Hkv, D, 1, &one, NULL, NULL, sm_scale, cols, mcols, mass, NULL);
}

// layer l through groups[lgrp[l]] (0 <= lgrp[l] < ng; NULL: group 0) as its lidx[l]-th layer there (NULL: l);
// states (a step_inputs_t, or NULL): the Gated DeltaNet layers' states, which run those layers' mixers here, and
// Gemma 4's per-layer inputs (a table with them runs only where they are given)
int decode_layers_grouped(int nl, const qlayer_t *layers, int B, float *x, int H, float eps, int Hq, int Hkv, int D,
                          int ng, const attn_group_t *groups, const int *lgrp, const int *lidx, float sm_scale,
                          const int *cols, int mcols, float *mass, const void *states) {
    if (ng < 1) return -3;
    for (int l = 0; l < nl; l++)
        if ((lgrp && (lgrp[l] < 0 || lgrp[l] >= ng)) || (lidx && lidx[l] < 0)) return -3;
    return run_layers(nl, layers, B, x, H, eps, Hq, Hkv, D, ng, groups, lgrp, lidx, sm_scale, cols, mcols, mass,
                      states);
}

// Whether layer L's Gated DeltaNet runs here: its widths the mixer's, its state among the step's
static int gdn_here(const qlayer_t *L, const step_inputs_t *st) {
    if (!L->gdn || !st) return 0;
    const gdn_t *m = L->gdn;
    int V = m->H * m->Dv;
    return L->mix_in == 2 * m->Hk * m->Dk + 2 * V + 2 * m->H && L->mix_out == V && L->state >= 0 && L->state < st->n
           ? 1 : -1;
}

// Whether layer L's per-layer input (if any) chains at H and the step brings the inputs of all nl layers
static int ple_ok(const qlayer_t *L, int H, const step_inputs_t *st, int nl) {
    if (!L->ple[0].N) return 1;
    const qlin_t *g = &L->ple[0], *p = &L->ple[1];
    return st && st->ple && st->ple_layers == nl && L->ple_norm && moe_bits_ok(g) && moe_bits_ok(p) && g->K == H
           && p->N == H && p->K == g->N && g->K % 32 == 0 && p->K % 32 == 0;
}

// x [B, H] += RMSNorm(proj(gelu_tanh(gate(x)) * input)) * norm: layer l's per-layer input (Gemma 4), its rows of
// ple [B, nl, w]; the forward's calls (the linears, gelu_gate_rows over (gate | input) pairs, norm_add_rows), so the
// same bits. buf: B * (4 w + H) floats.
static void per_layer_input(const qlayer_t *L, int l, int nl, int B, int H, float eps, const float *ple, float *x,
                            float *buf, void *gs) {
    int w = L->ple[0].N;
    float *g = buf, *pairs = g + (size_t)B * w, *h = pairs + 2 * (size_t)B * w, *y = h + (size_t)B * w;
    lin_apply(&L->ple[0], 1, x, B, g, gs, 0, NULL, eps, NULL);
    for (int b = 0; b < B; b++) {
        memcpy(pairs + (size_t)b * 2 * w, g + (size_t)b * w, sizeof(float) * w);
        memcpy(pairs + (size_t)b * 2 * w + w, ple + ((size_t)b * nl + l) * w, sizeof(float) * w);
    }
    gelu_gate_rows(pairs, B, w, h);
    lin_apply(&L->ple[1], 1, h, B, y, gs, 0, NULL, eps, NULL);
    norm_add_rows(y, x, B, H, L->ple_norm, eps);
    memcpy(x, y, sizeof(float) * (size_t)B * H);
}

// y [B, H] (+ resid, where not NULL) = layer L's dense MLP of RMSNorm(x2) * norm_mlp: gate | up, the gate's
// activation (SwiGLU inside the down projection's kernel; GELU first, into gl, then a plain GEMV), down. gu: room
// for gate | up
static void dense_mlp(const qlayer_t *L, const float *x2, int B, float eps, float *gu, float *gl, void *gs, float *y,
                      const float *resid) {
    lin_apply(L->lin[2], L->nparts[2], x2, B, gu, gs, 1, L->norm_mlp, eps, NULL);
    const float *hin = gu;
    int mode = 2;
    if (L->act == 1) {
        gelu_gate_rows(gu, B, L->lin[3][0].K, gl);
        hin = gl;
        mode = 0;
    }
    lin_apply(L->lin[3], L->nparts[3], hin, B, y, gs, mode, NULL, eps, resid);
}

// Layer L's own attention (Gemma 4) over group g's pages as its layer i, the Python forward's steps in its order
// (Transformer._attend): values from the keys before their norm, or the projection's; the values RMS-normed without
// a multiplier; q and k normed; decode_attend at the layer's head size and KV heads. A layer that keeps its keys
// and values for layers over its KV copies them (normed, before RoPE) to its slot of kept; a layer over another's KV
// has q only and gives decode_attend the kept rows, which store the bytes the source stored and read them. vb: B
// rows of kvh * hd for values taken from keys; kept: two such slots a kept layer (keys, then values); ones: hd 1s,
// the values' norm's multiplier (head_norm_'s for the forward).
static int own_attention(const qlayer_t *L, const attn_group_t *g, int i, int B, float *qkv, int n0, int Hq,
                         float eps, float *vb, float *kept, size_t slot, const float *ones, float sm_scale, float *att,
                         float *as, const int *cols, int mcols, float *mass) {
    int hd = L->hd, kvh = L->kvh, kw = kvh * hd, ldk = n0, ldv = n0;
    float *k = qkv + (size_t)Hq * hd, *v = k + kw;
    if (L->from) {
        k = kept + (size_t)(L->from - 1) * 2 * slot, v = k + slot, ldk = ldv = kw;
        if (L->q_norm) qk_norm_rows(qkv, B, n0, Hq, 0, hd, L->q_norm, L->q_norm, eps);
    } else {
        if (L->vk) {
            for (int b = 0; b < B; b++) memcpy(vb + (size_t)b * kw, k + (size_t)b * n0, sizeof(float) * kw);
            v = vb, ldv = kw;
        }
        if (L->vnorm) qk_norm_rows(v, B, ldv, kvh, 0, hd, ones, ones, eps);
        if (L->q_norm) qk_norm_rows(qkv, B, n0, Hq, kvh, hd, L->q_norm, L->k_norm, eps);
        if (L->keep) {
            float *ks = kept + (size_t)(L->keep - 1) * 2 * slot, *vs = ks + slot;
            for (int b = 0; b < B; b++) {
                memcpy(ks + (size_t)b * kw, k + (size_t)b * ldk, sizeof(float) * kw);
                memcpy(vs + (size_t)b * kw, v + (size_t)b * ldv, sizeof(float) * kw);
            }
        }
    }
    if (g->attend) {                             // quantized pages: q | k | v packed for the library's attend
        int qw = Hq * hd, w = qw + 2 * kw;
        float *p = as;                           // free until the attention, which reads the packed rows
        for (int b = 0; b < B; b++) {
            memcpy(p + (size_t)b * w, qkv + (size_t)b * n0, sizeof(float) * qw);
            memcpy(p + (size_t)b * w + qw, k + (size_t)b * ldk, sizeof(float) * kw);
            memcpy(p + (size_t)b * w + qw + kw, v + (size_t)b * ldv, sizeof(float) * kw);
        }
        return g->attend(g->ctx, i, p, att);
    }
    decode_attend(B, qkv, k, v, n0, ldk, ldv, Hq, kvh, hd, g->cos, g->sin, g->scos, g->ssin, g->n_sink, g->kp[i],
                  g->vp[i], g->bf16[i], g->new_rows, g->rows, g->off, sm_scale, g->softcap,
                  g->sinks ? g->sinks[i] : NULL, att, as, cols, mcols, mass);
    return 0;
}

static int run_layers(int nl, const qlayer_t *layers, int B, float *x, int H, float eps, int Hq, int Hkv, int D,
                      int ng, const attn_group_t *groups, const int *lgrp, const int *lidx, float sm_scale,
                      const int *cols, int mcols, float *mass, const void *states) {
    const step_inputs_t *st = states;
    if (nl < 1 || B < 1 || H < 1 || Hq < 1 || Hkv < 1 || D < 1) return -3;
    for (int g = 0; g < ng; g++)
        if (!groups[g].attend && D > 256) return -3;
    int natt = Hq * D;                           // the widest attention output: the model's, or a mixer's
    int dmax = D, nkeep = 0, kvmax = 0;          // the widest head; slots of kept keys and values, their width
    for (int l = 0; l < nl; l++) {
        const qlayer_t *L = layers + l;
        if (!layer_widths_ok(L, H, Hq, Hkv, D)) return -3;
        int here = gdn_here(L, st);              // else only a callback mixes, or C's own attention (hd)
        if (here < 0 || (L->mix_out > 0 && !here && !L->hd && !groups[lgrp ? lgrp[l] : 0].attend)) return -3;
        if (L->mix_out > natt) natt = L->mix_out;
        if (!ple_ok(L, H, st, nl)) return -3;
        if (L->hd > dmax) dmax = L->hd;
        if (L->keep > nkeep) nkeep = L->keep;
        if (L->hd && L->kvh * L->hd > kvmax) kvmax = L->kvh * L->hd;
    }
    for (int l = 0; l < nl; l++) {               // a layer over kept keys: a slot an earlier layer of its widths keeps
        int f = layers[l].from, ok = !f;
        for (int e = 0; e < l && f && !ok; e++)
            ok = layers[e].keep == f && layers[e].hd == layers[l].hd && layers[e].kvh == layers[l].kvh;
        if (!ok) return -3;
    }
    int kmax = H, nqkv = 0, ngu = 0, wple = 0;
    for (int l = 0; l < nl; l++)
        if (layers[l].ple[0].N > wple) wple = layers[l].ple[0].N;
    if (wple > kmax) kmax = wple;
    for (int l = 0; l < nl; l++)
        for (int s = 0; s < 4; s++) {
            int n = 0;
            for (int p = 0; p < layers[l].nparts[s]; p++) {
                n += layers[l].lin[s][p].N;
                if (layers[l].lin[s][p].K > kmax) kmax = layers[l].lin[s][p].K;
            }
            if (s == 0 && n > nqkv) nqkv = n;
            if (s == 2 && n > ngu) ngu = n;
        }
    size_t nrows = 0;
    for (int g = 0; g < ng; g++)
        if (!groups[g].attend && (size_t)groups[g].off[B] > nrows) nrows = (size_t)groups[g].off[B];
    size_t gemv_bytes = (size_t)(B < MAXM ? B : MAXM) * kmax * 2 * 7;
    size_t attn_floats = 2 * (size_t)B * Hq * dmax + (size_t)Hq * nrows + 4 * (size_t)B * Hq * (dmax + 2)
                         + 2 * (size_t)B * kvmax;          // or a packed q | k | v (own_attention's, at most this)
    size_t slot = (size_t)B * kvmax;             // one kept keys' (or values') rows
    size_t floats = (size_t)B * nqkv + 2 * (size_t)B * natt + (size_t)B * H + (size_t)B * ngu + attn_floats
                    + (size_t)B * ngu / 2       // the GELU's output
                    + (size_t)B * (4 * (size_t)wple + H)       // the per-layer input's gate, pairs, product, output
                    + 2 * (size_t)B * H                        // a dense MLP's and its experts' outputs (Gemma 4)
                    + slot * (1 + 2 * (size_t)nkeep)           // values from keys; kept keys and values
                    + (size_t)dmax;                            // the values' norm's multiplier: ones
    char *mem = malloc(gemv_bytes + sizeof(float) * floats + 64);
    if (!mem) return -1;
    void *gs = mem;
    float *qkv = (float *)(mem + ((gemv_bytes + 63) & ~(size_t)63));
    float *att = qkv + (size_t)B * nqkv, *mixed = att + (size_t)B * natt, *x2 = mixed + (size_t)B * natt;
    float *gu = x2 + (size_t)B * H;
    float *as = gu + (size_t)B * ngu, *gl = as + attn_floats, *pl = gl + (size_t)B * ngu / 2;
    float *dn = pl + (size_t)B * (4 * (size_t)wple + H), *rt = dn + (size_t)B * H;
    float *vb = rt + (size_t)B * H, *kept = vb + slot, *ones = kept + 2 * (size_t)nkeep * slot;
    for (int d = 0; d < dmax; d++) ones[d] = 1.0f;
    for (int l = 0; l < nl; l++) {
        const qlayer_t *L = layers + l;
        int n0 = 0;
        for (int p = 0; p < L->nparts[0]; p++) n0 += L->lin[0][p].N;
        lin_apply(L->lin[0], L->nparts[0], x, B, qkv, gs, 1, L->norm_attn, eps, NULL);
        if (L->gate) {                       // the gates aside (into mixed, free here), q | k | v as any layer's
            gate_aside(qkv, B, n0, Hq * D, L->gate, mixed);
            n0 -= L->gate;
        }
        if (L->q_norm && !L->hd) qk_norm_rows(qkv, B, n0, Hq, Hkv, D, L->q_norm, L->k_norm, eps);
        const attn_group_t *g = groups + (lgrp ? lgrp[l] : 0);
        int i = lidx ? lidx[l] : l;          // the layer's index in its group
        if (gdn_here(L, st)) {              // the Gated DeltaNet, each sequence from its own state
            int V = L->mix_out;
            float *o = L->mix_order ? mixed : att;
            for (int b = 0; b < B; b++) {
                size_t e = (size_t)L->state * B + b;
                int rc = gdn_mix(L->gdn, 1, qkv + (size_t)b * n0, n0, eps, st->tail_in[e], st->tail_out[e], st->S_in[e],
                                 st->S_out[e], o + (size_t)b * V);
                if (rc) {
                    free(mem);
                    return rc;
                }
            }
            if (L->mix_order)
                for (int b = 0; b < B; b++)
                    for (int c = 0; c < V; c++) att[(size_t)b * V + c] = mixed[(size_t)b * V + L->mix_order[c]];
        } else if (L->hd && (!g->attend || g->normed)) {
            if (own_attention(L, g, i, B, qkv, n0, Hq, eps, vb, kept, slot, ones, sm_scale, att, as, cols, mcols,
                              mass ? mass + (size_t)l * B * Hq * mcols : NULL)) {
                free(mem);
                return -2;
            }
        } else if (g->attend) {
            if (g->attend(g->ctx, i, qkv, att)) {
                free(mem);
                return -2;
            }
        } else {
            decode_attend(B, qkv, qkv + Hq * D, qkv + (Hq + Hkv) * D, n0, n0, n0, Hq, Hkv, D, g->cos, g->sin, g->scos,
                          g->ssin, g->n_sink, g->kp[i], g->vp[i], g->bf16[i], g->new_rows, g->rows, g->off, sm_scale,
                          g->softcap, g->sinks ? g->sinks[i] : NULL, att, as, cols, mcols,
                          mass ? mass + (size_t)l * B * Hq * mcols : NULL);
        }
        if (L->gate) sigmoid_mul_rows(att, mixed, (int64_t)B * L->gate);
        if (L->post_attn) {                  // Gemma: o normed, then added
            lin_apply(L->lin[1], L->nparts[1], att, B, x2, gs, 0, NULL, eps, NULL);
            norm_add_rows(x2, x, B, H, L->post_attn, eps);
        } else {
            lin_apply(L->lin[1], L->nparts[1], att, B, x2, gs, 0, NULL, eps, x);
        }
        if (L->moe && L->beside[0]) {       // Gemma 4: the dense MLP, the experts, each normed, their sum normed
            dense_mlp(L, x2, B, eps, gu, gl, gs, dn, NULL);
            int rc = moe_layer_rows(B, H, x2, L->beside[1], eps, L->moe, NULL, rt);
            if (rc) {
                free(mem);
                return rc;
            }
            beside_rows(dn, rt, x2, B, H, L->beside[0], L->beside[2], L->post_mlp, eps, x);
        } else if (L->moe) {
            int rc = moe_layer_rows(B, H, x2, L->norm_mlp, eps, L->moe, x2, x);
            if (!rc && L->shared) rc = shared_expert_rows(B, H, x2, L->norm_mlp, eps, L->shared, x);
            if (rc) {
                free(mem);
                return rc;
            }
        } else if (L->post_mlp) {            // Gemma: the MLP's output normed, then added
            dense_mlp(L, x2, B, eps, gu, gl, gs, x, NULL);
            norm_add_rows(x, x2, B, H, L->post_mlp, eps);
        } else {
            dense_mlp(L, x2, B, eps, gu, gl, gs, x, x2);
        }
        if (L->ple[0].N) per_layer_input(L, l, nl, B, H, eps, st->ple, x, pl, gs);
        if (L->scalar)
            for (size_t i = 0; i < (size_t)B * H; i++) x[i] *= *L->scalar;
    }
    free(mem);
    return 0;
}

// ---- GGUF blocks split into their parts (loading) ------------------------------------------------------

// Each of n blocks of `size` bytes gives its first `head` bytes (the scales) to heads [n, head] and the rest
// (the codes) to body [n, size - head]: what numpy's strided copies did at 1-2 GB/s, at memory speed.
void split_blocks(const uint8_t *src, int64_t n, int size, int head, uint8_t *heads, uint8_t *body) {
    int tail = size - head;
    int64_t chunks = (n + 8191) / 8192;
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t hi = (c + 1) * 8192 < n ? (c + 1) * 8192 : n;
        for (int64_t i = c * 8192; i < hi; i++) {
            memcpy(heads + i * head, src + i * size, head);
            memcpy(body + i * tail, src + i * size + head, tail);
        }
    }
}

// ---- query-aware choice of blocks (Quest) ---------------------------------------------------------------
//
// q [Hq, D] before RoPE and cos / sin [D] at its position (rotate-half layout); summ: bf16 [*, Hkv, 2D] per block
// id, each channel's max over the block's rotated keys, then its min; ids [n] the candidate blocks' ids, then n2
// more candidates at rows ids2 of summ2 (blocks on disk; NULL, 0 for none): candidate n + i is ids2[i]. A block's
// bound for a query head is the largest score a key of it can reach, relu(q).max + min(q, 0).min; its score is its
// best head's bound less that head's best over the candidates. Writes the K best candidates' indices (0..n-1) in
// ascending order to out, and each candidate's score to scratch [n]. K < n.
static inline float bf16f(uint16_t b) { union { uint32_t u; float f; } v; v.u = (uint32_t)b << 16; return v.f; }

typedef struct { float score; int index; } scored_t;

static int cmp_scored(const void *a, const void *b) {        // the best first; the older of equals first
    const scored_t *x = a, *y = b;
    if (x->score != y->score) return x->score < y->score ? 1 : -1;
    return x->index - y->index;
}
static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

// the K best of a[0..n) moved to a[0..K) in any order (quickselect, cmp_scored's order)
static void select_best(scored_t *a, int n, int K) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        scored_t pivot = a[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (cmp_scored(&a[i], &pivot) < 0) i++;
            while (cmp_scored(&a[j], &pivot) > 0) j--;
            if (i <= j) { scored_t t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (K - 1 <= j) hi = j;
        else if (K - 1 >= i) lo = i;
        else break;
    }
}

void choose_blocks(const float *q, const float *cos, const float *sin, int Hq, int Hkv, int D,
                   const uint16_t *summ, const int64_t *ids, int n, const uint16_t *summ2, const int64_t *ids2,
                   int n2, int K, int *out, float *scratch) {
    int g = Hq / Hkv, half = D / 2;
    float *pos = malloc(sizeof(float) * 2 * Hq * D), *best = malloc(sizeof(float) * Hq);
    int n1 = n;
    n += n2;
    float *bound = malloc(sizeof(float) * (size_t)Hq * n), *row = malloc(sizeof(float) * 2 * D);
    scored_t *order = malloc(sizeof(scored_t) * n);
    for (int h = 0; h < Hq; h++) {            // rotate, then split into the positive and negative parts
        const float *x = q + (size_t)h * D;
        float *p = pos + (size_t)h * 2 * D;
        for (int d = 0; d < D; d++) {
            float r = x[d] * cos[d] + (d < half ? -x[d + half] : x[d - half]) * sin[d];
            p[d] = r > 0 ? r : 0;
            p[D + d] = r < 0 ? r : 0;
        }
        best[h] = -INFINITY;
    }
    for (int i = 0; i < n; i++) {
        for (int kv = 0; kv < Hkv; kv++) {
            const uint16_t *s = i < n1 ? summ + ((size_t)ids[i] * Hkv + kv) * 2 * D
                                       : summ2 + ((size_t)ids2[i - n1] * Hkv + kv) * 2 * D;
            for (int d = 0; d < 2 * D; d++) row[d] = bf16f(s[d]);
            for (int j = 0; j < g; j++) {
                int h = kv * g + j;
                const float *p = pos + (size_t)h * 2 * D;
                float lanes[16] = {0}, acc = 0;     // 16 partial sums: vectorized without reassociating
                int d = 0;
                for (; d + 16 <= 2 * D; d += 16)
                    for (int t = 0; t < 16; t++) lanes[t] += p[d + t] * row[d + t];
                for (; d < 2 * D; d++) acc += p[d] * row[d];
                for (int t = 0; t < 16; t++) acc += lanes[t];
                bound[(size_t)h * n + i] = acc;
                if (acc > best[h]) best[h] = acc;
            }
        }
    }
    for (int i = 0; i < n; i++) {
        float m = -INFINITY;
        for (int h = 0; h < Hq; h++) {
            float r = bound[(size_t)h * n + i] - best[h];
            if (r > m) m = r;
        }
        scratch[i] = m;
        order[i].score = m;
        order[i].index = i;
    }
    select_best(order, n, K);
    for (int k = 0; k < K; k++) out[k] = order[k].index;
    qsort(out, K, sizeof(int), cmp_int);
    free(pos); free(best); free(bound); free(row); free(order);
}

// ---- saved caches: whether every value of a tensor is finite -------------------------------------------------

// n values of 4 (float32) or 2 (bfloat16: exp 0x7F80, float16: 0x7C00) bytes: 1 when none is NaN or infinite
#define CHECK_PART (1 << 18)    // bytes a thread takes at least (all_finite, checksum64): larger is read in parts side by side

static int some_not_finite(const void *p, int64_t lo, int64_t hi, int kind) {
    int bad = 0;
    if (kind == 0) {
        const uint32_t *x = p;
        for (int64_t i = lo; i < hi; i++) bad |= (x[i] & 0x7F800000u) == 0x7F800000u;
    } else {
        const uint16_t *x = p;
        uint16_t m = kind == 1 ? 0x7F80 : 0x7C00;
        for (int64_t i = lo; i < hi; i++) bad |= (x[i] & m) == m;
    }
    return bad;
}

int all_finite(const void *p, int64_t n, int kind) {
    int parts = 1, bad = 0;
#ifdef _OPENMP
    parts = omp_get_max_threads();
    int64_t bytes = n * (kind == 0 ? 4 : 2);
    if (parts > bytes / CHECK_PART) parts = (int)(bytes / CHECK_PART);
    if (parts < 1) parts = 1;
#endif
    if (parts == 1) return !some_not_finite(p, 0, n, kind);
    #pragma omp parallel for num_threads(parts) schedule(static) reduction(|:bad)
    for (int t = 0; t < parts; t++) bad |= some_not_finite(p, n * t / parts, n * (t + 1) / parts, kind);
    return !bad;
}

// ---- the greedy pick --------------------------------------------------------------------------------------------
//
// The first index of the largest of x [n] (torch.argmax's choice among equals), in two passes at the cache's pace
// (torch's own took 0.44 ms over Gemma's 256,000 logits here); -1 where n < 1 or some value is NaN (the caller's
// torch.argmax then picks, as it did).
int64_t argmax_f32(const float *x, int64_t n) {
    if (n < 1) return -1;
    float mx = -INFINITY;
    int64_t i = 0;
    int nan = 0;
#ifdef __AVX2__
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(x), bad = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m = _mm256_max_ps(m, v);
        }
        float t[8];
        _mm256_storeu_ps(t, m);
        for (int j = 0; j < 8; j++) mx = t[j] > mx ? t[j] : mx;
        nan = _mm256_movemask_ps(bad) != 0;
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > mx) mx = x[i];
    }
    if (nan) return -1;
    int64_t j = 0;
#ifdef __AVX2__
    const __m256 top = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), top, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; j < n; j++)
        if (x[j] == mx) return j;
    return -1;
}

// ---- saved caches: a checksum at memory speed ---------------------------------------------------------------
//
// Eight 64-bit lanes over stripes of 64 bytes: word v of lane i in stripe s is keyed k = v ^ CHECK_KEY[i] ^ s * P
// and adds lo32(k) * hi32(k) + v to lane i, all modulo 2^64. The sum does not depend on the order it is taken in,
// so the AVX-512, AVX2 and plain loops (and numpy's, kernels/cpu_quant.py: checksum_ref) agree exactly; the key's
// stripe term makes every position count. A tail short of a stripe is read as zero-padded. Not cryptographic: it
// finds damage (flipped bits, torn or zeroed pages, moved data), as the SHA-256 it replaced did, at 10x the speed.
#define CHECK_P 0x9E3779B97F4A7C15ULL
static const uint64_t CHECK_KEY[8] = {0xB8FE6C3923A44BBEULL, 0x7C01812CF721AD1CULL, 0xDED46DE9839097DBULL,
                                      0x7240A4A4B7B3671FULL, 0xCB79E64EB85F0A27ULL, 0xC2B1C6F0E59D4E97ULL,
                                      0x165BFA39CA1D7B5CULL, 0x3AA3C14C0A5E87E9ULL};

static inline void check_stripe_scalar(const uint64_t *v, uint64_t sp, uint64_t acc[8]) {
    for (int i = 0; i < 8; i++) {
        uint64_t k = v[i] ^ CHECK_KEY[i] ^ sp;
        acc[i] += (k & 0xFFFFFFFFu) * (k >> 32) + v[i];
    }
}

// the lanes of stripes s0 .. s1 of b, added to acc
static void check_stripes(const uint8_t *b, int64_t s0, int64_t s1, uint64_t acc[8]) {
    int64_t s = s0;
#if defined(KVCHAT_AVX512)
    __m512i a = _mm512_loadu_si512((const void *)acc), key = _mm512_loadu_si512((const void *)CHECK_KEY);
    __m512i sp = _mm512_set1_epi64((long long)((uint64_t)s0 * CHECK_P)), step = _mm512_set1_epi64((long long)CHECK_P);
    for (; s < s1; s++) {
        __m512i v = _mm512_loadu_si512((const void *)(b + 64 * s));
        __m512i k = _mm512_xor_si512(_mm512_xor_si512(v, key), sp);
        a = _mm512_add_epi64(a, _mm512_add_epi64(_mm512_mul_epu32(k, _mm512_srli_epi64(k, 32)), v));
        sp = _mm512_add_epi64(sp, step);
    }
    _mm512_storeu_si512((void *)acc, a);
#elif defined(__AVX2__)
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc), a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    __m256i k0 = _mm256_loadu_si256((const __m256i *)CHECK_KEY), k1 = _mm256_loadu_si256((const __m256i *)(CHECK_KEY + 4));
    __m256i sp = _mm256_set1_epi64x((long long)((uint64_t)s0 * CHECK_P)), step = _mm256_set1_epi64x((long long)CHECK_P);
    for (; s < s1; s++) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(b + 64 * s));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(b + 64 * s + 32));
        __m256i x0 = _mm256_xor_si256(_mm256_xor_si256(v0, k0), sp), x1 = _mm256_xor_si256(_mm256_xor_si256(v1, k1), sp);
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32)), v0));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32)), v1));
        sp = _mm256_add_epi64(sp, step);
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
#else
    for (; s < s1; s++) {
        uint64_t v[8];
        memcpy(v, b + 64 * s, 64);
        check_stripe_scalar(v, (uint64_t)s * CHECK_P, acc);
    }
#endif
}

void checksum64(const void *p, int64_t n, uint64_t *out) {
    const uint8_t *b = p;
    int64_t stripes = n / 64;
    uint64_t acc[8] = {0};
    int parts = 1;
#ifdef _OPENMP
    parts = omp_get_max_threads();
    if (parts > n / CHECK_PART) parts = (int)(n / CHECK_PART);
    if (parts < 1) parts = 1;
#endif
    if (parts == 1) {
        check_stripes(b, 0, stripes, acc);
    } else {                            // the lanes are sums: parts add up to the whole, in any order
        #pragma omp parallel for num_threads(parts) schedule(static)
        for (int t = 0; t < parts; t++) {
            uint64_t mine[8] = {0};
            check_stripes(b, stripes * t / parts, stripes * (t + 1) / parts, mine);
            #pragma omp critical
            for (int i = 0; i < 8; i++) acc[i] += mine[i];
        }
    }
    if (n % 64) {
        uint64_t v[8] = {0};
        memcpy(v, b + 64 * stripes, (size_t)(n % 64));
        check_stripe_scalar(v, (uint64_t)stripes * CHECK_P, acc);
    }
    memcpy(out, acc, sizeof acc);
}
