// The kernels without Python: tests/test_kernel_variants.py builds this with a cross compiler (aarch64), runs it
// under qemu-user, and holds what it writes to the torch references. Input: one file of int32 shapes and then
// the arrays, in the order read below; output: the results, as raw float32, in the order written below.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>

void q4_gemv(const float *x, int M, int K, const uint8_t *codes, const void *scale, const void *zero,
             int N, float *y, void *scratch, int mode, const float *norm_w, float eps, const float *resid, int kind,
             const float *ssup, const float *zsup, int per);
void q8_gemv(const float *x, int M, int K, const int8_t *codes, const void *scale, const void *zero, int G,
             int N, float *y, void *scratch, int mode, const float *norm_w, float eps, const float *resid, int kind,
             const float *ssup, const float *zsup, int per);
void q4_dequant(const uint8_t *codes, const void *scale, const void *zero, int N, int K, float *out, int kind,
                const float *ssup, const float *zsup, int per);
void q8_dequant(const int8_t *codes, const void *scale, const void *zero, int G, int N, int K, float *out, int kind,
                const float *ssup, const float *zsup, int per);
void attn_decode_rot(const float *q, const float *qs, int n_sink, int Hq, int Hkv, int D,
                     const void *kp, const void *vp, int bf16, const int64_t *rows, int L,
                     float sm_scale, float *out, float *scratch);
void kvchat_f16_to_f32(const uint16_t *h, float *out, int64_t n);
const char *kvchat_build_info(void);

static FILE *in, *out;

static void *take(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, in) != bytes) { fprintf(stderr, "short input\n"); exit(2); }
    return p;
}

static void put(const float *p, size_t n) { fwrite(p, sizeof(float), n, out); }

int main(int argc, char **argv) {
    if (argc != 3 || !(in = fopen(argv[1], "rb")) || !(out = fopen(argv[2], "wb"))) return 2;
    fprintf(stderr, "%s\n", kvchat_build_info());
    int32_t *dims = take(8 * sizeof(int32_t));
    int M = dims[0], K = dims[1], N = dims[2], G = dims[3], Hq = dims[4], Hkv = dims[5], D = dims[6], L = dims[7];
    float *x = take(sizeof(float) * M * K), *norm = take(sizeof(float) * K);
    uint8_t *c4 = take((size_t)N * K / 2);
    float *s4 = take(sizeof(float) * N * K / 32), *z4 = take(sizeof(float) * N * K / 32);
    int8_t *c8 = take((size_t)N * K);
    float *s8 = take(sizeof(float) * N * K / G), *z8 = take(sizeof(float) * N * K / G);
    float *q = take(sizeof(float) * Hq * D), *kp = take(sizeof(float) * L * Hkv * D), *vp = take(sizeof(float) * L * Hkv * D);
    int64_t *rows = take(sizeof(int64_t) * L);
    float *y = malloc(sizeof(float) * ((size_t)M * N > (size_t)N * K ? (size_t)M * N : (size_t)N * K));
    void *scratch = malloc((size_t)M * K * 8 + 4096);
    float *ascratch = malloc(sizeof(float) * (Hq * L + 4 * Hq * (D + 2)));

    q4_gemv(x, M, K, c4, s4, z4, N, y, scratch, 1, norm, 1e-5f, NULL, 0, NULL, NULL, 1);    // RMSNorm first
    put(y, (size_t)M * N);
    q4_dequant(c4, s4, z4, N, K, y, 0, NULL, NULL, 1);
    put(y, (size_t)N * K);
    q8_gemv(x, M, K, c8, s8, z8, G, N, y, scratch, 0, NULL, 0.f, NULL, 0, NULL, NULL, 1);
    put(y, (size_t)M * N);
    q8_dequant(c8, s8, z8, G, N, K, y, 0, NULL, NULL, 1);
    put(y, (size_t)N * K);
    attn_decode_rot(q, q, 0, Hq, Hkv, D, kp, vp, 0, rows, L, 0.125f, y, ascratch);
    put(y, (size_t)Hq * D);
    uint16_t *halves = malloc(65536 * sizeof(uint16_t));
    float *f = malloc(65536 * sizeof(float));
    for (int i = 0; i < 65536; i++) halves[i] = (uint16_t)i;
    kvchat_f16_to_f32(halves, f, 65536);
    put(f, 65536);
    fclose(out);
    return 0;
}
