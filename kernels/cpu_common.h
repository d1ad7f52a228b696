// Helpers shared by kernels/cpu_quant.c and kernels/cpu_kv_quant.c (two libraries, built separately).
#pragma once
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>      // every x86 variant: F16C's conversions exist without AVX2 (an AVX-only CPU's -march)
#endif

// IEEE half <-> float without _Float16 (gcc before 12 has none on x86): F16C where the variant has it, else the
// same conversions in integer arithmetic (round to nearest even; tests/test_kernel_variants.py holds both to
// numpy's over all 65,536 halves and a sweep of floats)
typedef uint16_t half_t;

static inline float f16_to_f32(half_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | (m << 13);                  // infinity, NaN (payload kept)
    } else if (e) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (!m) {
        bits = sign;
    } else {                                                    // subnormal: m * 2^-24, normalized
        e = 113;
        while (!(m & 0x400u)) { m <<= 1; e--; }
        bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline half_t f32_to_f16(float f) {
#ifdef __F16C__
    return (half_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (e == 0xff) return (half_t)(sign | 0x7c00u | (m ? 0x200u | (m >> 13) : 0));   // infinity, quiet NaN
    int he = (int)e - 112;
    if (he >= 31) return (half_t)(sign | 0x7c00u);                                  // too large: infinity
    uint32_t out, rest, mid;
    if (he <= 0) {                                                                  // a subnormal half, or zero
        if (he < -10) return (half_t)sign;
        int shift = 14 - he;
        m |= 0x800000u;
        out = m >> shift, rest = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
    } else {
        out = ((uint32_t)he << 10) | (m >> 13), rest = m & 0x1fffu, mid = 0x1000u;
    }
    if (rest > mid || (rest == mid && (out & 1u))) out++;      // a carry into the exponent is the right answer
    return (half_t)(sign | out);
#endif
}

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
// at ((c * Hq + i) * (D + 2)) the span's unnormalized output [D], its max score, its exp-sum. -> out [Hq, D].
// sink_logits [Hq] (NULL: none): one more logit per query head (gpt-oss) that joins the max and the sum but
// carries no value, folded in here once rather than into a span
static void merge_spans(const float *part, int S, int Hq, int D, const float *sink_logits, float *out) {
    for (int i = 0; i < Hq; i++) {
        float mx = sink_logits ? sink_logits[i] : -INFINITY, total = 0.f, *dst = out + (size_t)i * D;
        for (int c = 0; c < S; c++) {
            float m = part[((size_t)c * Hq + i) * (D + 2) + D];
            mx = m > mx ? m : mx;
        }
        for (int d = 0; d < D; d++) dst[d] = 0.f;
        if (sink_logits) total = expf(sink_logits[i] - mx);
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

// Where one sequence's decode row put its attention (the kernels' optional mass output): after the spans (scores
// [Hq, L] holding exp(s - the span's max) of every row, part [S][Hq][D + 2] each span's max and exp-sum, as
// merge_spans reads them), row p's softmax probability is added to mass[h][cols[p]] for each head h; mass is
// [Hq, mcols], its last column the learned sink's share (0 without sink logits). Rows split into spans as the
// kernels split them: span c holds rows [L * c / S, L * (c + 1) / S).
static inline float sum_run(const float *x, int n) {
    int p = 0;
    float sum = 0.f;
#ifdef __AVX2__
    if (n >= 8) {
        __m256 acc = _mm256_loadu_ps(x);
        for (p = 8; p + 8 <= n; p += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + p));
        sum = hsum8(acc);
    }
#endif
    for (; p < n; p++) sum += x[p];
    return sum;
}

static void spans_mass(const float *scores, int L, const float *part, int S, int Hq, int D,
                       const float *sink_logits, const int *cols, int mcols, float *mass) {
    float fs[128 * 64];         // per head (at most 128) and span (at most 64): from the span's exp to the probability
    for (int i = 0; i < Hq; i++) {
        float mx = sink_logits ? sink_logits[i] : -INFINITY, total = 0.f, *m = mass + (size_t)i * mcols;
        for (int c = 0; c < S; c++) {
            float v = part[((size_t)c * Hq + i) * (D + 2) + D];
            mx = v > mx ? v : mx;
        }
        if (sink_logits) total = expf(sink_logits[i] - mx);
        for (int c = 0; c < S; c++) {
            const float *o = part + ((size_t)c * Hq + i) * (D + 2);
            fs[i * S + c] = o[D + 1] == 0.f ? 0.f : expf(o[D] - mx);
            total += fs[i * S + c] * o[D + 1];
        }
        for (int c = 0; c < S; c++) fs[i * S + c] /= total;
        for (int j = 0; j < mcols; j++) m[j] = 0.f;
        if (sink_logits) m[mcols - 1] = expf(sink_logits[i] - mx) / total;
    }
    for (int c = 0; c < S; c++) {
        int lo = (int)((long)L * c / S), hi = (int)((long)L * (c + 1) / S);
        for (int p = lo; p < hi;) {             // a block's rows are one run of a column: found once, summed per head
            int e = p + 1, col = cols[p];
            while (e < hi && cols[e] == col) e++;
            for (int i = 0; i < Hq; i++)
                mass[(size_t)i * mcols + col] += fs[i * S + c] * sum_run(scores + (size_t)i * L + p, e - p);
            p = e;
        }
    }
}

static inline uint16_t to_bf16(float f) {
    // round to nearest even, as torch's float -> bfloat16 conversion (NaN kept a NaN)
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

// ---- a decode matvec's rows shared out among the team ------------------------------------------------------
// A static split leaves the first thread done waiting for the last: on a shared machine two threads streaming the
// same bytes finish 6-12% of a matvec apart (the Zen 4 of issue 43, part eight). Each thread starts on its static
// share of `steps` (row pairs) and takes it `batch` steps a claim from the front, so its rows stream in order and its
// prefetch ahead stays in its share; a thread whose share is done takes the back half of the largest share left
// and streams that. A row's bits do not depend on which thread reads it.
#ifdef _OPENMP
#include <omp.h>
#endif
#define MAXT 64

typedef struct { _Alignas(64) unsigned long long w; } share_t;     // steps left: lo | hi << 32

static inline unsigned long long share_w(unsigned long long lo, unsigned long long hi) { return lo | hi << 32; }

// The team for `steps` steps (at most MAXT threads, at most one a step) with its shares set out
static inline int shares_init(share_t *s, int steps) {
#ifdef _OPENMP
    int nt = omp_get_max_threads();
#else
    int nt = 1;
#endif
    if (nt > MAXT) nt = MAXT;
    if (nt > steps) nt = steps > 1 ? steps : 1;
    for (int t = 0; t < nt; t++)
        s[t].w = share_w((unsigned long long)steps * t / nt, (unsigned long long)steps * (t + 1) / nt);
    return nt;
}

// Thread `me` of a team of `team` over nt shares: its next steps [*lo, *hi), from its own shares (me, me + team,
// ... when the team came smaller than asked) or the back half of the largest other; 0 when nothing is left
static inline int share_next(share_t *s, int nt, int me, int team, int batch, int *lo, int *hi) {
    for (int t = me; t < nt; t += team)
        for (;;) {
            unsigned long long w = __atomic_load_n(&s[t].w, __ATOMIC_ACQUIRE);
            unsigned a = (unsigned)w, b = (unsigned)(w >> 32);
            if (a >= b) break;
            unsigned e = b - a > (unsigned)batch ? a + batch : b;
            if (__atomic_compare_exchange_n(&s[t].w, &w, share_w(e, b), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                *lo = (int)a, *hi = (int)e;
                return 1;
            }
        }
    for (;;) {                       // own shares done: split the largest left
        int best = -1;
        unsigned most = 0;
        unsigned long long bw = 0;
        for (int t = 0; t < nt; t++) {
            unsigned long long w = __atomic_load_n(&s[t].w, __ATOMIC_ACQUIRE);
            unsigned a = (unsigned)w, b = (unsigned)(w >> 32);
            if (a < b && b - a > most) most = b - a, best = t, bw = w;
        }
        if (best < 0) return 0;
        unsigned a = (unsigned)bw, b = (unsigned)(bw >> 32);
        unsigned mid = most >= 2u * batch ? a + most / 2 : a;     // too little to split: all of it
        if (!__atomic_compare_exchange_n(&s[best].w, &bw, share_w(a, mid), 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        // the taken half becomes this thread's share (others may split it in turn), its first batch claimed here
        unsigned e = b - mid > (unsigned)batch ? mid + batch : b;
        __atomic_store_n(&s[me].w, share_w(e, b), __ATOMIC_RELEASE);
        *lo = (int)mid, *hi = (int)e;
        return 1;
    }
}

#ifdef _OPENMP
#define TEAM_ME() omp_get_thread_num()
#define TEAM_SIZE() omp_get_num_threads()
#else
#define TEAM_ME() 0
#define TEAM_SIZE() 1
#endif
// A decode matvec's loop over `steps` steps shared among the team: `SHARED_STEPS(n, batch, V) { body }` runs the body
// in a parallel region for each step V this thread claims (share_next). Declares its shares in the enclosing scope:
// one use a scope.
#define SHARED_STEPS(steps, batch, V) \
    share_t shares_[MAXT]; \
    int nt_ = shares_init(shares_, (steps)); \
    _Pragma("omp parallel num_threads(nt_)") \
    for (int me_ = TEAM_ME(), team_ = TEAM_SIZE(), lo_, hi_; share_next(shares_, nt_, me_, team_, batch, &lo_, &hi_);) \
        for (int V = lo_; V < hi_; V++)

// Exported by both libraries (each includes this header once): the half conversions as this build has them (the
// tests hold every variant's to numpy's), and what the library was compiled with.
void kvchat_f16_to_f32(const half_t *h, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f16_to_f32(h[i]);
}

void kvchat_f32_to_f16(const float *x, half_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_f16(x[i]);
}

// What this library was compiled with: "isa=avx2+fma+f16c openmp=1 cc=12.2.0"
const char *kvchat_build_info(void) {
    return "isa="
#if defined(__AVX512F__)
        "avx512f+"
#endif
#if defined(__AVX512VNNI__)
        "vnni+"
#endif
#if defined(__AVX512BF16__)
        "bf16+"
#endif
#if defined(__AVX2__)
        "avx2+"
#endif
#if defined(__FMA__)
        "fma+"
#endif
#if defined(__F16C__)
        "f16c+"
#endif
#if defined(__ARM_NEON)
        "neon+"
#endif
        "base"
#ifdef _OPENMP
        " openmp=1"
#else
        " openmp=0"
#endif
        " cc=" __VERSION__;
}
