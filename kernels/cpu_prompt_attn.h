// Prompt rows' attention over full-precision (fp32 or bf16) pages, read in place: the rows of a prompt chunk, or a
// speculative step's verification rows, each over the held past and the chunk's rows up to its own (causal).
// Included by cpu_quant.c after the decode attention's helpers (exp_span, sum_run).
//
// Shapes. q [T, Hq, D] fp32, rotated at each row's position; the keys are page rows rows[0 .. P + T) (the chunk's
// own last), stored rotated: kp, vp [R, Hkv, D] fp32 or bf16 (bf16 != 0). Row t reads keys 0 .. P + t.
// sink_k [n_sink, Hkv, D] fp32 or NULL: the first n_sink keys as the chunk sees them (the sinks turned by the
// window's shift, which the caller computes: a handful of rows), read instead of their pages. outside [T, P + T]
// (a byte a key, nonzero: outside row t's own sliding window) or NULL. scale multiplies q . k; softcap > 0: scores
// become cap * tanh(s / cap); sink_logits [Hq] or NULL: one more logit per head that joins the softmax and carries
// no value (gpt-oss). out [T, Hq, D]. D a multiple of 16, at most 512.
//
// Work. Rows go in blocks of at most PA_QUERIES query vectors; in a block, tasks are (KV head, chunk of 256 keys,
// chunks starting at multiples of 256 whatever the call). A task turns each tile of 16 keys into fp32 columns once
// (kt [D][16]) for all the block's queries of its head, so a score is 16 lanes of multiply-adds with no horizontal
// sum; then each query's max, exp and sum over the chunk's keys it sees (in key order), then the chunk's values
// weighted by them (the values turned into fp32 rows once, vt [256][D], and four queries' sums kept in registers
// across all of them: 1.76 -> 1.29 ms for 24 rows x 9 heads over 4,120 keys of 64). The chunks of a query are merged by log-sum-exp in chunk order. Each query's arithmetic is the
// same whatever its block, the chunk's length and the threads (keys past its own carry a weight of exactly 0, chunks
// it does not see are skipped), so a row gives the same bits read in any chunk, as the torch path's blocks of 32
// do. Not the torch path's bits: its GEMMs sum in another order (tests hold the two within float rounding). AVX2
// keeps half as many sums in its 16 registers a pass (PA_SCORE_Q, PA_VALUE_D), each lane's arithmetic unchanged:
// AVX-512's bits.
#pragma once
#ifdef _OPENMP
#include <omp.h>
#endif

// 16 floats: one register on AVX-512, two on AVX2 (a struct the compiler keeps in registers; a 64-byte generic
// vector it moved through memory there), a generic vector elsewhere. pav_fma: acc + x * k, one rounding (fused where
// the build has FMA: the kernels are built without contraction); the same per lane in every build.
#if defined(__AVX512F__)
typedef __m512 pav_t;
static inline pav_t pav_zero(void) { return _mm512_setzero_ps(); }
static inline pav_t pav_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void pav_store(float *p, pav_t v) { _mm512_storeu_ps(p, v); }
static inline pav_t pa_fma(pav_t acc, float x, pav_t k) { return _mm512_fmadd_ps(_mm512_set1_ps(x), k, acc); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 lo, hi; } pav_t;
static inline pav_t pav_zero(void) { pav_t v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
static inline pav_t pav_load(const float *p) { pav_t v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return v; }
static inline void pav_store(float *p, pav_t v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline pav_t pa_fma(pav_t acc, float x, pav_t k) {
    __m256 xv = _mm256_set1_ps(x);
    pav_t v = {_mm256_fmadd_ps(xv, k.lo, acc.lo), _mm256_fmadd_ps(xv, k.hi, acc.hi)};
    return v;
}
#else
typedef float pav_t __attribute__((vector_size(64)));
typedef float pavu_t __attribute__((vector_size(64), aligned(4)));     // an unaligned load or store of 16 floats
static inline pav_t pav_zero(void) { pav_t v = {0}; return v; }
static inline pav_t pav_load(const float *p) { return *(const pavu_t *)p; }
static inline void pav_store(float *p, pav_t v) { *(pavu_t *)p = v; }
static inline pav_t pa_fma(pav_t acc, float x, pav_t k) { return acc + x * k; }
#endif

#define PA_TILE 16

static inline float pa_max(const float *s, int n) {     // the largest of s[0 .. n), -inf for none
    float m = -INFINITY;
    int j = 0;
#if defined(__AVX512F__)
    __m512 v = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(s + j));
    m = _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
    __m256 v = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// dst [8][8] (rows ldd floats apart) = the transpose of the 8 x 8 block at src (rows ld floats apart)
static inline void pa_transpose8(const float *src, int ld, float *dst, int ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + (size_t)i * ld);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_ps(dst + (size_t)k * ldd, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
        _mm256_storeu_ps(dst + (size_t)(k + 4) * ldd, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
    }
}
#endif

// dst [16][16] = the transpose of the 16 x 16 block at src (rows ld floats apart)
static inline void pa_transpose16(const float *src, int ld, float *dst) {
#if defined(__AVX512F__)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + (size_t)i * ld);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
            t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xDD);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + 16 * i, r[i]);
#elif defined(__AVX2__)
    for (int bi = 0; bi < 16; bi += 8)
        for (int bj = 0; bj < 16; bj += 8) pa_transpose8(src + (size_t)bi * ld + bj, ld, dst + 16 * bj + bi, 16);
#else
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) dst[16 * j + i] = src[(size_t)i * ld + j];
#endif
}
#define PA_QUERIES 128            // query vectors a block of rows holds (its rows times the group's heads)

typedef struct pa_args {
    int T, P, Hq, Hkv, D, bf16, n_sink;
    const float *q, *sink_k, *sink_logits;
    const void *kp, *vp;
    const int64_t *rows;
    const uint8_t *outside;
    float scale, softcap;
    float *out;
    // Keys and values read another way (quantized pages: attn_prompt_quant in cpu_kv_quant.c), or NULL: the pages
    // above. load(a, value, h, j, dst, scratch) puts key (value 0) or value (1) j of KV head h, as fp32 and as
    // attention reads it (a key rotated), into dst [D]; load(a, -1, h, 0, NULL, scratch) first, once a task, where
    // scratch is load_floats floats the task keeps (64-byte aligned) for whatever the loader caches.
    void (*load)(const struct pa_args *a, int value, int h, int j, float *dst, void *scratch);
    const void *ctx;
    int load_floats;
} pa_args_t;

// key or value j of KV head h as fp32 into dst (sink keys from sink_k when given)
static inline void pa_row(const pa_args_t *a, const void *pages, const float *sinks, int h, int j, float *dst) {
    int D = a->D;
    if (sinks && j < a->n_sink) {
        memcpy(dst, sinks + ((size_t)j * a->Hkv + h) * D, sizeof(float) * D);
        return;
    }
    size_t at = ((size_t)a->rows[j] * a->Hkv + h) * D;
    if (!a->bf16) {
        memcpy(dst, (const float *)pages + at, sizeof(float) * D);
        return;
    }
    const uint16_t *s = (const uint16_t *)pages + at;
    for (int d = 0; d < D; d++) { union { uint32_t u; float f; } v; v.u = (uint32_t)s[d] << 16; dst[d] = v.f; }
}

static inline void pa_key(const pa_args_t *a, int h, int j, float *dst, void *ls) {
    if (a->load) a->load(a, 0, h, j, dst, ls);
    else pa_row(a, a->kp, a->sink_k, h, j, dst);
}

static inline void pa_value(const pa_args_t *a, int h, int j, float *dst, void *ls) {
    if (a->load) a->load(a, 1, h, j, dst, ls);
    else pa_row(a, a->vp, NULL, h, j, dst);
}

#define PA_CHUNK 256              // keys a task reads: chunks start at multiples of it, whatever the call
#if defined(__AVX512F__)
#define PA_SCORE_Q 8              // queries a pass of the scores (their sums in registers: 8 of 32; 4 of AVX2's 16)
#define PA_VALUE_D 32             // a pass of the values: floats of each query in registers (eight chains; AVX2 four)
#else
#define PA_SCORE_Q 4
#define PA_VALUE_D 16
#endif

static size_t pa_task_floats(const pa_args_t *a, int R) {
    // kt, the tile's rows, the chunk's values (vt), scores, queries, the loader's scratch
    size_t D = a->D, ls = a->load ? ((size_t)a->load_floats + 15) / 16 * 16 : 0;
    return 2 * D * PA_TILE + D * PA_CHUNK + (size_t)R * PA_CHUNK + (size_t)R * D + 16 + ls;
}

// One task: KV head h, the rows t0 .. t1 - 1 (R = their query vectors), keys of chunk c: each query's max, exp-sum
// and unnormalized output over the chunk's keys it sees, into part[(r * nch + c) * (D + 2)] (sum 0: none seen).
// mem: pa_task_floats(D, R) floats, 64-byte aligned.
static void pa_task(const pa_args_t *a, int h, int t0, int t1, int c, int nch, float *part, float *mem) {
    int D = a->D, Hq = a->Hq, g = Hq / a->Hkv, R = (t1 - t0) * g;
    int lo = c * PA_CHUNK, hi = lo + PA_CHUNK < a->P + t1 ? lo + PA_CHUNK : a->P + t1;
    float *kt = mem, *row = kt + (size_t)D * PA_TILE, *vt = row + (size_t)D * PA_TILE, *S = vt + (size_t)D * PA_CHUNK;
    const float *qv[PA_QUERIES];
    float *qs = S + (size_t)R * PA_CHUNK, scale = a->scale, cap = a->softcap;
    void *ls = qs + ((size_t)R * D + 15) / 16 * 16;             // the loader's scratch
    if (a->load) a->load(a, -1, h, 0, NULL, ls);
    for (int r = 0; r < R; r++) {          // the queries times the scale, once
        const float *x = a->q + ((size_t)(t0 + r / g) * Hq + h * g + r % g) * D;
        float *y = qs + (size_t)r * D;
        for (int d = 0; d < D; d++) y[d] = x[d] * scale;
        qv[r] = y;
    }
    // scores S[r][j - lo] = q_r . k_j, 16 keys a tile
    for (int j0 = lo; j0 < hi; j0 += PA_TILE) {
        int n = hi - j0 < PA_TILE ? hi - j0 : PA_TILE;
        for (int jj = 0; jj < PA_TILE; jj++) {         // the tile's keys as rows, then as columns
            if (jj < n) pa_key(a, h, j0 + jj, row + (size_t)jj * D, ls);
            else memset(row + (size_t)jj * D, 0, sizeof(float) * D);
        }
        for (int d0 = 0; d0 < D; d0 += 16) pa_transpose16(row + d0, D, kt + (size_t)d0 * PA_TILE);
        float *s0 = S + (j0 - lo);
        int r = 0;
        for (; r + PA_SCORE_Q <= R; r += PA_SCORE_Q) {     // a group of queries a pass: each key column loaded
            pav_t acc[PA_SCORE_Q];                          // once for the group, its chains in flight
            for (int i = 0; i < PA_SCORE_Q; i++) acc[i] = pav_zero();
            for (int d = 0; d < D; d++) {
                pav_t k = pav_load(kt + (size_t)d * PA_TILE);
                for (int i = 0; i < PA_SCORE_Q; i++) acc[i] = pa_fma(acc[i], qv[r + i][d], k);
            }
            for (int i = 0; i < PA_SCORE_Q; i++) pav_store(s0 + (size_t)(r + i) * PA_CHUNK, acc[i]);
        }
        for (; r < R; r++) {                    // the same multiply-adds in the same order, one query
            pav_t acc = pav_zero();
            const float *x = qv[r];
            for (int d = 0; d < D; d++) acc = pa_fma(acc, x[d], pav_load(kt + (size_t)d * PA_TILE));
            pav_store(s0 + (size_t)r * PA_CHUNK, acc);
        }
    }
    // each query's exp over the chunk's keys it sees (0 .. P + t, inside its window), every other weight 0
    int width = (hi - lo + PA_TILE - 1) / PA_TILE * PA_TILE;
    for (int r = 0; r < R; r++) {
        int t = t0 + r / g, see = a->P + t + 1 < hi ? a->P + t + 1 : hi;
        const uint8_t *hide = a->outside ? a->outside + (size_t)t * (a->P + a->T) + lo : NULL;
        float *s = S + (size_t)r * PA_CHUNK, *o = part + ((size_t)r * nch + c) * (D + 2), m = -INFINITY, sum = 0.f;
        int n = see - lo;
        if (cap > 0.f)
            for (int j = 0; j < n; j++) s[j] = cap * tanhf(s[j] / cap);
        if (hide) {
            for (int j = 0; j < n; j++)
                if (!hide[j] && s[j] > m) m = s[j];
        } else {
            m = pa_max(s, n);
        }
        if (m == -INFINITY) n = 0;             // nothing of the chunk in its view
        if (n > 0) {
            sum = exp_span(s, 0, n, m);
            if (hide) {
                for (int j = 0; j < n; j++)
                    if (hide[j]) s[j] = 0.f;
                sum = sum_run(s, n);
            }
        }
        for (int j = n < 0 ? 0 : n; j < width; j++) s[j] = 0.f;
        o[D] = m;
        o[D + 1] = sum;
    }
    // O[r] = sum over the chunk's keys of S[r][j] * v_j, keys in order: the chunk's values as rows once, then each
    // group of queries runs over all of them with its sums in registers
    int nk = hi - lo;
    for (int jj = 0; jj < nk; jj++) pa_value(a, h, lo + jj, vt + (size_t)jj * D, ls);
    int r = 0;
    for (; r + 4 <= R; r += 4) {                // four queries a pass: each value row loaded once for the four
        const float *p0 = S + (size_t)r * PA_CHUNK, *p1 = p0 + PA_CHUNK, *p2 = p1 + PA_CHUNK, *p3 = p2 + PA_CHUNK;
        float *o0 = part + ((size_t)r * nch + c) * (D + 2), *o1 = o0 + (size_t)nch * (D + 2),
              *o2 = o1 + (size_t)nch * (D + 2), *o3 = o2 + (size_t)nch * (D + 2);
        float *o[4] = {o0, o1, o2, o3};
        const float *pp[4] = {p0, p1, p2, p3};
        int d0 = 0;
        for (; PA_VALUE_D == 32 && d0 + 32 <= D; d0 += 32) {     // two 16-float chunks of each: eight chains
            pav_t acc[8];
            for (int i = 0; i < 8; i++) acc[i] = pav_zero();
            for (int jj = 0; jj < nk; jj++) {
                pav_t v = pav_load(vt + (size_t)jj * D + d0), w = pav_load(vt + (size_t)jj * D + d0 + 16);
                for (int i = 0; i < 4; i++) {
                    acc[2 * i] = pa_fma(acc[2 * i], pp[i][jj], v);
                    acc[2 * i + 1] = pa_fma(acc[2 * i + 1], pp[i][jj], w);
                }
            }
            for (int i = 0; i < 4; i++) { pav_store(o[i] + d0, acc[2 * i]); pav_store(o[i] + d0 + 16, acc[2 * i + 1]); }
        }
        for (; d0 < D; d0 += 16) {
            pav_t acc[4];
            for (int i = 0; i < 4; i++) acc[i] = pav_zero();
            for (int jj = 0; jj < nk; jj++) {
                pav_t v = pav_load(vt + (size_t)jj * D + d0);
                for (int i = 0; i < 4; i++) acc[i] = pa_fma(acc[i], pp[i][jj], v);
            }
            for (int i = 0; i < 4; i++) pav_store(o[i] + d0, acc[i]);
        }
    }
    for (; r < R; r++) {                        // the same multiply-adds in the same order, one query
        const float *p = S + (size_t)r * PA_CHUNK;
        float *o = part + ((size_t)r * nch + c) * (D + 2);
        for (int d0 = 0; d0 < D; d0 += 16) {
            pav_t acc = pav_zero();
            for (int jj = 0; jj < nk; jj++) acc = pa_fma(acc, p[jj], pav_load(vt + (size_t)jj * D + d0));
            pav_store(o + d0, acc);
        }
    }
}

// A query's chunks merged by log-sum-exp in chunk order (merge_spans' arithmetic), its sink logit joining -> dst [D]
static void pa_merge(const float *part, int nch, int D, const float *sink, float *dst) {
    float mx = sink ? *sink : -INFINITY, total = 0.f;
    for (int c = 0; c < nch; c++) {
        const float *o = part + (size_t)c * (D + 2);
        if (o[D + 1] != 0.f && o[D] > mx) mx = o[D];
    }
    for (int d = 0; d < D; d++) dst[d] = 0.f;
    if (sink) total = expf(*sink - mx);
    for (int c = 0; c < nch; c++) {
        const float *o = part + (size_t)c * (D + 2);
        if (o[D + 1] == 0.f) continue;
        float w = expf(o[D] - mx);
        total += w * o[D + 1];
        for (int d = 0; d < D; d++) dst[d] += w * o[d];
    }
    for (int d = 0; d < D; d++) dst[d] /= total;
}

// 0 done, -1 out of memory, -3 shapes the kernel does not take (D not a multiple of 16 or past 512, heads)
int attn_prompt(const pa_args_t *a) {
    int g = a->Hkv > 0 ? a->Hq / a->Hkv : 0;
    if (a->T < 1 || a->P < 0 || a->Hkv < 1 || g < 1 || g * a->Hkv != a->Hq || g > PA_QUERIES / 2 || a->D < 16
        || a->D % 16 || a->D > 512 || a->n_sink < 0 || a->n_sink > a->P + a->T)
        return -3;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    // rows in blocks of at most PA_QUERIES query vectors; in a block, tasks (KV head, chunk of keys)
    int rb = PA_QUERIES / g, nch_all = (a->P + a->T + PA_CHUNK - 1) / PA_CHUNK;
    if (rb > a->T) rb = a->T;
    size_t each = (pa_task_floats(a, rb * g) + 15) / 16 * 16;
    float *mem = aligned_alloc(64, sizeof(float) * (each * threads + (size_t)a->Hkv * rb * g * nch_all * (a->D + 2)));
    if (!mem) return -1;
    float *part = mem + each * threads;
    for (int t0 = 0; t0 < a->T; t0 += rb) {
        int t1 = t0 + rb < a->T ? t0 + rb : a->T, R = (t1 - t0) * g;
        int nch = (a->P + t1 + PA_CHUNK - 1) / PA_CHUNK, tasks = a->Hkv * nch;
        #pragma omp parallel for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            int me = 0;
#ifdef _OPENMP
            me = omp_get_thread_num();
#endif
            int h = task / nch;
            pa_task(a, h, t0, t1, task % nch, nch, part + (size_t)h * R * nch * (a->D + 2), mem + each * me);
        }
        #pragma omp parallel for schedule(static)
        for (int i = 0; i < a->Hkv * R; i++) {
            int h = i / R, r = i % R, t = t0 + r / g, head = h * g + r % g;
            pa_merge(part + ((size_t)h * R + r) * nch * (a->D + 2), nch, a->D,
                     a->sink_logits ? a->sink_logits + head : NULL, a->out + ((size_t)t * a->Hq + head) * a->D);
        }
    }
    free(mem);
    return 0;
}
