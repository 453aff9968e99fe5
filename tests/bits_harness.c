/* The kernels on fixed inputs, for comparing CPUs byte for byte (tests/test_bits_cross.py).
 *
 *     bits_harness INPUT OUTPUT
 *
 * INPUT is random bytes (the test writes them); every weight and activation is made from them
 * in integer arithmetic, so each build sees the same inputs: packed blocks as a GGUF file
 * holds them (little-endian, scales patched to small finite f16 values), floats as exact
 * conversions of integers. OUTPUT gets every result as little-endian float32: the fused
 * matmul of each format (outliers included), the float matmuls, prefill attention, RMSNorm,
 * softmax, sigmoid, SwiGLU's silu, RoPE, the RoPE tables' sin/cos and powers, then one
 * llama-family layer (QK-norm, biases, GQA) and one DeepSeek-V3 layer (q LoRA, MLA, sigmoid
 * grouped routing, routed + shared experts) decoding three positions. Built natively and by
 * Debian's cross compilers (aarch64, armhf NEON, ppc64 big-endian -mcpu=cell -maltivec) and
 * run under qemu-user: the outputs must be the same bytes. Built without OpenMP. */
#include "../cellswarm/kernels/kernels.c"

#include <stdio.h>

static const uint8_t *in_start, *in_p, *in_end;
static FILE *out_f;

static uint32_t next32(void) { /* the input again from its start when it runs out */
    uint32_t u = 0;
    for (int i = 0; i < 4; i++) {
        if (in_p == in_end) in_p = in_start;
        u |= (uint32_t)*in_p++ << (8 * i);
    }
    return u;
}

/* a float in [-scale, scale): an integer of 24 bits, exactly converted, times a power of two */
static float rnd(float scale) { return ((float)(int32_t)(next32() >> 8) - 8388608.0f) * (scale / 8388608.0f); }

static float *floats(int64_t n, float scale) {
    float *v = (float *)malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = rnd(scale);
    return v;
}

static void put(const float *v, int64_t n) { /* little-endian float32, whatever the host */
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, v + i, 4);
        const uint8_t b[4] = {(uint8_t)u, (uint8_t)(u >> 8), (uint8_t)(u >> 16), (uint8_t)(u >> 24)};
        fwrite(b, 1, 4, out_f);
    }
}

static void le16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

static int block_bytes(int fmt) {
    switch (fmt) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q4_K: return 144;
    case Q6_K: return 210;
    case Q2_K: return 84;
    default: return is_lowbit(fmt) ? lowbit_bytes(fmt) : 0;
    }
}

/* rows x cols weights of fmt, as a file holds them */
static uint8_t *weights(int fmt, int64_t rows, int64_t cols) {
    const int64_t per = fmt == F32 ? 4 : fmt == F16 || fmt == BF16 ? 2 : 0;
    if (per) {
        uint8_t *w = (uint8_t *)malloc((size_t)(rows * cols * per));
        for (int64_t i = 0; i < rows * cols; i++) {
            const uint32_t r = next32();
            if (fmt == F32) {
                const float f = rnd(0.25f);
                uint32_t u;
                memcpy(&u, &f, 4);
                for (int b = 0; b < 4; b++) w[4 * i + b] = (uint8_t)(u >> (8 * b));
            } else { /* finite: sign, then a limited exponent */
                le16(w + 2 * i, (uint16_t)((r & 0x8000) | (fmt == F16 ? 0x3000 + (r & 0x7FF) : 0x3E00 + (r & 0xFF))));
            }
        }
        return w;
    }
    const int bb = block_bytes(fmt), n = block_elems(fmt);
    const int64_t nb = rows * (cols / n);
    uint8_t *w = (uint8_t *)malloc((size_t)(nb * bb));
    for (int64_t i = 0; i < nb * bb; i++) w[i] = (uint8_t)next32();
    for (int64_t b = 0; b < nb; b++) { /* f16 scales in [2^-8, 2^-7) */
        uint8_t *blk = w + b * bb;
        if (fmt == IQ1_M) { /* its f16 in the top nibbles of four 16-bit words at 48 */
            const uint16_t d = (uint16_t)(0x1C00 | (next32() & 0x3FF));
            for (int k = 0; k < 4; k++) blk[49 + 2 * k] = (uint8_t)((blk[49 + 2 * k] & 0x0F) | ((d >> (4 * k)) & 0xF) << 4);
            continue;
        }
        if (fmt == MXFP4) { blk[0] = (uint8_t)(120 + next32() % 3); continue; } /* 2^-8 .. 2^-6 */
        if (fmt == NVFP4) continue; /* every E4M3 byte is finite */
        const int offs[2] = {fmt == Q6_K ? 208 : fmt == Q2_K ? 80 : fmt == Q3_K ? 108 : fmt == TQ1_0 ? 52
                             : fmt == TQ2_0 ? 64 : 0,
                             fmt == Q4_1 || fmt == Q4_K || fmt == Q5_1 || fmt == Q5_K ? 2 : fmt == Q2_K ? 82 : -1};
        for (int k = 0; k < 2; k++)
            if (offs[k] >= 0) le16(blk + offs[k], (uint16_t)(0x1C00 | (next32() & 0x3FF)));
    }
    return w;
}

static mat matrix(int fmt, int64_t rows, int64_t cols) {
    const int64_t rb = fmt == F32 ? 4 * cols : fmt == F16 || fmt == BF16 ? 2 * cols
                                                : cols / block_elems(fmt) * block_bytes(fmt);
    return (mat){fmt == F32 ? 2 : fmt == F16 || fmt == BF16 ? 1 : 0, fmt, weights(fmt, rows, cols), rows, rb};
}

static void matmuls(void) {
    const int quant[] = {Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, Q2_K, Q5_1, Q3_K, Q5_K, IQ2_XXS, IQ2_XS, IQ3_XXS,
                         IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0, MXFP4, NVFP4};
    const int flt[] = {F32, F16, BF16};
    const int64_t rows = 37, cols = 512, nx = 3;
    float *x = floats(nx * cols, 1.0f), out[3 * 37];
    x[5] = 40.0f; /* outliers: multiplied in float */
    x[cols + 300] = -25.0f;
    for (int i = 0; i < (int)(sizeof quant / sizeof quant[0]); i++) {
        const mat m = matrix(quant[i], rows, cols);
        cs_matmul_qx(quant[i], m.w, rows, m.row_bytes, cols, x, nx, out);
        put(out, nx * rows);
        float *deq = (float *)malloc(sizeof(float) * (size_t)(rows * cols)); /* and as floats */
        cs_dequantize(quant[i], m.w, rows, m.row_bytes, cols, deq);
        put(deq, rows * cols);
        free(deq);
        free((void *)m.w);
    }
    for (int i = 0; i < 3; i++) {
        const mat m = matrix(flt[i], rows, cols);
        cs_matmul_f(flt[i], m.w, rows, cols, x, nx, out);
        put(out, nx * rows);
        free((void *)m.w);
    }
    free(x);
}

static void elementwise(void) {
    const int64_t t = 5, h = 4, kv = 2, d = 64, cap = 12, s = 12;
    float *q = floats(t * h * d, 1.0f), *k = floats(kv * cap * d, 1.0f), *v = floats(kv * cap * d, 1.0f);
    float *o = floats(t * h * d, 1.0f);
    const int64_t ld = keys_ld(cap); /* the keys as the cache keeps them: component-major */
    float *kt = (float *)calloc((size_t)(kv * d * ld), sizeof(float));
    for (int64_t j = 0; j < kv; j++)
        for (int64_t i = 0; i < s; i++)
            for (int64_t c = 0; c < d; c++) kt[(j * d + c) * ld + i] = k[(j * cap + i) * d + c];
    cs_attend(q, t, kt, ld, v, cap, h, kv, s, d, d, 0.125f, o);
    free(kt);
    put(o, t * h * d);
    float *w = floats(d, 1.0f), *r = floats(t * d, 1.0f);
    cs_rms_rows(q, t, d, w, 1e-5f, r);
    put(r, t * d);
    memcpy(r, q, sizeof(float) * (size_t)(t * d));
    for (int64_t i = 0; i < t * d; i++) r[i] *= 30.0f; /* to exp's far ends */
    cs_softmax_rows(r, t, d);
    put(r, t * d);
    cs_sigmoid(q, t * d, r);
    put(r, t * d);
    memcpy(r, q, sizeof(float) * (size_t)(t * d));
    cs_silu_mul_rows(r, k, t, d);
    put(r, t * d);
    float *ang = floats(t * d / 2, 3000.0f), *cs = floats(t * d / 2, 1.0f), *sn = floats(t * d / 2, 1.0f);
    cs_sincos(ang, t * d / 2, cs, sn);
    put(cs, t * d / 2);
    put(sn, t * d / 2);
    cs_rope_rows(q, t, h, d, d, 1, cs, sn);
    put(q, t * h * d);
    float e[32], p[32];
    for (int i = 0; i < 32; i++) e[i] = (float)(2 * i) / 64.0f;
    cs_pow(10000.0, e, 32, p);
    put(p, 32);
    const float lg = (float)cs_log(12345.678);
    put(&lg, 1);
    free(q); free(k); free(v); free(o); free(w); free(r); free(ang); free(cs); free(sn);
}

static void tables(int64_t pos, int64_t dim, float *cs, float *sn) {
    float e[64], inv[64], a[64];
    for (int64_t i = 0; i < dim / 2; i++) e[i] = (float)(2 * i) / (float)dim;
    cs_pow(10000.0, e, dim / 2, inv);
    for (int64_t i = 0; i < dim / 2; i++) a[i] = (float)pos * (1.0f / inv[i]);
    cs_sincos(a, dim / 2, cs, sn);
}

/* n floats of `scale` as a cache of `kind` stores them (rows of `width`): the same bytes on
 * every CPU is what the fused layers' reads start from (kv.c) */
static void *stored(int kind, int64_t n, int64_t width, float scale) {
    float *v = floats(n, scale);
    void *b = malloc((size_t)(n * 4));
    cs_kv_encode(kind, v, n / width, width, b);
    free(v);
    return b;
}

/* f32 -> f16 / Q8_0 and back (kv.c), on values with subnormals, overflow, ties and NaNs */
static void cache_codecs(void) {
    const int64_t n = 4096;
    float *x = floats(n, 1.0f);
    const float special[] = {65504.0f, 65520.0f, 1e6f, -1e-8f, 5.96e-8f, 2.98e-8f, 0.5f, -0.0f,
                             6.1e-5f, 1.0009765625f, 1.00048828125f, NAN, INFINITY, -INFINITY};
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * (float)(1 << (i % 24)) * 1e-4f;
    memcpy(x, special, sizeof special);
    uint8_t *b = (uint8_t *)malloc((size_t)(4 * n));
    float *y = (float *)malloc(sizeof(float) * (size_t)(4 * n));
    for (int kind = 1; kind <= 8; kind += 7) {
        const int64_t from = kind == 1 ? 0 : 32; /* q8_0: no NaN block (its bits unpromised) */
        cs_kv_encode(kind, x + from, 1, n - from, b);
        /* the stored bytes as numbers (finite, each exact: NaNs and infinities included) */
        const int64_t bytes = kind == 1 ? 2 * (n - from) : (n - from) / 32 * 34;
        if (kind == 1) /* f16 codes, not bytes: the cache keeps them in the host's order */
            for (int64_t i = 0; i < n - from; i++) y[i] = (float)((const uint16_t *)b)[i];
        else
            for (int64_t i = 0; i < bytes; i++) y[i] = (float)b[i];
        put(y, kind == 1 ? n - from : bytes);
        cs_kv_decode(kind, b, 1, n - from, y);
        for (int64_t i = 0; i < n - from; i++) y[i] = isfinite(y[i]) ? y[i] : 0.0f;
        put(y, n - from);
    }
}

static void llama_layer_steps(int kind) {
    llama_layer L;
    const int64_t d = 256, H = 4, kv = 2, hd = 64, ffn = 512, cap = 16;
    L.q = matrix(Q4_K, H * hd, d); L.k = matrix(Q4_K, kv * hd, d); L.v = matrix(Q6_K, kv * hd, d);
    L.o = matrix(Q4_K, d, H * hd); L.gate = matrix(Q4_K, ffn, d); L.up = matrix(Q4_K, ffn, d);
    L.down = matrix(Q6_K, d, ffn);
    L.attn_norm = floats(d, 1.0f); L.ffn_norm = floats(d, 1.0f);
    L.q_bias = floats(H * hd, 0.1f); L.k_bias = floats(kv * hd, 0.1f); L.v_bias = floats(kv * hd, 0.1f);
    L.q_norm = floats(hd, 1.0f); L.k_norm = floats(hd, 1.0f);
    L.d = d; L.n_heads = H; L.n_kv = kv; L.head_dim = hd; L.ffn = ffn; L.rope_dim = hd; L.rope_neox = 1;
    L.eps = 1e-6f; L.scale = 0.125f;
    void *ks = stored(kind, kv * hd * keys_ld(cap), kind == 8 ? hd : kv * hd * keys_ld(cap), 1.0f);
    void *vs = stored(kind, kv * cap * hd, hd, 1.0f);
    float *x = floats(d, 1.0f);
    const int64_t widest = ffn;
    float *f = (float *)malloc(sizeof(float) * (size_t)(3 * d + (H + 2 * kv) * hd + 2 * ffn + H * cap));
    int8_t *xq = (int8_t *)malloc((size_t)(2 * widest));
    float *xd = (float *)malloc(sizeof(float) * (size_t)(12 * widest / 32));
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(widest / 16));
    for (int64_t pos = 7; pos < 10; pos++) {
        float cs[32], sn[32];
        tables(pos, hd, cs, sn);
        cs_llama_decode(&L, x, pos, cs, sn, ks, vs, cap, kind, f, xq, xd, xs);
        put(x, d);
    }
}

static void deepseek_layer_steps(int kind) {
    ds_layer L;
    memset(&L, 0, sizeof L);
    const int64_t d = 256, H = 4, ql = 256, lat = 256, N = 32, R = 32, V = 32, F = 256, E = 16, cap = 16;
    L.q_a = matrix(Q4_K, ql, d); L.q_b = matrix(Q4_K, H * (N + R), ql); L.kv_a = matrix(Q4_K, lat + R, d);
    L.k_b = matrix(Q8_0, H * lat, N); L.k_b.rows = lat; /* per head: lat rows of N */
    L.v_b = matrix(Q8_0, H * V, lat); L.v_b.rows = V;
    L.o = matrix(Q8_0, d, H * V);
    L.gate = matrix(Q4_K, F, d); L.up = matrix(Q4_K, F, d); L.down = matrix(Q6_K, d, F); /* shared */
    L.router = matrix(F32, E, d);
    L.gate_exps = matrix(Q4_K, E * F, d); L.up_exps = matrix(Q4_K, E * F, d); L.down_exps = matrix(Q6_K, E * d, F);
    L.gate_exps.rows = L.up_exps.rows = F; L.down_exps.rows = d;
    L.gate_stride = F * L.gate_exps.row_bytes; L.up_stride = F * L.up_exps.row_bytes;
    L.down_stride = d * L.down_exps.row_bytes;
    L.attn_norm = floats(d, 1.0f); L.ffn_norm = floats(d, 1.0f); L.q_a_norm = floats(ql, 1.0f);
    L.kv_a_norm = floats(lat, 1.0f); L.router_bias = floats(E, 0.05f);
    L.d = d; L.n_heads = H; L.q_lora = ql; L.kv_lora = lat; L.nope = N; L.rope_dim = R; L.v_dim = V;
    L.ffn = F; L.moe_ffn = F; L.n_experts = E; L.n_used = 4; L.n_groups = 4; L.topk_groups = 2;
    L.sigmoid = 1; L.norm_topk = 1; L.moe = 1;
    L.eps = 1e-6f; L.latent_eps = 1e-6f; L.scale = 0.125f; L.routed_scale = 2.5f;
    void *lats = stored(kind, cap * lat, lat, 1.0f), *krs = stored(kind, cap * R, R, 1.0f);
    float *x = floats(d, 1.0f);
    float *f = (float *)malloc(sizeof(float) * (size_t)cs_ds_scratch_floats(&L, cap, 1));
    int8_t *q8 = (int8_t *)malloc((size_t)cs_ds_scratch_qbytes(&L, 1));
    for (int64_t pos = 7; pos < 10; pos++) {
        float cs[16], sn[16];
        tables(pos, R, cs, sn);
        cs_ds_decode(&L, x, pos, cs, sn, lats, krs, cap, kind, f, q8);
        put(x, d);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: bits_harness INPUT OUTPUT\n"); return 2; }
    FILE *in = fopen(argv[1], "rb");
    static uint8_t buf[1 << 20];
    const size_t n = in ? fread(buf, 1, sizeof buf, in) : 0;
    if (n < 65536) { fprintf(stderr, "bits_harness: %s: need 64 KiB of input\n", argv[1]); return 2; }
    fclose(in);
    in_start = in_p = buf;
    in_end = buf + n;
    out_f = fopen(argv[2], "wb");
    if (!out_f) { perror(argv[2]); return 2; }
    matmuls();
    elementwise();
    cache_codecs();
    for (int kind = 0; kind <= 8; kind += kind ? 7 : 1) { /* the KV cache as f32, f16, q8_0 */
        llama_layer_steps(kind);
        deepseek_layer_steps(kind);
    }
    fclose(out_f);
    return 0;
}
