// A routed MLP's decode rows (mixtures of experts) in one call: included by cpu_quant.c after lin_apply, whose
// kernels it runs. Each row reads its router and its k routed experts' packed slabs, and no other expert's.
// The engine's forward calls moe_layer_rows for the decode rows of a step, and decode_layers calls it for a
// layer that has experts, so both give the same bits.

// A layer's routed MLP. router: packed (bits 4 or 8), or bits 32: float32 rows [E, H] at codes (llama.cpp keeps
// ffn_gate_inp in F32; E dot products a row, a small share of the step). Routing: softmax over the E router logits (+ router_bias), the k largest kept (ties to the
// lower id), renormalized to sum 1 where `normalize`; each token's experts then added in ascending id order.
// Expert e: down_e(act(gate_e(x) + gb[e], up_e(x) + ub[e])) + db[e]; act 0: silu(g) * u (SwiGLU); act 1 (gpt-oss):
// g = min(g, limit), u = clamp(u, -limit, limit), g * sigmoid(alpha * g) * (u + 1); act 2: gelu_tanh(g) * u (Gemma
// 4). gb, ub [E, F], db [E, H], router_bias [E]: NULL where absent. hits [E]: tokens routed to each expert, counted
// where not NULL. router_norm [H]: the router reads RMSNorm(x) * router_norm, not the experts' input (Gemma 4: its
// learned scale times hidden ** -0.5); expert_scale [E]: each chosen weight, after the renormalization, times its
// expert's (Gemma 4's per_expert_scale); NULL: neither.
typedef struct moe_s {
    int E, k, act, normalize;
    float alpha, limit;
    qlin_t router;
    const float *router_bias;
    const qlin_t *gate, *up, *down;
    const float *gb, *ub, *db;
    int64_t *hits;
    const float *router_norm, *expert_scale;
} moe_t;

// the packed kinds lin_apply runs: q4, q8, and Q6_K (bits 6, cpu_q6k.h) in whole super-blocks of 256
static int moe_bits_ok(const qlin_t *l) {
    return l->bits == 4 || l->bits == 8 || (l->bits == 6 && l->K % 256 == 0);
}

// Whether a layer's experts chain at hidden width H; 0 for a table built from a damaged file's header.
static int moe_ok(const moe_t *m, int H) {
    if (m->E < 1 || m->k < 1 || m->k > m->E || m->k > 64 || m->router.N != m->E || m->router.K != H
        || (!moe_bits_ok(&m->router) && m->router.bits != 32) || m->act < 0 || m->act > 2)
        return 0;
    int F = m->gate[0].N;
    for (int e = 0; e < m->E; e++) {
        const qlin_t *g = m->gate + e, *u = m->up + e, *d = m->down + e;
        if (g->K != H || u->K != H || g->N != F || u->N != F || d->K != F || d->N != H || F % 32
            || !moe_bits_ok(g) || !moe_bits_ok(u) || !moe_bits_ok(d))
            return 0;
    }
    return 1;
}

// The k experts of one row's router logits (E of them, overwritten by their softmax): ids ascending, w their
// weights (in the same order).
static void moe_route(const moe_t *m, float *logits, int *ids, float *w) {
    int E = m->E, k = m->k;
    if (m->router_bias)
        for (int e = 0; e < E; e++) logits[e] += m->router_bias[e];
    float mx = logits[0];
    for (int e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < E; e++) {
        logits[e] = expf(logits[e] - mx);
        sum += logits[e];
    }
    for (int e = 0; e < E; e++) logits[e] /= sum;
    // the k largest, ties to the lower id; then ascending ids
    int chosen[64];
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[j] = best;
    }
    for (int a = 1; a < k; a++)
        for (int b = a; b > 0 && chosen[b - 1] > chosen[b]; b--) {
            int t = chosen[b];
            chosen[b] = chosen[b - 1];
            chosen[b - 1] = t;
        }
    float total = 0.0f;
    for (int j = 0; j < k; j++) total += logits[chosen[j]];
    for (int j = 0; j < k; j++) {
        ids[j] = chosen[j];
        w[j] = m->normalize ? logits[chosen[j]] / total : logits[chosen[j]];
        if (m->expert_scale) w[j] *= m->expert_scale[chosen[j]];
        if (m->hits) m->hits[chosen[j]]++;
    }
}

// o [F] = expert e's activation of its gate and up rows g, u [F] (plus their biases): the one of the decode and the
// grouped paths (o may be g: each value is read before it is written)
static void expert_act(const moe_t *m, int e, const float *g, const float *u, int F, float *o) {
    if (m->act == 2 && !m->gb) {
        gelu_mul(g, u, F, o);
        return;
    }
    for (int f = 0; f < F; f++) {
        float gv = g[f], uv = u[f];
        if (m->gb) {
            gv += m->gb[(size_t)e * F + f];
            uv += m->ub[(size_t)e * F + f];
        }
        if (m->act == 0) {
            o[f] = gv / (1.0f + expf(-gv)) * uv;
        } else if (m->act == 2) {
            gelu_mul(&gv, &uv, 1, o + f);
        } else {
            gv = gv < m->limit ? gv : m->limit;
            uv = uv < -m->limit ? -m->limit : (uv > m->limit ? m->limit : uv);
            o[f] = gv / (1.0f + expf(-m->alpha * gv)) * (uv + 1.0f);
        }
    }
}

#ifdef __AVX2__
// One decode row against ns <= 128 q4 matrices of its input (a row's routed experts' gates and ups) in one shared
// loop: the activations laid out once (quad_layout16's int16 planes), one parallel region, each matrix's rows as
// gemv_q4x's decode branch computes them (q4x_row_pair, so the same bits), its outputs after the previous one's in y
static void gemv_q4x_parts(const int8_t *xl, const float *xs, const float *sums, int K, const qlin_t *ls, int ns,
                           float *y) {
    int start[2 * 64 + 1] = {0}, col[2 * 64] = {0};
    for (int i = 0; i < ns; i++) {
        start[i + 1] = start[i] + (ls[i].N + 1) / 2;
        if (i) col[i] = col[i - 1] + ls[i - 1].N;
    }
    SHARED_STEPS(start[ns], SHARE_ROWS / 2, p) {
        int i = 0;
        while (p >= start[i + 1]) i++;
        const qlin_t *l = ls + i;
        int n = 2 * (p - start[i]), b = n + 1 < l->N ? n + 1 : n;
        float out[2];
        q4x_row_pair(xl, 16, xs, sums, K, l->codes, l->scale, l->zero, l->kind, l->ssup, l->zsup, l->per, l->high,
                     n, b, out);
        y[col[i] + n] = out[0] + 0.f;              // as gemv_q4x stores a row without a residual
        if (b != n) y[col[i] + b] = out[1] + 0.f;
    }
}
#endif

// A row's k routed experts' gates and ups of xn [H] -> gu [k, 2F] (each expert's gate | up): where all are q4 rows
// of int16 activations (Q4_0, Q4_1, Q4_K, Q5_*), the activations prepared once and every matrix's rows in one loop
// (gemv_q4x_parts: the bits of the lin_apply calls, one parallel region instead of 2k); else the calls
static void gates_ups(const moe_t *m, const int *ids, int k, const float *xn, int H, float *gu, void *gs) {
    int F = m->gate[0].N;
#ifdef __AVX2__
    qlin_t parts[2 * 64];
    int q4 = 1;
    for (int j = 0; j < k; j++) {
        parts[2 * j] = m->gate[ids[j]], parts[2 * j + 1] = m->up[ids[j]];
        for (int h = 0; h < 2; h++) {
            const qlin_t *l = parts + 2 * j + h;
            q4 &= l->bits == 4 && l->kind != KIND_MXFP4 && l->act != 8 && !l->bias && l->K == H;
        }
    }
    if (q4) {
        int16_t *xq;
        float *xs, *sums;
        activations(xn, 1, H, 0, NULL, 0.0f, gs, &xq, &xs, &sums);
        int8_t *xl = (int8_t *)(sums + H / 32);
        quad_layout16(xq, 1, H, xl);
        gemv_q4x_parts(xl, xs, sums, H, parts, 2 * k, gu);
        return;
    }
#endif
    for (int j = 0; j < k; j++) {
        float *o = gu + (size_t)j * 2 * F;
        lin_apply(m->gate + ids[j], 1, xn, 1, o, gs, 0, NULL, 0.0f, NULL);
        lin_apply(m->up + ids[j], 1, xn, 1, o + F, gs, 0, NULL, 0.0f, NULL);
    }
}

// M decode rows: y [M, H] = resid + the routed MLP of RMSNorm(x) * norm_w (x, resid [M, H]; resid may be y's
// own memory, or NULL). 0 on success, -1 out of memory, -3 when the experts do not chain at H (nothing written).
int moe_layer_rows(int M, int H, const float *x, const float *norm_w, float eps, const moe_t *m, const float *resid,
                   float *y) {
    if (M < 1 || H < 1 || !moe_ok(m, H)) return -3;
    int F = m->gate[0].N, E = m->E, k = m->k;
    int kmax = H > F ? H : F;
    size_t gemv_bytes = (size_t)kmax * 2 * 7;
    size_t floats = 2 * (size_t)H + (size_t)E + 2 * (size_t)F * k + 2 * (size_t)H + 64;
    char *mem = malloc(gemv_bytes + sizeof(float) * floats + 64);
    if (!mem) return -1;
    void *gs = mem;
    float *xn = (float *)(mem + ((gemv_bytes + 63) & ~(size_t)63));
    float *xr = xn + H, *logits = xr + H, *gus = logits + E, *out = gus + 2 * (size_t)F * k, *acc = out + H;
    float *w = acc + H;
    int ids[64];
    for (int r = 0; r < M; r++) {
        prep(x + (size_t)r * H, 1, H, 1, norm_w, eps, xn);
        const float *xin = xn;             // the router's input: the experts' own, or its own norm's
        if (m->router_norm) xin = prep(x + (size_t)r * H, 1, H, 1, m->router_norm, eps, xr);
        if (m->router.bits == 32) {         // E dot products of H (256 x 2,048 a token: shared, vectorized)
            const float *rw = (const float *)m->router.codes;
            #pragma omp parallel for schedule(static) if (E >= 64)
            for (int e = 0; e < E; e++) logits[e] = dot_f32(rw + (size_t)e * H, xin, H);
        } else {
            lin_apply(&m->router, 1, xin, 1, logits, gs, 0, NULL, 0.0f, NULL);
        }
        moe_route(m, logits, ids, w);
        for (int c = 0; c < H; c++) acc[c] = 0.0f;
        gates_ups(m, ids, k, xn, H, gus, gs);
        for (int j = 0; j < k; j++) {
            int e = ids[j];
            float *gu = gus + (size_t)j * 2 * F;
            int fused = m->act == 0 && !m->gb;      // SwiGLU in the down projection's kernel, as a dense MLP's
            if (!fused) expert_act(m, e, gu, gu + F, F, gu);
            lin_apply(m->down + e, 1, gu, 1, out, gs, fused ? 2 : 0, NULL, 0.0f, NULL);
            for (int c = 0; c < H; c++) {
                float v = out[c];
                if (m->db) v += m->db[(size_t)e * H + c];
                acc[c] += v * w[j];
            }
        }
        const float *rr = resid ? resid + (size_t)r * H : NULL;
        float *yr = y + (size_t)r * H;
        for (int c = 0; c < H; c++) yr[c] = rr ? rr[c] + acc[c] : acc[c];
    }
    free(mem);
    return 0;
}

// A shared expert beside a routed MLP (Qwen3.5-MoE, Qwen2-MoE): every row's dense SwiGLU MLP of the same normed
// input, scaled by sigmoid(gate . input). gu: the gate | up parts (2F wide in all), down [H, F], gate [H] fp32.
typedef struct shared_s {
    qlin_t gu[3];
    int ngu;
    qlin_t down;
    const float *gate;
} shared_t;

static int shared_ok(const shared_t *s, int H) {
    if (s->ngu < 1 || s->ngu > 3 || !s->gate || !moe_bits_ok(&s->down) || s->down.N != H) return 0;
    int n = 0;
    for (int p = 0; p < s->ngu; p++) {
        if (!moe_bits_ok(&s->gu[p]) || s->gu[p].K != H) return 0;
        n += s->gu[p].N;
    }
    return n % 2 == 0 && s->down.K == n / 2 && (n / 2) % 32 == 0;
}

// y [M, H] += the shared expert of RMSNorm(x) * norm_w (x [M, H]): the call the forward makes for its decode rows and
// decode_layers for a layer with one (after the routed MLP), so both give the same bits. 0, -1 (out of memory) or -3
// (widths that do not chain at H).
int shared_expert_rows(int M, int H, const float *x, const float *norm_w, float eps, const shared_t *s, float *y) {
    if (M < 1 || H < 1 || !shared_ok(s, H)) return -3;
    int F = s->down.K;
    int kmax = H > F ? H : F;
    size_t gemv_bytes = (size_t)kmax * 2 * 7;
    char *mem = malloc(gemv_bytes + sizeof(float) * ((size_t)2 * H + 2 * (size_t)F) + 64);
    if (!mem) return -1;
    void *gs = mem;
    float *xn = (float *)(mem + ((gemv_bytes + 63) & ~(size_t)63)), *gu = xn + H, *out = gu + 2 * (size_t)F;
    for (int r = 0; r < M; r++) {
        prep(x + (size_t)r * H, 1, H, 1, norm_w, eps, xn);
        lin_apply(s->gu, s->ngu, xn, 1, gu, gs, 0, NULL, 0.0f, NULL);
        lin_apply(&s->down, 1, gu, 1, out, gs, 2, NULL, 0.0f, NULL);       // SwiGLU in the down projection
        float logit = 0.0f;
        for (int c = 0; c < H; c++) logit += s->gate[c] * xn[c];
        float g = 1.0f / (1.0f + expf(-logit));
        float *yr = y + (size_t)r * H;
        for (int c = 0; c < H; c++) yr[c] += out[c] * g;
    }
    free(mem);
    return 0;
}

// A routed MLP's prompt rows, grouped by expert, in one call (the engine's grouped path, without a Python loop over
// experts). xn [T, H]: the rows after the norm; rows [n]: row ids expert by expert (counts[e] of them for expert e,
// e ascending, each group in row order); wts [n]: each one's routing weight. Each group runs its expert's kernels
// MAXM rows at a time (lin_apply, the call the per-expert path makes) and y [T, H] (zeros or the residual, the
// caller's) accumulates w * down(act(gate, up)) (+ db) in ascending expert order: the per-expert path's sums, in
// its order. Returns 0, -1 (out of memory) or -3 (experts that do not chain).
int moe_grouped_rows(int T, int H, const float *xn, const int *rows, const int *counts, const float *wts,
                     const moe_t *m, float *y) {
    if (T < 1 || H < 1 || !moe_ok(m, H)) return -3;
    int F = m->gate[0].N, E = m->E;
    int kmax = H > F ? H : F;
    size_t scratch_bytes = (size_t)kmax * MAXM * 8 + 64;
    size_t floats = (size_t)MAXM * ((size_t)H + 2 * (size_t)F + (size_t)F + (size_t)H) + 64;
    char *mem = malloc(scratch_bytes + sizeof(float) * floats + 64);
    if (!mem) return -1;
    void *gs = mem;
    float *xb = (float *)(mem + ((scratch_bytes + 63) & ~(size_t)63));
    float *g = xb + (size_t)MAXM * H, *u = g + (size_t)MAXM * F, *a = u + (size_t)MAXM * F, *out = a + (size_t)MAXM * F;
    size_t at = 0;
    for (int e = 0; e < E; e++) {
        int n = counts[e];
        for (int r0 = 0; r0 < n; r0 += MAXM) {
            int c = n - r0 < MAXM ? n - r0 : MAXM;
            const int *rr = rows + at + r0;
            for (int i = 0; i < c; i++) memcpy(xb + (size_t)i * H, xn + (size_t)rr[i] * H, sizeof(float) * H);
            lin_apply(m->gate + e, 1, xb, c, g, gs, 0, NULL, 0.0f, NULL);
            lin_apply(m->up + e, 1, xb, c, u, gs, 0, NULL, 0.0f, NULL);
            for (int i = 0; i < c; i++)
                expert_act(m, e, g + (size_t)i * F, u + (size_t)i * F, F, a + (size_t)i * F);
            lin_apply(m->down + e, 1, a, c, out, gs, 0, NULL, 0.0f, NULL);
            for (int i = 0; i < c; i++) {
                float w = wts[at + r0 + i];
                float *yr = y + (size_t)rr[i] * H;
                const float *o = out + (size_t)i * H;
                for (int h = 0; h < H; h++) {
                    float v = o[h];
                    if (m->db) v += m->db[(size_t)e * H + h];
                    yr[h] += v * w;
                }
            }
        }
        at += (size_t)n;
    }
    free(mem);
    return 0;
}
