// The gated delta rule (Gated DeltaNet, engine/model/linear_attention.py): the recurrence of a linear-attention
// layer over T tokens, one token after another, in C. Included by cpu_quant.c.
//
// Each value head keeps a Dk x Dv matrix S in the caller's `state` [H, Dk, Dv], read and written in place, which
// stays in the core's cache for the whole run of tokens: per token two passes over it (k S, then the rank-one
// update with the output read in the same pass). Token t of value head h, with key head h / (H / Hk) (transformers'
// grouped order): q and k L2-normalized (eps 1e-6), q times Dk^-1/2; d = exp(g); S <- d S;
// S <- S + k (beta (v - k S)); o = q S. A prompt's rows and a decode row run the same arithmetic, so a token's
// numbers do not depend on how its prompt was cut. The torch twins (linear_attention.step / .chunked) agree
// within rounding.

static void gdn_unit(const float *x, int n, float scale, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = scale / sqrtf(ss + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * r;
}

int gdn_rule(int T, int Hk, int H, int Dk, int Dv, const float *q, const float *k, const float *v, const float *g,
             const float *beta, float *state, float *out) {
    if (T < 1 || Hk < 1 || H < 1 || H % Hk || Dk < 1 || Dv < 1 || Dk > 1024 || Dv > 1024) return -3;
    int rep = H / Hk;
    float qscale = 1.0f / sqrtf((float)Dk);
    #pragma omp parallel for schedule(static)
    for (int h = 0; h < H; h++) {
        float qn[1024], kn[1024], kv[1024];
        float *S = state + (size_t)h * Dk * Dv;
        int kh = h / rep;
        for (int t = 0; t < T; t++) {
            gdn_unit(q + ((size_t)t * Hk + kh) * Dk, Dk, qscale, qn);
            gdn_unit(k + ((size_t)t * Hk + kh) * Dk, Dk, 1.0f, kn);
            float d = expf(g[(size_t)t * H + h]), b = beta[(size_t)t * H + h];
            const float *vt = v + ((size_t)t * H + h) * Dv;
            float *o = out + ((size_t)t * H + h) * Dv;
            for (int j = 0; j < Dv; j++) kv[j] = 0.0f;
            for (int i = 0; i < Dk; i++) {
                const float *restrict Si = S + (size_t)i * Dv;
                float ki = kn[i];
                #pragma omp simd
                for (int j = 0; j < Dv; j++) kv[j] += ki * Si[j];
            }
            for (int j = 0; j < Dv; j++) {
                kv[j] = (vt[j] - d * kv[j]) * b;        // delta: beta (v - k (d S))
                o[j] = 0.0f;
            }
            for (int i = 0; i < Dk; i++) {
                float *restrict Si = S + (size_t)i * Dv;
                float ki = kn[i], qi = qn[i];
                #pragma omp simd
                for (int j = 0; j < Dv; j++) {
                    float s = Si[j] * d + ki * kv[j];
                    Si[j] = s;
                    o[j] += qi * s;
                }
            }
        }
    }
    return 0;
}
