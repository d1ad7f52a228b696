// A routed MLP's decode rows (mixtures of experts) in one call: included by cpu_quant.c after lin_apply, whose
// kernels it runs. Each row reads its k routed experts' packed slabs and nothing else.

// For each of M rows: y[m] = resid[m] + the sum, over its k experts in the order given (the caller sorts them
// ascending, the order the prompt path adds them in), of w[m][j] * (down_e(act(gate_e(x[m]) + gb[e],
// up_e(x[m]) + ub[e])) + db[e]). act 0: silu(g) * u (SwiGLU); act 1 (gpt-oss): g = min(g, limit),
// u = clamp(u, -limit, limit), g * sigmoid(alpha * g) * (u + 1). x [M, K]: the rows already normed (the router
// reads them too); ids, w [M, k]; gate, up, down: E experts' linears; gb, ub [E, F], db [E, H]: biases or NULL.
// 0 on success, -1 out of memory, -3 when an id or a width does not chain (nothing written then).
int moe_rows(int M, int k, const float *x, const int32_t *ids, const float *w, int E, const qlin_t *gate,
             const qlin_t *up, const qlin_t *down, const float *gb, const float *ub, const float *db, int act,
             float alpha, float limit, const float *resid, float *y) {
    if (M < 1 || k < 1 || E < 1) return -3;
    int K = gate[0].K, F = gate[0].N, H = down[0].N;
    for (int e = 0; e < E; e++) {
        const qlin_t *g = gate + e, *u = up + e, *d = down + e;
        if (g->K != K || u->K != K || g->N != F || u->N != F || d->K != F || d->N != H || K % 32 || F % 32
            || (g->bits != 4 && g->bits != 8) || (u->bits != 4 && u->bits != 8) || (d->bits != 4 && d->bits != 8))
            return -3;
    }
    for (int i = 0; i < M * k; i++)
        if (ids[i] < 0 || ids[i] >= E) return -3;
    int kmax = K > F ? K : F;
    size_t gemv_bytes = (size_t)kmax * 2 * 7;
    char *mem = malloc(gemv_bytes + sizeof(float) * (2 * (size_t)F + 2 * (size_t)H) + 64);
    if (!mem) return -1;
    void *gs = mem;
    float *gu = (float *)(mem + ((gemv_bytes + 63) & ~(size_t)63)), *h = gu + 2 * (size_t)F;
    float *out = h, *acc = h + H;
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        for (int c = 0; c < H; c++) acc[c] = 0.0f;
        for (int j = 0; j < k; j++) {
            int e = ids[m * k + j];
            lin_apply(gate + e, 1, xm, 1, gu, gs, 0, NULL, 0.0f, NULL);
            lin_apply(up + e, 1, xm, 1, gu + F, gs, 0, NULL, 0.0f, NULL);
            for (int f = 0; f < F; f++) {
                float g = gu[f], u = gu[F + f];
                if (gb) {
                    g += gb[(size_t)e * F + f];
                    u += ub[(size_t)e * F + f];
                }
                if (act == 0) {
                    gu[f] = g / (1.0f + expf(-g)) * u;
                } else {
                    g = g < limit ? g : limit;
                    u = u < -limit ? -limit : (u > limit ? limit : u);
                    gu[f] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
                }
            }
            lin_apply(down + e, 1, gu, 1, out, gs, 0, NULL, 0.0f, NULL);
            float we = w[m * k + j];
            for (int c = 0; c < H; c++) {
                float v = out[c];
                if (db) v += db[(size_t)e * H + c];
                acc[c] += v * we;
            }
        }
        float *ym = y + (size_t)m * H;
        const float *rm = resid ? resid + (size_t)m * H : NULL;
        for (int c = 0; c < H; c++) ym[c] = rm ? rm[c] + acc[c] : acc[c];
    }
    free(mem);
    return 0;
}
