// A measurement, not kvchat code: a Q4_K matvec whose SIMD lanes are 16 weight rows (codes and packed scales
// interleaved by 16-row tiles: a group's scale is then one vector of 16 rows' scales, unpacked for 16 rows at once,
// no permutes), with int8 activations (W8) or int16 ones as two byte planes (W16), a scale per group of 32 as
// kvchat's decode rows have them; checked against a float64 reference, then timed on two 3,072 x 3,072 matrices in
// turn (in L3), one thread. Its numbers sit beside the two-row kernel's (kernels/cpu_act8.h) in docs/benchmarks.md,
// issue 43 part sixteen. Needs AVX-512 VNNI:
//   cc -O3 -march=native bench/row_tiles.c -o /tmp/row_tiles -lm && /tmp/row_tiles
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
enum { T = 16 };        // rows a tile
typedef struct {
    int N, K, nsb;      // rows, columns, super-blocks a row
    uint8_t *codes;     // [N/16][K/32 groups][4][16 rows][4 bytes]
    uint8_t *sa, *sm, *sc;   // [N/16][nsb][16 rows][4]: the 12 packed scale bytes split a | m | c
    float *d, *dmin;    // [N/16][nsb][16]
    // row-major copies for the reference
    uint8_t *rcodes;    // [N][K/32][16]
    uint8_t *rpack;     // [N][nsb][12]
    float *rd, *rdmin;  // [N][nsb]
} mat_t;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void unpack(const uint8_t *p, int *sc, int *m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63; m[j] = p[j + 4] & 63;
        sc[j + 4] = (p[j + 8] & 15) | ((p[j] >> 6) << 4);
        m[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
}

static mat_t make(int N, int K, unsigned seed) {
    mat_t a = {N, K, K / 256};
    int ng = K / 32;
    srand(seed);
    a.rcodes = malloc((size_t)N * ng * 16); a.rpack = malloc((size_t)N * a.nsb * 12);
    a.rd = malloc(sizeof(float) * N * a.nsb); a.rdmin = malloc(sizeof(float) * N * a.nsb);
    for (size_t i = 0; i < (size_t)N * ng * 16; i++) a.rcodes[i] = rand() & 255;
    for (size_t i = 0; i < (size_t)N * a.nsb * 12; i++) a.rpack[i] = rand() & 255;
    for (size_t i = 0; i < (size_t)N * a.nsb; i++) a.rd[i] = (rand() % 1000) * 1e-5f, a.rdmin[i] = (rand() % 1000) * 1e-5f;
    a.codes = aligned_alloc(64, (size_t)N * ng * 16);
    a.sa = aligned_alloc(64, (size_t)N * a.nsb * 4); a.sm = aligned_alloc(64, (size_t)N * a.nsb * 4);
    a.sc = aligned_alloc(64, (size_t)N * a.nsb * 4);
    a.d = aligned_alloc(64, sizeof(float) * N * a.nsb); a.dmin = aligned_alloc(64, sizeof(float) * N * a.nsb);
    for (int t = 0; t < N / T; t++)
        for (int g = 0; g < ng; g++)
            for (int j = 0; j < 4; j++)
                for (int r = 0; r < T; r++)
                    memcpy(a.codes + ((((size_t)t * ng + g) * 4 + j) * T + r) * 4,
                           a.rcodes + ((size_t)(t * T + r) * ng + g) * 16 + 4 * j, 4);
    for (int t = 0; t < N / T; t++)
        for (int s = 0; s < a.nsb; s++)
            for (int r = 0; r < T; r++) {
                const uint8_t *p = a.rpack + ((size_t)(t * T + r) * a.nsb + s) * 12;
                size_t o = (((size_t)t * a.nsb + s) * T + r);
                memcpy(a.sa + o * 4, p, 4); memcpy(a.sm + o * 4, p + 4, 4); memcpy(a.sc + o * 4, p + 8, 4);
                a.d[o] = a.rd[(size_t)(t * T + r) * a.nsb + s]; a.dmin[o] = a.rdmin[(size_t)(t * T + r) * a.nsb + s];
            }
    return a;
}

// y[n] = sum_g (d sc_g) xs_g dot(codes_g, x_g) - (dmin m_g) xs_g sum(x_g); x int (int8 or int16) per group of 32
static void reference(const mat_t *a, const int16_t *x, const float *xs, float *y) {
    int ng = a->K / 32;
    for (int n = 0; n < a->N; n++) {
        double acc = 0;
        for (int s = 0; s < a->nsb; s++) {
            int sc[8], m[8];
            unpack(a->rpack + ((size_t)n * a->nsb + s) * 12, sc, m);
            for (int q = 0; q < 8; q++) {
                int g = s * 8 + q;
                const uint8_t *c = a->rcodes + ((size_t)n * ng + g) * 16;
                long dot = 0, sum = 0;
                for (int b = 0; b < 16; b++) {
                    dot += (c[b] & 15) * x[g * 32 + b] + (c[b] >> 4) * x[g * 32 + 16 + b];
                    sum += x[g * 32 + b] + x[g * 32 + 16 + b];
                }
                acc += (double)a->rd[n * a->nsb + s] * sc[q] * xs[g] * dot
                       - (double)a->rdmin[n * a->nsb + s] * m[q] * xs[g] * sum;
            }
        }
        y[n] = (float)acc;
    }
}

// W: 8 (x int8, xb its bytes) or 16 (x int16 as planes: xt signed top bytes, xb unsigned bottom bytes)
static void interleaved(const mat_t *a, const int8_t *xt, const uint8_t *xb, const float *xs, const float *sums,
                        const int W, float *y) {
    int ng = a->K / 32;
    const __m512i lowm = _mm512_set1_epi8(15), b63 = _mm512_set1_epi32(63), b15 = _mm512_set1_epi32(15);
    for (int t = 0; t < a->N / T; t++) {
        __m512 res = _mm512_setzero_ps(), zres = _mm512_setzero_ps();
        for (int s = 0; s < a->nsb; s++) {
            size_t o = ((size_t)t * a->nsb + s) * T;
            __m512i A = _mm512_load_si512(a->sa + o * 4), M = _mm512_load_si512(a->sm + o * 4),
                    C = _mm512_load_si512(a->sc + o * 4);
            __m512 d = _mm512_load_ps(a->d + o), dm = _mm512_load_ps(a->dmin + o);
            for (int q = 0; q < 8; q++) {
                int g = s * 8 + q, k = q & 3;
                __m512i scq, mq;            // each row's 6-bit scale and min of group q
                if (q < 4) {
                    scq = _mm512_and_si512(_mm512_srli_epi32(A, 8 * k), b63);
                    mq = _mm512_and_si512(_mm512_srli_epi32(M, 8 * k), b63);
                } else {
                    scq = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 8 * k), b15),
                                          _mm512_slli_epi32(_mm512_srli_epi32(A, 8 * k + 6) & _mm512_set1_epi32(3), 4));
                    mq = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 8 * k + 4), b15),
                                         _mm512_slli_epi32(_mm512_srli_epi32(M, 8 * k + 6) & _mm512_set1_epi32(3), 4));
                }
                const uint8_t *cp = a->codes + (size_t)(t * ng + g) * 4 * T * 4;
                __m512i acc = _mm512_setzero_si512(), lo[4], hi[4];
                for (int j = 0; j < 4; j++) {
                    __m512i c = _mm512_load_si512(cp + j * 64);
                    lo[j] = _mm512_and_si512(c, lowm);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(c, 4), lowm);
                }
                if (W == 8) {
                    for (int j = 0; j < 4; j++) {
                        acc = _mm512_dpbusd_epi32(acc, lo[j], _mm512_set1_epi32(*(const int32_t *)(xt + g * 32 + 4 * j)));
                        acc = _mm512_dpbusd_epi32(acc, hi[j], _mm512_set1_epi32(*(const int32_t *)(xt + g * 32 + 16 + 4 * j)));
                    }
                } else {
                    for (int j = 0; j < 4; j++) {
                        acc = _mm512_dpbusd_epi32(acc, lo[j], _mm512_set1_epi32(*(const int32_t *)(xt + g * 32 + 4 * j)));
                        acc = _mm512_dpbusd_epi32(acc, hi[j], _mm512_set1_epi32(*(const int32_t *)(xt + g * 32 + 16 + 4 * j)));
                    }
                    acc = _mm512_slli_epi32(acc, 8);
                    for (int j = 0; j < 4; j++) {
                        acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(*(const int32_t *)(xb + g * 32 + 4 * j)), lo[j]);
                        acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(*(const int32_t *)(xb + g * 32 + 16 + 4 * j)), hi[j]);
                    }
                }
                __m512 sv = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(scq)), _mm512_set1_ps(xs[g]));
                res = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sv, res);
                zres = _mm512_fmadd_ps(_mm512_mul_ps(dm, _mm512_cvtepi32_ps(mq)), _mm512_set1_ps(sums[g] * xs[g]), zres);
            }
        }
        _mm512_storeu_ps(y + t * T, _mm512_sub_ps(res, zres));
    }
}

int main(int argc, char **argv) {
    int N = 3072, K = 3072, reps = argc > 1 ? atoi(argv[1]) : 200;
    mat_t m[2] = {make(N, K, 1), make(N, K, 2)};
    int ng = K / 32;
    int16_t *x16 = malloc(2 * K), *x8 = malloc(2 * K);
    int8_t *xt = malloc(K), *x8b = malloc(K); uint8_t *xb = malloc(K);
    float *xs = malloc(4 * ng), *sums16 = malloc(4 * ng), *sums8 = malloc(4 * ng), *y = malloc(4 * N), *yr = malloc(4 * N);
    for (int g = 0; g < ng; g++) {
        xs[g] = 1e-3f * (1 + g % 7); sums16[g] = sums8[g] = 0;
        for (int i = 0; i < 32; i++) {
            int k = g * 32 + i;
            x16[k] = (int16_t)((rand() % 65535) - 32767); x8[k] = (int16_t)((rand() % 255) - 127);
            xt[k] = (int8_t)(x16[k] >> 8); xb[k] = (uint8_t)(x16[k] & 255); x8b[k] = (int8_t)x8[k];
            sums16[g] += x16[k]; sums8[g] += x8[k];
        }
    }
    for (int W = 8; W <= 16; W += 8) {
        const int16_t *xr = W == 8 ? x8 : x16;
        const float *sums = W == 8 ? sums8 : sums16;
        interleaved(&m[0], W == 8 ? x8b : xt, xb, xs, sums, W, y);
        reference(&m[0], xr, xs, yr);
        double err = 0, mag = 0;
        for (int n = 0; n < N; n++) err = fmax(err, fabs(y[n] - yr[n])), mag = fmax(mag, fabs(yr[n]));
        double best = 1e9;
        for (int r = 0; r < 7; r++) {
            double t0 = now();
            for (int i = 0; i < reps; i++) interleaved(&m[i & 1], W == 8 ? x8b : xt, xb, xs, sums, W, y);
            double dt = (now() - t0) / reps;
            if (dt < best) best = dt;
        }
        double bytes = (double)N * K / 256 * 144;
        printf("W%d: %.1f us a %dx%d Q4_K matrix (%.1f GB/s in cache), max error %.2g of %.3g\n", W, best * 1e6, N, K,
               bytes / best / 1e9, err, mag);
    }
    return 0;
}
#else
int main(void) {
    puts("row_tiles: needs AVX-512 (F, BW) with VNNI; this build has none");
    return 0;
}
#endif
