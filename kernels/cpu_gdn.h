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

// The rule's work for T tokens: q, k rows of stride sqk (floats), v rows of stride sv; the state read from S_in
// [H, Dk, Dv] and the new one written to S_out (the same buffer, or another: then S_in is left as it was). Where z
// is not NULL each head's output is gated-normed too (gdn_mix): RMSNorm over Dv times norm_w, times silu(z), z rows
// of stride sz.
static int gdn_rule_rows(int T, int Hk, int H, int Dk, int Dv, const float *q, const float *k, int sqk,
                         const float *v, int sv, const float *g, const float *beta, const float *S_in, float *S_out,
                         float *out, const float *z, int sz, const float *norm_w, float eps) {
    if (T < 1 || Hk < 1 || H < 1 || H % Hk || Dk < 1 || Dv < 1 || Dk > 1024 || Dv > 1024) return -3;
    int rep = H / Hk;
    float qscale = 1.0f / sqrtf((float)Dk);
    #pragma omp parallel for schedule(static)
    for (int h = 0; h < H; h++) {
        float qn[1024], kn[1024], kv[1024];
        float *S = S_out + (size_t)h * Dk * Dv;
        int kh = h / rep;
        for (int t = 0; t < T; t++) {
            const float *R = (t ? S_out : S_in) + (size_t)h * Dk * Dv;      // the state this token reads
            gdn_unit(q + (size_t)t * sqk + (size_t)kh * Dk, Dk, qscale, qn);
            gdn_unit(k + (size_t)t * sqk + (size_t)kh * Dk, Dk, 1.0f, kn);
            float d = expf(g[(size_t)t * H + h]), b = beta[(size_t)t * H + h];
            const float *vt = v + (size_t)t * sv + (size_t)h * Dv;
            float *o = out + ((size_t)t * H + h) * Dv;
            for (int j = 0; j < Dv; j++) kv[j] = 0.0f;
            for (int i = 0; i < Dk; i++) {
                const float *restrict Ri = R + (size_t)i * Dv;
                float ki = kn[i];
                #pragma omp simd
                for (int j = 0; j < Dv; j++) kv[j] += ki * Ri[j];
            }
            for (int j = 0; j < Dv; j++) {
                kv[j] = (vt[j] - d * kv[j]) * b;        // delta: beta (v - k (d S))
                o[j] = 0.0f;
            }
            for (int i = 0; i < Dk; i++) {
                const float *Ri = R + (size_t)i * Dv;
                float *Si = S + (size_t)i * Dv;
                float ki = kn[i], qi = qn[i];
                #pragma omp simd
                for (int j = 0; j < Dv; j++) {
                    float s = Ri[j] * d + ki * kv[j];
                    Si[j] = s;
                    o[j] += qi * s;
                }
            }
            if (z) {                                     // RMSNorm(o) * w * silu(z)
                const float *zt = z + (size_t)t * sz + (size_t)h * Dv;
                float ss = 0.0f;
                for (int j = 0; j < Dv; j++) ss += o[j] * o[j];
                float r = 1.0f / sqrtf(ss / (float)Dv + eps);
                for (int j = 0; j < Dv; j++) o[j] = (norm_w[j] * (o[j] * r)) * (zt[j] / (1.0f + expf(-zt[j])));
            }
        }
    }
    return 0;
}

int gdn_rule(int T, int Hk, int H, int Dk, int Dv, const float *q, const float *k, const float *v, const float *g,
             const float *beta, float *state, float *out) {
    return gdn_rule_rows(T, Hk, H, Dk, Dv, q, k, Hk * Dk, v, H * Dv, g, beta, state, state, out, NULL, 0, NULL, 0.f);
}

// A Gated DeltaNet layer's mixer (spec.LinearAttention) between its projections, in one call: the vectors a layer
// keeps, and its widths. C = 2 Hk Dk + H Dv channels through the convolution (q | k | v), K taps.
typedef struct gdn_s {
    int Hk, Dk, H, Dv, K;
    const float *conv;          // [K, C]: tap j of every channel; tap K - 1 meets the newest input
    const float *A, *dt_bias;   // [H]: the decay g = A softplus(a + dt_bias), A < 0
    const float *norm;          // [Dv]: the output's RMSNorm weight
} gdn_t;

// T rows of one sequence: proj [T, ld] holds each row's projections, mixed (C) | z (H Dv) | b (H) | a (H). The
// causal convolution reads the state's tail [K - 1, C] before the rows and writes the new tail (the last K - 1
// inputs) to tail_out; the rule reads S_in [H, Dk, Dv] and writes S_out (another buffer: the state before the step
// stays as it was, for a step that fails). out [T, H Dv]: RMSNorm(o) * norm * silu(z) per head, for out_proj.
// Every row runs the same arithmetic whatever T is, so a token's numbers do not depend on how its prompt was cut.
// 0, -1 (out of memory) or -3 (widths past the rule's).
int gdn_mix(const gdn_t *m, int T, const float *proj, int ld, float eps, const float *tail_in, float *tail_out,
            const float *S_in, float *S_out, float *out) {
    int Hk = m->Hk, Dk = m->Dk, H = m->H, Dv = m->Dv, K = m->K;
    if (T < 1 || K < 1 || Hk < 1 || H < 1 || H % Hk || Dk < 1 || Dv < 1 || Dk > 1024 || Dv > 1024) return -3;
    int C = 2 * Hk * Dk + H * Dv, V = H * Dv;
    if (ld < C + V + 2 * H) return -3;
    float *xc = malloc(sizeof(float) * ((size_t)T * C + 2 * (size_t)T * H));
    if (!xc) return -1;
    float *g = xc + (size_t)T * C, *beta = g + (size_t)T * H;
    // convolution + SiLU: input j of row t is the tail's row t + j while t + j < K - 1, else proj's row t + j - K + 1
    #pragma omp parallel for schedule(static) if ((size_t)T * C >= 65536)
    for (int t = 0; t < T; t++) {
        float *x = xc + (size_t)t * C;
        for (int j = 0; j < K; j++) {
            int r = t + j - (K - 1);
            const float *in = r < 0 ? tail_in + (size_t)(t + j) * C : proj + (size_t)r * ld;
            const float *w = m->conv + (size_t)j * C;
            if (j == 0)
                for (int c = 0; c < C; c++) x[c] = in[c] * w[c];
            else
                for (int c = 0; c < C; c++) x[c] += in[c] * w[c];
        }
        for (int c = 0; c < C; c++) x[c] = x[c] / (1.0f + expf(-x[c]));
    }
    for (int i = 0; i < K - 1; i++) {                   // the last K - 1 inputs
        int r = T + i - (K - 1);
        memcpy(tail_out + (size_t)i * C, r < 0 ? tail_in + (size_t)(T + i) * C : proj + (size_t)r * ld,
               sizeof(float) * C);
    }
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const float *p = proj + (size_t)t * ld + C + V;
            float a = p[H + h] + m->dt_bias[h];
            g[(size_t)t * H + h] = m->A[h] * (a > 20.0f ? a : log1pf(expf(a)));       // softplus, torch's threshold
            beta[(size_t)t * H + h] = 1.0f / (1.0f + expf(-p[h]));
        }
    int rc = gdn_rule_rows(T, Hk, H, Dk, Dv, xc, xc + Hk * Dk, C, xc + 2 * Hk * Dk, C, g, beta, S_in, S_out, out,
                           proj + C, ld, m->norm, eps);
    free(xc);
    return rc;
}

// What a decode step brings its layers beside the token rows, for decode_layers: the Gated DeltaNet layers' states,
// n layers' worth, B sequences each (entry j * B + b is state j's for sequence b: its tail and matrices before the
// step, read, and the new ones, written beside them; the caller takes them when the step commits), and Gemma 4's
// per-layer inputs ple [B, layers, width] (NULL: none).
typedef struct {
    int n;
    float **tail_in, **S_in, **tail_out, **S_out;
    const float *ple;
    int ple_layers;
} step_inputs_t;

