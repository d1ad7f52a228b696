// Decode attention over quantized KV pages, a library of its own (cpu_quant.py builds it in the
// background: its many specializations take longer to compile than everything else together).
#include "cpu_common.h"

// ---- decode attention over quantized KV pages --------------------------------------------------------
// One new token attends over a sequence's held past, read in place from quantized pages (int8, fp8
// e4m3, packed int4; scales per channel over a block, per token, or per group of channels; fp16
// scales, fp8's one-byte powers of two, fp16 zero points) and from the full-precision rows a
// quantized component keeps beside its pages: the table's first block (`head`, when kept) and the
// sequence's last, partly filled block (`tail`). Keys are stored before RoPE: each key row is
// dequantized and rotated in registers at its effective position, once for the g query heads of
// its group. Work items are (kv head, span of rows); each computes its scores, exponentiates them
// against its own maximum and accumulates values; the spans merge by log-sum-exp at the end.
typedef struct {
    const void *data, *scale, *zero;   // pages [blocks, ...] as kernels/formats.py lays them out
    const void *head, *tail;           // [bs, H, D] full precision; head NULL: block 0 lives in the pages
    int kind;                          // 0 int8, 1 fp8 e4m3, 2 int4 (channel 2i low nibble, 2i+1 high)
    int axis;                          // 0 per channel over the block, 1 per token, 2 per group of channels
    int group;                         // channels per group (axis 2)
    int full;                          // head/tail dtype: 0 fp32, 1 bf16, 2 fp16
} kv_comp;

// the widest head the decode attention takes (Gemma 4's global layers: 512)
#define KV_MAX_D 512

static float fp8_lut[256];
static int fp8_ready = 0;

static void fp8_init(void) {
    // e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN
    if (fp8_ready) return;
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf(m / 8.f, -6);
        if (e == 15 && m == 7) v = NAN;
        fp8_lut[c] = c & 128 ? -v : v;
    }
    fp8_ready = 1;
}

static inline float pow2_f(uint8_t code) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)code << 23;
    return v.f;
}

static inline float scale_f(const kv_comp *c, const void *p, size_t i) {
    return c->kind == 1 ? pow2_f(((const uint8_t *)p)[i]) : f16_to_f32(((const half_t *)p)[i]);
}

static inline const float *full_row(const void *base, int full, size_t off, int D, float *buf) {
    if (full == 0) return (const float *)base + off;
    if (full == 1) {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int d = 0; d < D; d++) { union { uint32_t u; float f; } v; v.u = (uint32_t)s[d] << 16; buf[d] = v.f; }
    } else {
        const half_t *s = (const half_t *)base + off;
        for (int d = 0; d < D; d++) buf[d] = f16_to_f32(s[d]);
    }
    return buf;
}

typedef struct {        // a work item's per-channel scales of the block it is in (axis 0)
    int64_t id;
    float s[KV_MAX_D], z[KV_MAX_D];
} chan_scales;

// Row `slot` of head h of one component as float32 (before RoPE for keys): a pointer into the pages'
// full-precision rows, or buf filled by dequantizing the codes exactly as kernels/reference.py does
// (code * scale, then + zero: no fused multiply-add, so the values are bit-identical to torch's).
static const float *kv_row(const kv_comp *c, int H, int D, int bs, int n_full, const int64_t *table, int64_t slot,
                           int h, float *buf, chan_scales *cs) {
    int64_t b = slot / bs, off = slot % bs;
    if (b >= n_full) return full_row(c->tail, c->full, ((size_t)off * H + h) * D, D, buf);
    if (b == 0 && c->head) return full_row(c->head, c->full, ((size_t)off * H + h) * D, D, buf);
    int64_t id = table[b];
    size_t r = ((size_t)id * bs + off) * H + h;
    if (c->kind == 0) {
        const int8_t *q = (const int8_t *)c->data + r * D;
        for (int d = 0; d < D; d++) buf[d] = (float)q[d];
    } else if (c->kind == 1) {
        const uint8_t *q = (const uint8_t *)c->data + r * D;
        for (int d = 0; d < D; d++) buf[d] = fp8_lut[q[d]];
    } else {
        const uint8_t *q = (const uint8_t *)c->data + r * (D / 2);
        for (int i = 0; i < D / 2; i++) { buf[2 * i] = (float)(q[i] & 15); buf[2 * i + 1] = (float)(q[i] >> 4); }
    }
    if (c->axis == 0) {
        if (cs->id != id) {
            size_t o = ((size_t)id * H + h) * D;
            for (int d = 0; d < D; d++) cs->s[d] = scale_f(c, c->scale, o + d);
            for (int d = 0; d < D; d++) cs->z[d] = c->zero ? f16_to_f32(((const half_t *)c->zero)[o + d]) : 0.f;
            cs->id = id;
        }
        if (c->zero) for (int d = 0; d < D; d++) buf[d] = buf[d] * cs->s[d] + cs->z[d];
        else for (int d = 0; d < D; d++) buf[d] = buf[d] * cs->s[d];
    } else if (c->axis == 1) {
        float s = scale_f(c, c->scale, r);
        if (c->zero) {
            float z = f16_to_f32(((const half_t *)c->zero)[r]);
            for (int d = 0; d < D; d++) buf[d] = buf[d] * s + z;
        } else {
            for (int d = 0; d < D; d++) buf[d] = buf[d] * s;
        }
    } else {
        int G = c->group, ng = D / G;
        for (int g = 0; g < ng; g++) {
            float s = scale_f(c, c->scale, r * ng + g);
            float *o = buf + g * G;
            if (c->zero) {
                float z = f16_to_f32(((const half_t *)c->zero)[r * ng + g]);
                for (int j = 0; j < G; j++) o[j] = o[j] * s + z;
            } else {
                for (int j = 0; j < G; j++) o[j] = o[j] * s;
            }
        }
    }
    return buf;
}

static inline void rope_row(const float *x, const float *cs, const float *sn, int D, float *out) {
    // rotate-half RoPE with half tables cs, sn [D/2]: the same products and sums as attention.rotate
    int h = D / 2;
    for (int d = 0; d < h; d++) {
        out[d] = x[d] * cs[d] + x[d + h] * -sn[d];
        out[d + h] = x[d + h] * cs[d] + x[d] * sn[d];
    }
}

typedef struct {        // what every work item of one call reads
    const kv_comp *kc, *vc;
    const float *q, *knew, *vnew, *cos_h, *sin_h;
    const int64_t *slots, *table, *pos;
    int Hq, Hkv, D, bs, P, L, n_full, g;
    float sm_scale;
    float *scores, *part;      // scores [Hq, L]; part [spans, Hq, D + 2]
} qattn;
typedef void (*pass_fn)(const qattn *, int h, int j0, int span, int lo, int hi);
#define QCHUNK 64           // rows a work item reads for every kv head before moving on (a multiple of 8)

#ifdef __AVX2__
// The vector path: rows in the quantized pages, D a multiple of 16, groups a multiple of 8. It is
// specialized per (code kind, scale axis) so that the inner loops carry no format branches. A row's
// scales are set up once (axis 0: the block's channel scales, converted when the block changes; axis 1:
// one per token; axis 2: one per group), then 8 channels at a time are widened, scaled (multiply, then
// add the zero: the same two roundings as torch) and used in registers.
typedef struct {
    const uint8_t *codes;
    __m256 s1, z1;                 // axis 1
    float gs[32], gz[32];          // axis 2, per group
} qrow;

static inline int seg_end(const qattn *a, int p, int hi, int64_t *b) {
    // the rows p.. of the past that share p's block (slots ascend): one division per block, not per row
    int64_t base = a->slots[p] / a->bs;
    *b = base;
    base *= a->bs;
    int e = p + 1, lim = hi < a->P ? hi : a->P;
    while (e < lim && a->slots[e] < base + a->bs) e++;
    return e;
}

static inline int seg_quant(const qattn *a, const kv_comp *c, int64_t b) {
    return b < a->n_full && !(b == 0 && c->head);
}

static void prefetch_rows(const qattn *a, const kv_comp *c, int lo, int hi, int h) {
    // ask for the quantized rows lo..hi of kv head h (h < 0: every kv head, contiguous within a block) ahead of use
    int lim = hi < a->P ? hi : a->P;
    size_t head = c->kind == 2 ? a->D / 2 : a->D, rowbytes = (size_t)a->Hkv * head;
    for (int p = lo; p < lim;) {
        int64_t b;
        int end = seg_end(a, p, lim, &b);
        if (seg_quant(a, c, b)) {
            const char *first = (const char *)c->data + ((size_t)a->table[b] * a->bs + (a->slots[p] - b * a->bs)) * rowbytes;
            size_t n = (size_t)(a->slots[end - 1] - a->slots[p] + 1) * rowbytes;
            if (h < 0)
                for (size_t o = 0; o < n; o += 64) _mm_prefetch(first + o, _MM_HINT_T1);
            else
                for (size_t r = h * head; r < n; r += rowbytes)
                    for (size_t o = 0; o < head; o += 64) _mm_prefetch(first + r + o, _MM_HINT_T1);
        }
        p = end;
    }
}

static inline void chan_setup(const qattn *a, const kv_comp *c, int64_t id, int h, chan_scales *cs) {
    // the block's channel scales and zeros as float32, 8 at a time (fp16 widened by F16C, fp8 exponents shifted)
    int D = a->D;
    size_t o = ((size_t)id * a->Hkv + h) * D;
    for (int d = 0; d < D; d += 8) {
        __m256 sv;
        if (c->kind == 1)
            sv = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)c->scale + o + d))), 23));
        else
            sv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const half_t *)c->scale + o + d)));
        _mm256_storeu_ps(cs->s + d, sv);
        _mm256_storeu_ps(cs->z + d, c->zero ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const half_t *)c->zero + o + d)))
                                            : _mm256_setzero_ps());
    }
    cs->id = id;
}

static inline __m256 hsum8x8(const __m256 *v) {
    // the sums of 8 vectors, as one vector
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline void row_setup(const qattn *a, const kv_comp *c, int64_t id, int64_t off, int h, int kind, int axis,
                             qrow *r) {
    int D = a->D;
    size_t row = ((size_t)id * a->bs + off) * a->Hkv + h;
    r->codes = (const uint8_t *)c->data + row * (kind == 2 ? D / 2 : D);
    if (axis == 1) {
        r->s1 = _mm256_set1_ps(scale_f(c, c->scale, row));
        r->z1 = _mm256_set1_ps(c->zero ? f16_to_f32(((const half_t *)c->zero)[row]) : 0.f);
    } else if (axis == 2) {
        int ng = D / c->group;
        for (int i = 0; i < ng; i++) {
            r->gs[i] = scale_f(c, c->scale, row * ng + i);
            r->gz[i] = c->zero ? f16_to_f32(((const half_t *)c->zero)[row * ng + i]) : 0.f;
        }
    }
}

static inline __m256 codes8(const uint8_t *codes, int d, int kind) {
    if (kind == 0)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + d))));
    if (kind == 1) {               // e4m3: the magnitude bits shifted into a float's exponent and mantissa,
        // times 2^120 (exact for normals and subnormals alike), then the sign
        __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + d)));
        __m256i mag = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7f)), 20);
        __m256i sgn = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
        __m256 x = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
        return _mm256_or_ps(x, _mm256_castsi256_ps(sgn));
    }
    int32_t b;                     // int4: channel 2i in the low nibble of byte i, 2i + 1 in the high one,
    memcpy(&b, codes + d / 2, 4);  // so channel c is bits 4c..4c+3 of the 32-bit word: one shift per lane
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(b), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
}

static inline __m256 deq8(const qrow *r, const chan_scales *cs, int group, int d, int kind, int axis) {
    __m256 x = codes8(r->codes, d, kind), s, z;
    if (axis == 0) { s = _mm256_loadu_ps(cs->s + d); z = _mm256_loadu_ps(cs->z + d); }
    else if (axis == 1) { s = r->s1; z = r->z1; }
    else { s = _mm256_set1_ps(r->gs[d / group]); z = _mm256_set1_ps(r->gz[d / group]); }
    return _mm256_fmadd_ps(x, s, z);     // one rounding (torch rounds code * scale, then + zero)
}

// Scores of one kv head's rows lo..hi for its G query heads; G is a constant in each specialization,
// so the G accumulators stay in registers and the rotated key never goes to memory.
static inline __attribute__((always_inline)) void k_pass(const qattn *a, int h, int j0, int lo, int hi, int kind,
                                                         int axis, const int G) {
    const kv_comp *c = a->kc;
    int D = a->D, half = D / 2;
    float buf[KV_MAX_D], kr[KV_MAX_D];
    chan_scales cs;
    cs.id = -1;
    qrow r;
    const float *q0 = a->q + (size_t)(h * a->g + j0) * D;
    float *s0 = a->scores + (size_t)(h * a->g + j0) * a->L;
    __m256 pend[4][8];          // rows' partial sums waiting for a batched reduction, from row p0
    int np = 0, p0 = lo;
    for (int p = lo; p < hi;) {
        int64_t b = 0;
        int end = p < a->P ? seg_end(a, p, hi, &b) : p + 1;
        int quant = p < a->P && seg_quant(a, c, b);
        int64_t id = quant ? a->table[b] : -1, base = b * a->bs;
        if (quant && axis == 0 && cs.id != id) chan_setup(a, c, id, h, &cs);
        for (; p < end; p++) {
            const float *cp = a->cos_h + (size_t)a->pos[p] * half, *sp = a->sin_h + (size_t)a->pos[p] * half;
            if (quant) {
                row_setup(a, c, id, a->slots[p] - base, h, kind, axis, &r);
                __m256 acc[4], acc2[4];    // two chains per query head: half the latency
                for (int j = 0; j < G; j++) acc[j] = acc2[j] = _mm256_setzero_ps();
                for (int d = 0; d < half; d += 8) {
                    __m256 xl = deq8(&r, &cs, c->group, d, kind, axis), xh = deq8(&r, &cs, c->group, d + half, kind, axis);
                    __m256 cv = _mm256_loadu_ps(cp + d), sv = _mm256_loadu_ps(sp + d);
                    __m256 rl = _mm256_fnmadd_ps(xh, sv, _mm256_mul_ps(xl, cv));
                    __m256 rh = _mm256_fmadd_ps(xl, sv, _mm256_mul_ps(xh, cv));
                    for (int j = 0; j < G; j++) {
                        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + (size_t)j * D + d), rl, acc[j]);
                        acc2[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + (size_t)j * D + d + half), rh, acc2[j]);
                    }
                }
                if (!np) p0 = p;
                for (int j = 0; j < G; j++) pend[j][np] = _mm256_add_ps(acc[j], acc2[j]);
                if (++np == 8) {        // eight rows' sums reduced together
                    for (int j = 0; j < G; j++)
                        _mm256_storeu_ps(s0 + (size_t)j * a->L + p0, _mm256_mul_ps(hsum8x8(pend[j]), _mm256_set1_ps(a->sm_scale)));
                    np = 0;
                }
            } else {
                for (int k = 0; k < np; k++)
                    for (int j = 0; j < G; j++) s0[(size_t)j * a->L + p0 + k] = hsum8(pend[j][k]) * a->sm_scale;
                np = 0;
                const float *k = p < a->P ? kv_row(c, a->Hkv, D, a->bs, a->n_full, a->table, a->slots[p], h, buf, &cs)
                                          : a->knew + (size_t)h * D;
                rope_row(k, cp, sp, D, kr);
                for (int j = 0; j < G; j++)
                    s0[(size_t)j * a->L + p] = dot_f32(q0 + (size_t)j * D, kr, D) * a->sm_scale;
            }
        }
    }
    for (int k = 0; k < np; k++)
        for (int j = 0; j < G; j++) s0[(size_t)j * a->L + p0 + k] = hsum8(pend[j][k]) * a->sm_scale;
}

// Values: within a block's run of rows, 8 channels at a time, the G outputs' accumulators in registers.
static inline __attribute__((always_inline)) void v_pass(const qattn *a, int h, int j0, int span, int lo, int hi,
                                                         int kind, int axis, const int G) {
    const kv_comp *c = a->vc;
    int D = a->D, bs = a->bs;
    float buf[KV_MAX_D];
    chan_scales cs;
    cs.id = -1;
    float *o0 = a->part + ((size_t)span * a->Hq + h * a->g + j0) * (D + 2);
    const float *w0 = a->scores + (size_t)(h * a->g + j0) * a->L;
    for (int p = lo; p < hi;) {
        int64_t b = 0;
        int end = p < a->P ? seg_end(a, p, hi, &b) : p + 1;
        int quant = p < a->P && seg_quant(a, c, b);
        if (!quant) {
            for (; p < end; p++) {
                const float *v = p < a->P ? kv_row(c, a->Hkv, D, bs, a->n_full, a->table, a->slots[p], h, buf, &cs)
                                          : a->vnew + (size_t)h * D;
                for (int j = 0; j < G; j++) {
                    float w = w0[(size_t)j * a->L + p], *o = o0 + (size_t)j * (D + 2);
                    for (int d = 0; d < D; d++) o[d] += w * v[d];
                }
            }
            continue;
        }
        int64_t id = a->table[b], base = b * bs;
        if (axis == 0 && cs.id != id) chan_setup(a, c, id, h, &cs);
        int n = end - p, ng = axis == 2 ? D / c->group : 1;
        const uint8_t *rowp[256];
        float rs[256 * (KV_MAX_D / 16)], rz[256 * (KV_MAX_D / 16)];   // rows x groups of at least 16
        size_t rowbytes = kind == 2 ? D / 2 : D;
        for (int i = 0; i < n; i++) {
            size_t row = ((size_t)id * bs + (a->slots[p + i] - base)) * a->Hkv + h;
            rowp[i] = (const uint8_t *)c->data + row * rowbytes;
            if (axis != 0)
                for (int k = 0; k < ng; k++) {
                    rs[i * ng + k] = scale_f(c, c->scale, row * ng + k);
                    rz[i * ng + k] = c->zero ? f16_to_f32(((const half_t *)c->zero)[row * ng + k]) : 0.f;
                }
        }
        float ws[256 * 4], zs[4] = {0.f, 0.f, 0.f, 0.f};       // axes 1 and 2: weight times scale per row, weight times zero summed
        int span_d = axis == 1 ? D : c->group;
        for (int d = 0; d < D; d += 8) {
            __m256 acc[8];
            for (int j = 0; j < G; j++) acc[j] = _mm256_loadu_ps(o0 + (size_t)j * (D + 2) + d);
            if (axis == 0) {               // scales per channel: dequantize, then weight
                __m256 s = _mm256_loadu_ps(cs.s + d), z = _mm256_loadu_ps(cs.z + d);
                for (int i = 0; i < n; i++) {
                    __m256 x = _mm256_fmadd_ps(codes8(rowp[i], d, kind), s, z);
                    for (int j = 0; j < G; j++)
                        acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + (size_t)j * a->L + p + i), x, acc[j]);
                }
            } else {                       // a scale per row (and group): sum of (w * s) * code, plus sum of w * z
                if (d % span_d == 0) {
                    int k = d / span_d;
                    for (int j = 0; j < G; j++) zs[j] = 0.f;
                    for (int i = 0; i < n; i++)
                        for (int j = 0; j < G; j++) {
                            float w = w0[(size_t)j * a->L + p + i];
                            ws[i * G + j] = w * rs[i * ng + k];
                            zs[j] += w * rz[i * ng + k];
                        }
                }
                for (int i = 0; i < n; i++) {
                    __m256 x = codes8(rowp[i], d, kind);
                    for (int j = 0; j < G; j++) acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(ws + i * G + j), x, acc[j]);
                }
                if (c->zero)
                    for (int j = 0; j < G; j++) acc[j] = _mm256_add_ps(acc[j], _mm256_set1_ps(zs[j]));
            }
            for (int j = 0; j < G; j++) _mm256_storeu_ps(o0 + (size_t)j * (D + 2) + d, acc[j]);
        }
        p = end;
    }
}

// Specializations: the formats kernels/formats.py makes (int8 and fp8 per channel or per token, int4 per
// channel or per group) for 1 to 4 query heads at a time; larger groups run 4 at a time.
#define QPASS_G(kind, axis, G) \
    static void kp_##kind##_##axis##_##G(const qattn *a, int h, int j0, int span, int lo, int hi) { (void)span; k_pass(a, h, j0, lo, hi, kind, axis, G); } \
    static void vp_##kind##_##axis##_##G(const qattn *a, int h, int j0, int span, int lo, int hi) { v_pass(a, h, j0, span, lo, hi, kind, axis, G); }
#define QPASS(kind, axis) QPASS_G(kind, axis, 1) QPASS_G(kind, axis, 2) QPASS_G(kind, axis, 3) QPASS_G(kind, axis, 4)
#define QROW(pre, kind, axis) {pre##_##kind##_##axis##_1, pre##_##kind##_##axis##_2, pre##_##kind##_##axis##_3, \
    pre##_##kind##_##axis##_4}
QPASS(0, 0) QPASS(0, 1) QPASS(1, 0) QPASS(1, 1) QPASS(2, 0) QPASS(2, 2)
static const pass_fn k_passes[9][4] = {QROW(kp, 0, 0), QROW(kp, 0, 1), {0}, QROW(kp, 1, 0), QROW(kp, 1, 1), {0},
                                       QROW(kp, 2, 0), {0}, QROW(kp, 2, 2)};
static const pass_fn v_passes[9][4] = {QROW(vp, 0, 0), QROW(vp, 0, 1), {0}, QROW(vp, 1, 0), QROW(vp, 1, 1), {0},
                                       QROW(vp, 2, 0), {0}, QROW(vp, 2, 2)};
#else
static void prefetch_rows(const qattn *a, const kv_comp *c, int lo, int hi, int h) {
    (void)a; (void)c; (void)lo; (void)hi; (void)h;
}
#endif

// The scalar path (any D, any group; no AVX2): rows dequantized into a buffer by kv_row.
static void k_pass_any(const qattn *a, int h, int j0, int span, int lo, int hi) {
    (void)span; (void)j0;
    int D = a->D, half = D / 2, g = a->g;
    float buf[KV_MAX_D], kr[KV_MAX_D];
    chan_scales cs;
    cs.id = -1;
    for (int p = lo; p < hi; p++) {
        const float *k = p < a->P ? kv_row(a->kc, a->Hkv, D, a->bs, a->n_full, a->table, a->slots[p], h, buf, &cs)
                                  : a->knew + (size_t)h * D;
        rope_row(k, a->cos_h + (size_t)a->pos[p] * half, a->sin_h + (size_t)a->pos[p] * half, D, kr);
        for (int j = 0; j < g; j++)
            a->scores[(size_t)(h * g + j) * a->L + p] = dot_f32(a->q + (size_t)(h * g + j) * D, kr, D) * a->sm_scale;
    }
}

static void v_pass_any(const qattn *a, int h, int j0, int span, int lo, int hi) {
    (void)j0;
    int D = a->D, g = a->g;
    float buf[KV_MAX_D];
    chan_scales cs;
    cs.id = -1;
    for (int p = lo; p < hi; p++) {
        const float *v = p < a->P ? kv_row(a->vc, a->Hkv, D, a->bs, a->n_full, a->table, a->slots[p], h, buf, &cs)
                                  : a->vnew + (size_t)h * D;
        for (int j = 0; j < g; j++) {
            float w = a->scores[(size_t)(h * g + j) * a->L + p], *o = a->part + ((size_t)span * a->Hq + h * g + j) * (D + 2);
            for (int d = 0; d < D; d++) o[d] += w * v[d];
        }
    }
}

// One pass (keys or values) over span c's rows lo..hi: chunks of QCHUNK rows, every kv head of a chunk in turn
// (a row's heads share its cache lines, so memory streams through the pages once), each head's pass asking for its
// rows of the next chunk. (The whole next chunk asked for at once, 64 KB of Qwen3's int8 keys, filled the miss
// queues and left the passes waiting on memory: 4 GB/s.) pass: the vector specializations by query heads at a
// time - 1, or NULL for the scalar `any`.
static void span_pass(const qattn *a, const kv_comp *comp, const pass_fn *pass, pass_fn any, int c, int lo, int hi) {
    int g = a->g;
    if (pass) prefetch_rows(a, comp, lo, lo + QCHUNK < hi ? lo + QCHUNK : hi, -1);
    for (int c0 = lo; c0 < hi; c0 += QCHUNK) {
        int c1 = c0 + QCHUNK < hi ? c0 + QCHUNK : hi;
        for (int h = 0; h < a->Hkv; h++) {
            if (pass && c1 < hi) prefetch_rows(a, comp, c1, c1 + QCHUNK < hi ? c1 + QCHUNK : hi, h);
            if (pass)
                for (int j0 = 0; j0 < g; j0 += 4) pass[(g - j0 < 4 ? g - j0 : 4) - 1](a, h, j0, c, c0, c1);
            else
                any(a, h, 0, c, c0, c1);
        }
    }
}

void attn_decode_quant(const float *q, const float *knew, const float *vnew, int Hq, int Hkv, int D, int bs,
                       const int64_t *slots, int P, const int64_t *table, int n_full,
                       const kv_comp *kc, const kv_comp *vc, const float *cos_h, const float *sin_h,
                       const int64_t *pos, float sm_scale, const float *sink_logits, int nthreads, float *out,
                       float *scratch, const int *cols, int mcols, float *mass) {
    // q [Hq, D], knew, vnew [Hkv, D]: the new token's query and key before RoPE, and its value (attended
    // last); slots [P] the held past, ascending; cos_h, sin_h [*, D/2] rows picked by pos [P + 1]: the
    // past's effective key positions, then the new token's (where the query is rotated too). sink_logits
    // [Hq] or NULL: the layer's learned sink logits (merge_spans). mass [Hq, mcols] or NULL: where the row put its
    // attention, its rows' columns cols [P + 1] (spans_mass).
    // scratch: Hq * (P + 1 + D) + S * Hq * (D + 2) floats, S = spans (at most 64).
    fp8_init();
    int g = Hq / Hkv, L = P + 1;
    float *qr = scratch + (size_t)Hq * L;
    for (int i = 0; i < Hq; i++)
        rope_row(q + (size_t)i * D, cos_h + (size_t)pos[P] * (D / 2), sin_h + (size_t)pos[P] * (D / 2), D, qr + (size_t)i * D);
    q = qr;
    int S = L / 64 < 1 ? 1 : L / 64;
    if (S > 2 * nthreads) S = 2 * nthreads;
    if (S > 64) S = 64;
    qattn a = {kc, vc, q, knew, vnew, cos_h, sin_h, slots, table, pos, Hq, Hkv, D, bs, P, L, n_full, g, sm_scale,
               scratch, qr + (size_t)Hq * D};
    const pass_fn *kpass = NULL, *vpass = NULL;      // by query heads at a time - 1
#ifdef __AVX2__
    if (D % 16 == 0 && (vc->axis != 2 || vc->group % 8 == 0) && (kc->axis != 2 || kc->group % 8 == 0)) {
        kpass = k_passes[kc->kind * 3 + kc->axis];
        vpass = v_passes[vc->kind * 3 + vc->axis];
        if (!kpass[0] || !vpass[0]) kpass = vpass = NULL;
    }
#endif
    // a work item is a span of rows: its scores, their exp, its weighted values (see span_pass)
    #pragma omp parallel for schedule(static)
    for (int c = 0; c < S; c++) {
        int lo = (int)((long)L * c / S), hi = (int)((long)L * (c + 1) / S);
        span_pass(&a, kc, kpass, k_pass_any, c, lo, hi);
        for (int i = 0; i < Hq; i++) {
            float *si = a.scores + (size_t)i * L, mx = -INFINITY;
            float *o = a.part + ((size_t)c * Hq + i) * (D + 2);
            for (int p = lo; p < hi; p++) mx = si[p] > mx ? si[p] : mx;
            o[D] = mx;
            o[D + 1] = hi > lo ? exp_span(si, lo, hi, mx) : 0.f;
            for (int d = 0; d < D; d++) o[d] = 0.f;
        }
        span_pass(&a, vc, vpass, v_pass_any, c, lo, hi);
    }
    merge_spans(a.part, S, Hq, D, sink_logits, out);
    if (mass) spans_mass(a.scores, L, a.part, S, Hq, D, sink_logits, cols, mcols, mass);
}

// ---- a decode step's attention for every layer, called from decode_layers (cpu_quant.c) -----------------
// B sequences, one new token each, over quantized K and V pages: per layer and sequence attn_decode_quant,
// then the new key (before RoPE) and value are written to row `fill` of the sequence's tail, in the tail's
// dtype with torch's rounding, and as float32 to rows_out: the same calls and bits as the runner's
// per-layer Python path. The write touches one row past the sequence's committed length, so a step that
// stops halfway leaves nothing a rollback must undo. A token that completes its block is quantized with
// the block by the caller after the step, from the tail and rows_out.
typedef struct {
    int B, Hq, Hkv, D, bs, ldq, nthreads;
    float sm_scale;
    const kv_comp *comps;          // [layers][B][2]: K, then V
    const int64_t *const *slots;   // [B] each [P[b]], the held past, ascending
    const int *P;
    const int64_t *const *table;   // [B] block ids
    const int *n_full;             // [B]
    const int64_t *const *pos;     // [B] each [P[b] + 1]
    const int *fill;               // [B] the tail row of the new token
    const float *cos_h, *sin_h;    // [N, D/2], N past every pos
    float *scratch;                // Hq * (max P + 1 + D) + 64 * Hq * (D + 2) floats
    float *rows_out;               // [layers][B][2][Hkv * D]: every layer's new key and value
    const float *const *sink_logits;   // [layers] each [Hq] or NULL (NULL: no layer has sink logits)
    const int *const *cols;        // [B] each [P[b] + 1]: the rows' mass columns (NULL: mass not measured)
    int mcols;
    float *mass;                   // [layers][B][Hq][mcols] or NULL
} qstep_t;

static void tail_write(const kv_comp *c, int row, const float *x, int H, int D) {
    size_t off = (size_t)row * H * D, n = (size_t)H * D;
    if (c->full == 0) {
        memcpy((float *)c->tail + off, x, n * sizeof(float));
    } else if (c->full == 1) {
        uint16_t *t = (uint16_t *)c->tail + off;
        for (size_t i = 0; i < n; i++) t[i] = to_bf16(x[i]);
    } else {
        half_t *t = (half_t *)c->tail + off;
        for (size_t i = 0; i < n; i++) t[i] = f32_to_f16(x[i]);
    }
}

int attend_quant_layer(void *ctx, int layer, float *qkv, float *out) {
    const qstep_t *s = (const qstep_t *)ctx;
    int Hq = s->Hq, Hkv = s->Hkv, D = s->D;
    for (int b = 0; b < s->B; b++) {
        const kv_comp *kc = s->comps + ((size_t)layer * s->B + b) * 2, *vc = kc + 1;
        const float *q = qkv + (size_t)b * s->ldq, *k = q + (size_t)Hq * D, *v = k + (size_t)Hkv * D;
        attn_decode_quant(q, k, v, Hq, Hkv, D, s->bs, s->slots[b], s->P[b], s->table[b], s->n_full[b], kc, vc,
                          s->cos_h, s->sin_h, s->pos[b], s->sm_scale, s->sink_logits ? s->sink_logits[layer] : NULL,
                          s->nthreads, out + (size_t)b * Hq * D, s->scratch, s->mass ? s->cols[b] : NULL, s->mcols,
                          s->mass ? s->mass + ((size_t)layer * s->B + b) * Hq * s->mcols : NULL);
        tail_write(kc, s->fill[b], k, Hkv, D);
        tail_write(vc, s->fill[b], v, Hkv, D);
        float *ro = s->rows_out + ((size_t)layer * s->B + b) * 2 * Hkv * D;
        memcpy(ro, k, sizeof(float) * Hkv * D);
        memcpy(ro + (size_t)Hkv * D, v, sizeof(float) * Hkv * D);
    }
    return 0;
}

// ---- prompt rows over quantized pages, read in place -----------------------------------------------------
// attn_prompt (cpu_prompt_attn.h) with its keys and values loaded from quantized pages: the held past's rows
// dequantized by kv_row and the keys rotated at their effective positions (pq_rope), the same values as the torch
// path's gathered, rotated copy (kernels/reference.py, engine/model/rope.py), so the two give the same bits; then
// the chunk's own rows, given as float32 (they are stored after the attention, which may quantize the tail away).
#include "cpu_prompt_attn.h"

typedef struct {
    const kv_comp *kc, *vc;
    const float *knew, *vnew;            // [T, Hkv, D]: the chunk's own keys (before RoPE) and values, attended last
    const float *cos_h, *sin_h;          // [N, D/2] half RoPE tables
    const int64_t *slots, *table, *pos;  // slots [P] the held past, ascending; pos [P + T] each key's effective position
    int bs, n_full;
} pq_ctx_t;

typedef struct {        // what a task keeps between rows: the per-channel scales of the block it is in, K's and V's
    chan_scales k, v;
    float buf[KV_MAX_D];
} pq_scratch_t;

static inline void pq_rope(const float *x, const float *cs, const float *sn, int D, float *out) {
    // engine/model/rope.py's rotate to the bit: x * cos, then rotate_half(x) * sin added in one rounding (torch's
    // addcmul_ fuses it)
    int h = D / 2;
    for (int d = 0; d < h; d++) {
        out[d] = fmaf(x[d + h], -sn[d], x[d] * cs[d]);
        out[d + h] = fmaf(x[d], sn[d], x[d + h] * cs[d]);
    }
}

static void pq_load(const pa_args_t *a, int value, int h, int j, float *dst, void *scratch) {
    const pq_ctx_t *c = (const pq_ctx_t *)a->ctx;
    pq_scratch_t *s = (pq_scratch_t *)scratch;
    int D = a->D, H = a->Hkv;
    if (value < 0) {                    // a task begins (another head): nothing cached is its own
        s->k.id = s->v.id = -1;
        return;
    }
    const float *x;
    if (j >= a->P)
        x = (value ? c->vnew : c->knew) + ((size_t)(j - a->P) * H + h) * D;
    else
        x = kv_row(value ? c->vc : c->kc, H, D, c->bs, c->n_full, c->table, c->slots[j], h, value ? dst : s->buf,
                   value ? &s->v : &s->k);
    if (value) {
        if (x != dst) memcpy(dst, x, sizeof(float) * D);
        return;
    }
    size_t o = (size_t)c->pos[j] * (D / 2);
    pq_rope(x, c->cos_h + o, c->sin_h + o, D, dst);
}

// a: attn_prompt's arguments (rows, kp, vp, sink_k unused: n_sink 0); c: the pages. 0 done, as attn_prompt.
int attn_prompt_quant(const pa_args_t *a, const pq_ctx_t *c) {
    if (a->D > KV_MAX_D || a->n_sink) return -3;
    fp8_init();
    pa_args_t b = *a;
    b.load = pq_load;
    b.ctx = c;
    b.load_floats = (int)((sizeof(pq_scratch_t) + sizeof(float) - 1) / sizeof(float));
    return attn_prompt(&b);
}
