/* One DeepSeek-V2/V3 / Kimi-K2 layer for one token (models/deepseek2.py), allocation-free.
 *
 * Included at the end of kernels.c (it uses that file's row kernels and activation
 * quantizer). A layer is three phases, each callable alone so that a layer whose routed
 * experts live elsewhere (expert nodes, the tiered cache) still runs the rest here:
 *
 *   cs_ds_attention  x += MLA(rms(x)): q (LoRA or plain), kv_a, RoPE, the latent cache write,
 *                    absorbed attention over the latent cache, W_UV, the output projection
 *   cs_ds_route      h = rms(x); the router (sigmoid + bias or softmax, grouped top-k,
 *                    normalization, routed scaling) -> expert ids and weights
 *   cs_ds_ffn        x += the selected routed experts (ascending id, each weight * SwiGLU)
 *                    + the shared experts; or the dense SwiGLU of a first_k_dense layer
 *
 * and cs_ds_decode runs all three: one call per layer. Matrix-vector products of a phase
 * that share an input, or that run side by side (the per-head W_UK and W_UV, every selected
 * expert's gate and up, then every down), are one parallel loop over all their rows, so a
 * layer costs ~8 thread fork/joins, not one per matrix. Each output row is computed whole by
 * one thread with the same row kernel whatever the thread count, so results do not depend on
 * threads. A routed expert's SwiGLU here is the same arithmetic as cs_swiglu1 (which
 * ops.swiglu calls for one row), so an expert computed on another node, or by the tiered
 * engine, is the same bits as one computed here.
 */

/* An activation vector as a row kernel reads it: float (F16/BF16/F32 weights), or int8 blocks
 * of 32 with their scales, 16-value sums and float block sums (quantized weights). */
typedef struct {
    const float *xf; const int8_t *xq; const float *xd; const int32_t *xs; const float *xsum;
    const outliers *ol; const int32_t *vid; /* per block, as qbuf's (NULL: no outliers) */
} actv;

/* The quantized form of up to `cols` floats, carved from the caller's scratch; t: the same
 * int8 values laid out for the AVX-512 quads, interleaved in 128-byte groups counted from q
 * (a vector taken from an offset that is not a multiple of 128 goes without them); ol and vid,
 * one per 32-block: a vector's outliers at its first block, and how many blocks back from
 * each block its vector starts (take_outliers_rows). */
typedef struct {
    int8_t *q; float *d; int32_t *s; float *sum; int8_t *t; outliers *ol; int32_t *vid;
} qbuf;

static void quant(const float *x, int64_t cols, const qbuf *b) {
    cs_quantize_act(x, 1, cols, b->q, b->d, b->s);
    if (b->ol) take_outliers_rows(x, 1, cols, b->q, b->d, b->s, b->ol, b->vid);
    /* as cs_matmul_q computes it, so a row here is the same bits as there */
    for (int64_t i = 0; i < cols / 32; i++) b->sum[i] = b->d[i] * (float)(b->s[2 * i] + b->s[2 * i + 1]);
}

/* n vectors of cols, each its own for the outliers, at column off of b */
static void quant_rows(const float *x, int64_t n, int64_t cols, const qbuf *b, int64_t off) {
    const qbuf part = {b->q + off, b->d + off / 32, b->s + off / 16, b->sum + off / 32, NULL,
                       b->ol ? b->ol + off / 32 : NULL, b->vid ? b->vid + off / 32 : NULL};
    cs_quantize_act(x, n, cols, part.q, part.d, part.s);
    if (part.ol) take_outliers_rows(x, n, cols, part.q, part.d, part.s, part.ol, part.vid);
    for (int64_t i = 0; i < n * cols / 32; i++) part.sum[i] = part.d[i] * (float)(part.s[2 * i] + part.s[2 * i + 1]);
}

static actv at(const qbuf *b, const float *xf, int64_t off) { /* the vector from column `off` */
    return (actv){xf ? xf + off : NULL, b->q + off, b->d + off / 32, b->s + off / 16,
                  b->sum + off / 32, b->ol ? b->ol + off / 32 : NULL,
                  b->vid ? b->vid + off / 32 : NULL};
}

/* One output row: W[row] . x, as cs_matmul_qx / cs_matmul_f compute it (kind 2: F32) */
static float row_dot(const mat *m, const uint8_t *row, int64_t cols, const actv *a) {
    float o;
    if (m->kind != 0) {
        exact_row_f(m->kind == 2 ? F32 : (int)m->fmt, row, cols, a->xf, 1, cols, &o);
        return o;
    }
    const acts s = {a->xq, a->xd, a->xs, cols, 1, a->xsum};
    exact_row_q(R16_NATURAL((int)m->fmt), row, &s, &o); /* repacked: a row after its groups */
    return o;
}

/* Matrix-vector products run side by side: task i is rows [0, rows) of `m`'s layout starting
 * at `w`, times `a`, into `out`; with nx > 1, nx activation rows (`cols` apart) share each
 * read of a weight row, output row k at out + k * ld (nx 0 or 1: one vector). */
typedef struct {
    const mat *m; const uint8_t *w; int64_t rows, cols; actv a; float *out; int64_t nx, ld;
} task;

#define MAX_TASKS 512


/* The outliers of a task's activation rows (nx, each `cols` from the view's start) */
static void plan_task(const task *k, ol_plan *pl) {
    const int64_t nx = k->nx > 1 ? k->nx : 1;
    for (int64_t b = 0; b < nx; b++) {
        const int64_t blk = b * k->cols / 32, back = k->a.vid[blk];
        plan_add(pl, (int)k->m->fmt, (int)b, k->a.ol + blk - back, 32 * back, k->cols);
    }
}

/* All rows of all tasks, in chunks handed out dynamically: a thread that lost its core to
 * another process holds back only the chunk it is on. */
static void run_chunk(const task *t, const int64_t *start, int64_t lo, int64_t hi) {
    int i = 0, planned = -1;
    ol_plan pl;
    pl.nu = 0;
    while (start[i + 1] <= lo) i++;
    for (int64_t r = lo; r < hi; r++) {
        while (start[i + 1] <= r) i++;
        const task *k = &t[i];
        const int64_t j = r - start[i];
        const uint8_t *row = k->w + j * k->m->row_bytes;
        if (planned != i) { /* the task's outliers: once per chunk */
            planned = i;
            pl.nu = 0;
            if (k->m->kind == 0 && k->a.ol) plan_task(k, &pl);
        }
#ifdef HAVE_R16
        if (IS_R16((int)k->m->fmt) && j < k->rows / 16 * 16) { /* a group: by its first row */
            if (j % 16 == 0) {
                const acts s = {k->a.xq, k->a.xd, k->a.xs, k->cols, k->nx > 1 ? k->nx : 1, k->a.xsum};
                r16_group((int)k->m->fmt, row, &s, &pl, k->out + j, k->ld);
            }
            continue;
        }
#endif
        k->out[j] = row_dot(k->m, row, k->cols, &k->a);
        /* More activation rows: each with the one-row kernel while the weight row is in
         * L1, so a token's result is the same bits alone or batched with others. */
        for (int64_t b = 1; b < k->nx; b++) {
            const int64_t o = b * k->cols;
            const actv a = {k->a.xf ? k->a.xf + o : NULL, k->a.xq + o, k->a.xd + o / 32,
                            k->a.xs + o / 16, k->a.xsum ? k->a.xsum + o / 32 : NULL, NULL, NULL};
            k->out[b * k->ld + j] = row_dot(k->m, row, k->cols, &a);
        }
        if (pl.nu) { /* + what the integer dot products left out, as cs_matmul_qx adds it */
            float add[MAX_BATCH];
            plan_row(R16_NATURAL((int)k->m->fmt), row, &pl, add);
            k->out[j] += add[0];
            for (int64_t b = 1; b < k->nx; b++) k->out[b * k->ld + j] += add[b];
        }
    }
}

/* All rows of all tasks, in chunks handed out dynamically: a thread that lost its core to
 * another process holds back only the chunk it is on (and gov_note sees it). */
static void run_tasks(const task *t, int n) {
    int64_t start[MAX_TASKS + 1];
    start[0] = 0;
    for (int i = 0; i < n; i++) start[i + 1] = start[i] + t[i].rows;
    const int64_t total = start[n], nt = max_threads();
    int64_t chunk = total / (8 * nt);
    chunk = chunk < 8 ? 8 : chunk;
    const int64_t n_chunks = (total + chunk - 1) / chunk;
    const int use = n_chunks > 1 && nt > 1 ? gov_threads() : 1;
    if (use == 1) {
        run_chunk(t, start, 0, total);
        return;
    }
    double done[GOV_MAX_THREADS], t0 = now_s();
#pragma omp parallel num_threads(use)
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t c = 0; c < n_chunks; c++)
            run_chunk(t, start, c * chunk, c * chunk + chunk < total ? c * chunk + chunk : total);
#ifdef _OPENMP
        done[omp_get_thread_num()] = now_s();
#endif
    }
    gov_note(t0, done, use);
}

static task whole(const mat *m, int64_t cols, actv a, float *out) {
    return (task){m, m->w, m->rows, cols, a, out};
}

/* g = silu(g) * u. One out-of-line function for every SwiGLU, so the same inputs give the
 * same bits wherever it runs (an inlined copy could be vectorized differently). Its exp is
 * exp16, not libm's expf: expf does not vectorize, and a 1B model's 90,000 a token ran on
 * one core between the parallel matmuls. */
__attribute__((noinline)) static void silu_mul(float *restrict g, const float *restrict u,
                                               int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const v16f x = xload16(g, i, n);
        store16_n(g + i, x / (1.0f + exp16(-x)) * xload16(u, i, n), n - i);
    }
}

/* g = silu(g) * u for `rows` rows of `width` (a prefill's SwiGLU between its matmuls), rows
 * shared among threads: each row is silu_mul's one call, so each value is the bits a decode
 * step gives it, however the rows are split. numpy's silu (five passes over the (T, ffn)
 * arrays, on one core) gave a prefill's SwiGLU other last bits than a decode step's, and
 * cost ~2% of a 512-token prefill at 2 threads. */
void cs_silu_mul_rows(float *g, const float *u, int64_t rows, int64_t width) {
    const int use = rows > 1 ? gov_threads_for(rows * width) : 1;
#pragma omp parallel for num_threads(use) if (use > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) silu_mul(g + r * width, u + r * width, width);
}

/* ---- one SwiGLU for one row: ops.swiglu's fused path ------------------------------------- */

/* out (d) = down(silu(gate x) * up x); f: 2 * ffn floats; q: a qbuf for max(d, ffn) columns. */
static void swiglu1(const mat *gate, const mat *up, const mat *down, const float *x, int64_t d,
                    float *out, float *f, const qbuf *q) {
    const int64_t ffn = gate->rows;
    float *g = f, *u = f + ffn;
    if (gate->kind == 0) quant(x, d, q);
    task t[2] = {whole(gate, d, at(q, x, 0), g), whole(up, d, at(q, x, 0), u)};
    run_tasks(t, 2);
    silu_mul(g, u, ffn);
    if (down->kind == 0) quant(g, ffn, q);
    task dn = whole(down, ffn, at(q, g, 0), out);
    run_tasks(&dn, 1);
}

void cs_swiglu1(const mat *gate, const mat *up, const mat *down, const float *x, int64_t d,
                float *out) {
    const int64_t ffn = gate->rows, w = d > ffn ? d : ffn;
    float *f = (float *)malloc(sizeof(float) * (size_t)(2 * ffn + w / 32));
    int8_t *q8 = (int8_t *)malloc((size_t)(2 * w) + sizeof(float) * (size_t)(w / 32) + sizeof(int32_t) * (size_t)(w / 16));
    outliers *ol = (outliers *)malloc((sizeof(outliers) + sizeof(int32_t)) * (size_t)(w / 32));
    float *d8 = (float *)(q8 + 2 * w);
    const qbuf q = {q8, d8, (int32_t *)(d8 + w / 32), f + 2 * ffn, q8 + w, ol, (int32_t *)(ol + w / 32)};
    swiglu1(gate, up, down, x, d, out, f, &q);
    free(f);
    free(q8);
    free(ol);
}

/* ---- the layer ----------------------------------------------------------------------------- */

typedef struct {
    mat q_a, q_b, q, kv_a, k_b, v_b, o;  /* q_a.w NULL: no q LoRA, queries from q */
    mat gate, up, down;                  /* the dense FFN, or the shared experts (w NULL: none) */
    mat router;                          /* ffn_gate_inp (E, d) */
    mat gate_exps, up_exps, down_exps;   /* expert 0's matrix; the others follow at a stride */
    int64_t gate_stride, up_stride, down_stride; /* bytes from one expert to the next */
    const uint8_t *held;                 /* E flags: the experts this store holds */
    const float *attn_norm, *ffn_norm, *q_a_norm, *kv_a_norm, *router_bias;
    int64_t d, n_heads, q_lora, kv_lora, nope, rope_dim, v_dim, ffn, moe_ffn;
    int64_t n_experts, n_used, n_groups, topk_groups, sigmoid, norm_topk, moe;
    float eps, latent_eps, scale, routed_scale;
} ds_layer;

/* The widest vector one token's call quantizes at once. */
static int64_t ds_widest(const ds_layer *L) {
    const int64_t H = L->n_heads, shared = L->gate.w ? L->gate.rows : 0;
    int64_t w = L->d;
    const int64_t cand[] = {L->q_lora, H * L->nope, H * L->kv_lora, H * L->v_dim, L->ffn,
                            L->n_used * L->moe_ffn + shared, (L->n_used + 1) * L->d};
    for (size_t i = 0; i < sizeof cand / sizeof cand[0]; i++) w = cand[i] > w ? cand[i] : w;
    return w;
}

static int64_t ds_ffn_width(const ds_layer *L) {
    const int64_t shared = L->gate.w ? L->gate.rows : 0, moe = L->n_used * L->moe_ffn + shared;
    return (L->ffn > moe ? L->ffn : moe) + 128; /* + the shared expert's alignment */
}

/* Scratch floats for n tokens (of n sequences) on caches of up to `cap` tokens. */
int64_t cs_ds_scratch_floats(const ds_layer *L, int64_t cap, int64_t n) {
    const int64_t H = L->n_heads, qk = L->nope + L->rope_dim;
    const int64_t per = 2 * L->d + L->q_lora + H * qk + H * L->nope + L->kv_lora + L->rope_dim
                        + 2 * H * L->kv_lora + H * L->v_dim + H * cap + 3 * L->n_experts
                        + 2 * ds_ffn_width(L) + (L->n_used + 1) * L->d + ds_widest(L) / 32;
    return n * per + 64;
}

int64_t cs_ds_scratch_qbytes(const ds_layer *L, int64_t n) {
    const int64_t w = n * ds_widest(L);
    return 2 * w + 4 * (w / 32) + 4 * (w / 16) + (int64_t)(sizeof(outliers) + 4) * (w / 32) + 128;
}

typedef struct {
    float *h, *qa, *q, *qn, *kv, *qlat, *ctx, *vo, *probs, *tmp, *logits, *scores, *choice, *g, *u, *y;
    qbuf q8;
} ds_scratch;

static ds_scratch carve(const ds_layer *L, int64_t cap, float *f, int8_t *q8, int64_t n) {
    const int64_t H = L->n_heads, qk = L->nope + L->rope_dim, ffn = ds_ffn_width(L);
    const int64_t w = n * ds_widest(L);
    ds_scratch s;
    s.h = f; f += n * L->d;
    s.tmp = f; f += n * L->d;
    s.qa = f; f += n * L->q_lora;
    s.q = f; f += n * H * qk;
    s.qn = f; f += n * H * L->nope;
    s.kv = f; f += n * (L->kv_lora + L->rope_dim);
    s.qlat = f; f += n * H * L->kv_lora;
    s.ctx = f; f += n * H * L->kv_lora;
    s.vo = f; f += n * H * L->v_dim;
    s.probs = f; f += n * H * cap;
    s.logits = f; f += n * L->n_experts;
    s.scores = f; f += n * L->n_experts;
    s.choice = f; f += n * L->n_experts;
    s.g = f; f += n * ffn;
    s.u = f; f += n * ffn;
    s.y = f; f += n * (L->n_used + 1) * L->d;
    s.q8.sum = f;
    s.q8.q = q8;
    s.q8.t = q8 + w;
    s.q8.d = (float *)(((uintptr_t)(q8 + 2 * w) + 15) & ~(uintptr_t)15);
    s.q8.s = (int32_t *)(s.q8.d + w / 32);
    s.q8.ol = (outliers *)(s.q8.s + w / 16);
    s.q8.vid = (int32_t *)(s.q8.ol + w / 32);
    return s;
}

/* out[h] = dot_exact(q + h * ldq, b, n) for h < NH (1..4): the same bits as NH calls (q . b
 * per 16 lanes in order of c, then fold16), b read once for all of them */
static inline __attribute__((always_inline)) void dot_rows(const int NH, const float *q, int64_t ldq,
                                                           const float *b, int64_t n, float *out) {
    att16 acc[4];
    for (int h = 0; h < NH; h++) acc[h] = att16_zero();
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) {
        const att16 y = att16_load(b + c);
        for (int h = 0; h < NH; h++) acc[h] = att16_addmul(acc[h], att16_load(q + h * ldq + c), y);
    }
    for (int h = 0; h < NH; h++) {
        v16f a;
        memcpy(&a, &acc[h], sizeof a);
        if (c < n) a = a + xload16(q + h * ldq, c, n) * xload16(b, c, n);
        out[h] = fold16(a);
    }
}

/* softmax(scale * (q_lat . latent_t + q_rope . k_rope_t)) over the cached tokens, then the
 * probabilities times the latents: a head's attention, entirely in latent space, in
 * attend_nq's arithmetic (dot_exact, softmax_parts, the values summed in order of t).
 * NH (1..4) heads of one query go together (their q_lat ldql apart, q_rope ldqr, scores lp,
 * ctx ldc), each head's arithmetic its own, each latent row read once for all of them: the
 * heads share the latents, and a prefill's 512 keys are 1 MB of them, which had been read
 * twice a head (2026-12-07: 48% of the MoE's prefill, at 0.35-0.47x llama.cpp's). */
static inline __attribute__((always_inline)) void mla_nh(
    const int NH, const float *restrict qlat, int64_t ldql, const float *restrict qrope,
    int64_t ldqr, const float *restrict lat, const float *restrict kr, int64_t s_len,
    int64_t n_lat, int64_t n_rope, float scale, float *restrict p, int64_t lp,
    float *restrict ctx, int64_t ldc) {
    for (int64_t t = 0; t < s_len; t++) {
        float l[4], r[4];
        dot_rows(NH, qlat, ldql, lat + t * n_lat, n_lat, l);
        dot_rows(NH, qrope, ldqr, kr + t * n_rope, n_rope, r);
        for (int h = 0; h < NH; h++) p[h * lp + t] = (l[h] + r[h]) * scale;
    }
    float inv[4];
    for (int h = 0; h < NH; h++) inv[h] = 1.0f / softmax_parts(p + h * lp, s_len);
    att_values(NH, lat, n_lat, 0, p, lp, s_len, inv, ctx, ldc);
}

/* mla_nh for nh (1..4) heads */
static void mla_heads(int nh, const float *qlat, int64_t ldql, const float *qrope, int64_t ldqr,
                      const float *lat, const float *kr, int64_t s_len, int64_t n_lat,
                      int64_t n_rope, float scale, float *p, int64_t lp, float *ctx, int64_t ldc) {
    switch (nh) {
    case 1: mla_nh(1, qlat, ldql, qrope, ldqr, lat, kr, s_len, n_lat, n_rope, scale, p, lp, ctx, ldc); break;
    case 2: mla_nh(2, qlat, ldql, qrope, ldqr, lat, kr, s_len, n_lat, n_rope, scale, p, lp, ctx, ldc); break;
    case 3: mla_nh(3, qlat, ldql, qrope, ldqr, lat, kr, s_len, n_lat, n_rope, scale, p, lp, ctx, ldc); break;
    default: mla_nh(4, qlat, ldql, qrope, ldqr, lat, kr, s_len, n_lat, n_rope, scale, p, lp, ctx, ldc); break;
    }
}

/* A prefill's latent attention: qlat (t, H, L), qrope (t, H, R) against the latent cache
 * lat (s_len, L), kr (s_len, R), the t new tokens last -> ctx (t, H, L). Query i sees the first
 * s_len - t + i + 1 tokens; each (query, head) is mla_nh's, as a decode step computes it. */
void cs_mla_attend(const float *qlat, const float *qrope, const float *lat, const float *kr,
                   int64_t t, int64_t H, int64_t s_len, int64_t n_lat, int64_t n_rope, float scale,
                   float *ctx) {
    const int64_t groups = (H + 3) / 4, jobs = t * groups;
    const int use = gov_threads_for(t * H * s_len * n_lat);
#pragma omp parallel num_threads(use) if (use > 1)
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(4 * s_len));
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < jobs; j++) {
            const int64_t i = j / groups, h = 4 * (j % groups), at = i * H + h;
            mla_heads((int)(H - h < 4 ? H - h : 4), qlat + at * n_lat, n_lat, qrope + at * n_rope,
                      n_rope, lat, kr, s_len - t + i + 1, n_lat, n_rope, scale, p, s_len,
                      ctx + at * n_lat, n_lat);
        }
        free(p);
    }
}

/* A token's normed latent and RoPE key kv (lat + R) into its caches' row `pos`, as the
 * cache's kind stores them (kv.c kv_put) */
static void ds_cache_put(const ds_layer *L, const float *kv, int kind, void *lat_store,
                         void *kr_store, int64_t pos) {
    kv_put(kind, kv, L->kv_lora, lat_store, pos);
    kv_put(kind, kv + L->kv_lora, L->rope_dim, kr_store, pos);
}

/* the caches' first s_len rows as floats: the stores themselves (f32), or decoded into a new
 * buffer *held (s_len * (lat + R) floats; the caller frees it) */
static void ds_cache_get(const ds_layer *L, int kind, const void *lat_store, const void *kr_store,
                         int64_t s_len, const float **lat_f, const float **kr_f, float **held) {
    const int64_t lat = L->kv_lora, R = L->rope_dim;
    *held = kind == KV_F32 ? NULL : (float *)malloc(sizeof(float) * (size_t)(s_len * (lat + R)));
    *lat_f = kv_rows(kind, lat_store, lat, s_len, *held);
    *kr_f = kv_rows(kind, kr_store, R, s_len, *held ? *held + s_len * lat : NULL);
}

/* x (d) += MLA attention of the token at `pos`; writes its latent and RoPE key to the cache:
 * lat_store (cap, kv_lora), kr_store (cap, rope_dim), of kind `kind` (kv.c). cs/sn: the
 * position's RoPE tables. */
static void ds_attention(const ds_layer *L, float *x, int64_t pos, const float *cs,
                         const float *sn, void *lat_store, void *kr_store, int kind,
                         ds_scratch *s) {
    const int64_t d = L->d, H = L->n_heads, N = L->nope, R = L->rope_dim, qk = N + R;
    const int64_t lat = L->kv_lora, V = L->v_dim;
    const qbuf *q = &s->q8;
    rms(x, L->attn_norm, d, L->eps, s->h);
    quant(s->h, d, q);
    const actv ah = at(q, s->h, 0);
    task t[MAX_TASKS];
    if (L->q_a.w) { /* q_a and kv_a share the normed input: one loop */
        t[0] = whole(&L->q_a, d, ah, s->qa);
        t[1] = whole(&L->kv_a, d, ah, s->kv);
        run_tasks(t, 2);
        rms(s->qa, L->q_a_norm, L->q_lora, L->latent_eps, s->qa);
        if (L->q_b.kind == 0) quant(s->qa, L->q_lora, q);
        t[0] = whole(&L->q_b, L->q_lora, at(q, s->qa, 0), s->q);
        run_tasks(t, 1);
    } else {
        t[0] = whole(&L->q, d, ah, s->q);
        t[1] = whole(&L->kv_a, d, ah, s->kv);
        run_tasks(t, 2);
    }
    rope(s->q + N, H, qk, R, 0, cs, sn);              /* each head's last R dims */
    rope(s->kv + lat, 1, R, R, 0, cs, sn);            /* the one key shared by all heads */
    rms(s->kv, L->kv_a_norm, lat, L->latent_eps, s->kv);
    ds_cache_put(L, s->kv, kind, lat_store, kr_store, pos);
    /* q_lat[h] (lat) = W_UK[h]^T q_nope[h]: k_b holds, per head, lat rows of N columns */
    for (int64_t h = 0; h < H; h++) memcpy(s->qn + h * N, s->q + h * qk, sizeof(float) * (size_t)N);
    if (L->k_b.kind == 0) quant_rows(s->qn, H, N, q, 0); /* a vector per head, as below */
    for (int64_t h = 0; h < H; h++)
        t[h] = (task){&L->k_b, L->k_b.w + h * lat * L->k_b.row_bytes, lat, N, at(q, s->qn, h * N), s->qlat + h * lat};
    run_tasks(t, (int)H);
    const int64_t s_len = pos + 1;
    const float *lat_f, *kr_f;
    float *held;
    ds_cache_get(L, kind, lat_store, kr_store, s_len, &lat_f, &kr_f, &held);
#pragma omp parallel for schedule(dynamic, 1) if (H * s_len * lat > 65536)
    for (int64_t h = 0; h < H; h += 4)
        mla_heads((int)(H - h < 4 ? H - h : 4), s->qlat + h * lat, lat, s->q + h * qk + N, qk,
                  lat_f, kr_f, s_len, lat, R, L->scale, s->probs + h * s_len, s_len,
                  s->ctx + h * lat, lat);
    free(held);
    /* out[h] (V) = W_UV[h] ctx[h]: v_b holds, per head, V rows of lat columns */
    if (L->v_b.kind == 0) quant_rows(s->ctx, H, lat, q, 0);
    for (int64_t h = 0; h < H; h++)
        t[h] = (task){&L->v_b, L->v_b.w + h * V * L->v_b.row_bytes, V, lat, at(q, s->ctx, h * lat), s->vo + h * V};
    run_tasks(t, (int)H);
    if (L->o.kind == 0) quant(s->vo, H * V, q);
    t[0] = whole(&L->o, H * V, at(q, s->vo, 0), s->tmp);
    run_tasks(t, 1);
    for (int64_t i = 0; i < d; i++) x[i] += s->tmp[i];
}

/* Indices of the k largest of v[0..n) (skipping -inf), largest first, lower index on ties. */
static void top_k(const float *v, int64_t n, int64_t k, int64_t *ids) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        ids[j] = best;
    }
}

/* DeepSeek's grouped top-k for one token's router logits (E): expert ids (k, best first,
 * lower id on ties) and their weights. sigmoid (V3/K2): scores = sigmoid(logits), the bias
 * added only to choose (groups ranked by the sum of their two best), weights the unbiased
 * scores; softmax (V2): groups ranked by their best score. Then normalized to sum 1 (summed
 * in the order chosen) if norm, and times routed_scale. sc, ch: E floats of scratch each.
 * models/deepseek2.py:route calls it for a prefill's tokens: the same bits as a decode step. */
typedef struct {
    int64_t n_experts, n_used, n_groups, topk_groups, sigmoid, norm_topk;
    float routed_scale;
    const float *bias; /* or NULL */
} route_rule;

static void route_core(const route_rule *R, const float *logits, float *sc, float *ch,
                       int64_t *ids, float *wts) {
    const int64_t E = R->n_experts, k = R->n_used;
    if (R->sigmoid) {
        cs_sigmoid(logits, E, sc);
    } else {
        memcpy(sc, logits, sizeof(float) * (size_t)E);
        cs_softmax_rows(sc, 1, E);
    }
    for (int64_t e = 0; e < E; e++) ch[e] = sc[e] + (R->bias ? R->bias[e] : 0.0f);
    if (R->n_groups > 1 && R->topk_groups < R->n_groups) {
        const int64_t G = R->n_groups, per = E / G;
        float gs[256];
        int64_t keep[256];
        for (int64_t g = 0; g < G; g++) {
            const float *c = ch + g * per;
            if (R->sigmoid) { /* the sum of the group's two best */
                float b1 = -INFINITY, b2 = -INFINITY;
                for (int64_t i = 0; i < per; i++) {
                    if (c[i] > b1) { b2 = b1; b1 = c[i]; } else if (c[i] > b2) { b2 = c[i]; }
                }
                gs[g] = per > 1 ? b1 + b2 : b1;
            } else {
                float b = -INFINITY;
                for (int64_t i = 0; i < per; i++) b = c[i] > b ? c[i] : b;
                gs[g] = b;
            }
        }
        top_k(gs, G, R->topk_groups, keep);
        for (int64_t g = 0; g < G; g++) {
            int kept = 0;
            for (int64_t i = 0; i < R->topk_groups; i++) kept |= keep[i] == g;
            if (!kept) for (int64_t i = 0; i < per; i++) ch[g * per + i] = -INFINITY;
        }
    }
    top_k(ch, E, k, ids);
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) { wts[j] = sc[ids[j]]; sum += wts[j]; }
    for (int64_t j = 0; j < k; j++) {
        if (R->norm_topk) wts[j] = wts[j] / (sum + 1e-20f);
        wts[j] = wts[j] * R->routed_scale;
    }
}

/* route_core for t tokens' logits (t, E) -> ids (t, k), wts (t, k) */
void cs_route_rows(const route_rule *R, const float *logits, int64_t t, int64_t *ids, float *wts) {
    float *sc = (float *)malloc(sizeof(float) * (size_t)(2 * R->n_experts));
    for (int64_t i = 0; i < t; i++)
        route_core(R, logits + i * R->n_experts, sc, sc + R->n_experts, ids + i * R->n_used,
                   wts + i * R->n_used);
    free(sc);
}

static void route1(const ds_layer *L, ds_scratch *s, int64_t *ids, float *wts) {
    const route_rule R = {L->n_experts, L->n_used, L->n_groups, L->topk_groups, L->sigmoid,
                          L->norm_topk, L->routed_scale, L->router_bias};
    route_core(&R, s->logits, s->scores, s->choice, ids, wts);
}

/* h = rms(x, ffn_norm); for a MoE layer also the routing (ids, weights: n_used each). */
static void ds_route(const ds_layer *L, const float *x, ds_scratch *s, int64_t *ids, float *wts) {
    rms(x, L->ffn_norm, L->d, L->eps, s->h);
    if (!L->moe) return;
    quant(s->h, L->d, &s->q8);
    task t = whole(&L->router, L->d, at(&s->q8, s->h, 0), s->logits);
    run_tasks(&t, 1);
    route1(L, s, ids, wts);
}

/* x += the FFN of h (s->h, from ds_route): dense SwiGLU, or routed experts + shared experts.
 * The experts' gate and up rows run in one loop, then all their down rows in another. */
static void ds_ffn(const ds_layer *L, float *x, ds_scratch *s, const int64_t *ids,
                   const float *wts) {
    const int64_t d = L->d;
    const qbuf *q = &s->q8;
    if (!L->moe) {
        swiglu1(&L->gate, &L->up, &L->down, s->h, d, s->tmp, s->g, q);
        for (int64_t i = 0; i < d; i++) x[i] += s->tmp[i];
        return;
    }
    /* the selected held experts in ascending id: the order every layout adds them in */
    int64_t sel[64], n = 0;
    float w[64];
    for (int64_t e = 0; e < L->n_experts; e++) {
        for (int64_t j = 0; j < L->n_used; j++) {
            if (ids[j] == e && (!L->held || L->held[e])) { sel[n] = e; w[n] = wts[j]; n++; }
        }
    }
    const int64_t F = L->moe_ffn, shared = L->gate.w ? L->gate.rows : 0;
    mat g_m = L->gate_exps, u_m = L->up_exps, d_m = L->down_exps;
    quant(s->h, d, q);
    const actv ah = at(q, s->h, 0);
    task t[MAX_TASKS];
    int nt = 0;
    for (int64_t j = 0; j < n; j++) {
        t[nt++] = (task){&g_m, g_m.w + sel[j] * L->gate_stride, F, d, ah, s->g + j * F};
        t[nt++] = (task){&u_m, u_m.w + sel[j] * L->up_stride, F, d, ah, s->u + j * F};
    }
    const int64_t so = (n * F + 127) / 128 * 128; /* the shared expert's: on the quad grid */
    if (shared) {
        t[nt++] = whole(&L->gate, d, ah, s->g + so);
        t[nt++] = whole(&L->up, d, ah, s->u + so);
    }
    run_tasks(t, nt);
    for (int64_t j = 0; j < n; j++) silu_mul(s->g + j * F, s->u + j * F, F);
    if (shared) silu_mul(s->g + so, s->u + so, shared);
    nt = 0;
    /* each expert's hidden quantized alone, as ops.swiglu quantizes it for one expert */
    for (int64_t j = 0; j <= n; j++) {
        const int64_t cols = j < n ? F : shared, off = j < n ? j * F : so;
        const mat *m = j < n ? &d_m : &L->down;
        if (!cols) continue;
        if (m->kind == 0) {
            const qbuf part = {q->q + off, q->d + off / 32, q->s + off / 16, q->sum + off / 32,
                               q->t ? q->t + off : NULL, q->ol + off / 32, q->vid + off / 32};
            quant(s->g + off, cols, &part);
        }
        const uint8_t *base = j < n ? d_m.w + sel[j] * L->down_stride : L->down.w;
        t[nt++] = (task){m, base, d, cols, at(q, s->g, off), s->y + j * d};
    }
    run_tasks(t, nt);
    for (int64_t i = 0; i < d; i++) s->tmp[i] = 0.0f;
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < d; i++) s->tmp[i] += s->y[j * d + i] * w[j];
    if (shared)
        for (int64_t i = 0; i < d; i++) s->tmp[i] += s->y[n * d + i];
    for (int64_t i = 0; i < d; i++) x[i] += s->tmp[i];
}

void cs_ds_attention(const ds_layer *L, float *x, int64_t pos, const float *cs, const float *sn,
                     void *lat_store, void *kr_store, int64_t cap, int kv, float *f, int8_t *q8) {
    ds_scratch s = carve(L, cap, f, q8, 1);
    ds_attention(L, x, pos, cs, sn, lat_store, kr_store, kv, &s);
}

/* h (d) out; ids/weights only for a MoE layer. */
void cs_ds_route(const ds_layer *L, const float *x, float *h, int64_t *ids, float *wts,
                 float *f, int8_t *q8) {
    ds_scratch s = carve(L, 0, f, q8, 1);
    ds_route(L, x, &s, ids, wts);
    memcpy(h, s.h, sizeof(float) * (size_t)L->d);
}

void cs_ds_decode(const ds_layer *L, float *x, int64_t pos, const float *cs, const float *sn,
                  void *lat_store, void *kr_store, int64_t cap, int kv, float *f, int8_t *q8) {
    ds_scratch s = carve(L, cap, f, q8, 1);
    int64_t ids[64];
    float wts[64];
    ds_attention(L, x, pos, cs, sn, lat_store, kr_store, kv, &s);
    ds_route(L, x, &s, ids, wts);
    ds_ffn(L, x, &s, ids, wts);
}

/* Layers L[0..n) in turn, one call for a stage's stack (as cs_llama_decode_layers): lat[i] and
 * kr[i] are layer i's latent and RoPE key caches, all of capacity cap and kind kv (kv.c). */
void cs_ds_decode_layers(const ds_layer *const *L, int64_t n, float *x, int64_t pos,
                         const float *cs, const float *sn, void *const *lat, void *const *kr,
                         int64_t cap, int kv, float *f, int8_t *q8) {
    for (int64_t i = 0; i < n; i++)
        cs_ds_decode(L[i], x, pos, cs, sn, lat[i], kr[i], cap, kv, f, q8);
}

/* ---- n sequences at once: each weight row read once for all of them -------------------------
 * One token of each of n <= MAX_BATCH sequences (their own caches and positions). Matrices
 * other than the experts take the n rows as one batch; each routed expert takes the rows of
 * the tokens routed to it (grouped by expert), so an expert chosen by several sequences is
 * read from memory once. Attention stays per sequence and head. Every row is the one-row
 * arithmetic in the one-token order, so a sequence's result is the same bits batched or not:
 * batching may depend on timing, results must not. */

static task batch(const mat *m, const uint8_t *w, int64_t rows, int64_t cols, actv a, float *out,
                  int64_t nx, int64_t ld) {
    return (task){m, w, rows, cols, a, out, nx, ld};
}

static void ds_attention_many(const ds_layer *L, int64_t n, float *x, const int64_t *pos,
                              const float *cs, const float *sn, void *const *lat_st,
                              void *const *kr_st, int kind, ds_scratch *s) {
    const int64_t d = L->d, H = L->n_heads, N = L->nope, R = L->rope_dim, qk = N + R;
    const int64_t lat = L->kv_lora, V = L->v_dim, half = R / 2;
    const qbuf *q = &s->q8;
    for (int64_t i = 0; i < n; i++) rms(x + i * d, L->attn_norm, d, L->eps, s->h + i * d);
    quant_rows(s->h, n, d, q, 0);
    const actv ah = at(q, s->h, 0);
    task t[MAX_TASKS];
    if (L->q_a.w) {
        t[0] = batch(&L->q_a, L->q_a.w, L->q_a.rows, d, ah, s->qa, n, L->q_lora);
        t[1] = batch(&L->kv_a, L->kv_a.w, L->kv_a.rows, d, ah, s->kv, n, lat + R);
        run_tasks(t, 2);
        for (int64_t i = 0; i < n; i++)
            rms(s->qa + i * L->q_lora, L->q_a_norm, L->q_lora, L->latent_eps, s->qa + i * L->q_lora);
        if (L->q_b.kind == 0) quant_rows(s->qa, n, L->q_lora, q, 0);
        t[0] = batch(&L->q_b, L->q_b.w, L->q_b.rows, L->q_lora, at(q, s->qa, 0), s->q, n, H * qk);
        run_tasks(t, 1);
    } else {
        t[0] = batch(&L->q, L->q.w, L->q.rows, d, ah, s->q, n, H * qk);
        t[1] = batch(&L->kv_a, L->kv_a.w, L->kv_a.rows, d, ah, s->kv, n, lat + R);
        run_tasks(t, 2);
    }
    for (int64_t i = 0; i < n; i++) {
        float *qi = s->q + i * H * qk, *kv = s->kv + i * (lat + R);
        rope(qi + N, H, qk, R, 0, cs + i * half, sn + i * half);
        rope(kv + lat, 1, R, R, 0, cs + i * half, sn + i * half);
        rms(kv, L->kv_a_norm, lat, L->latent_eps, kv);
        ds_cache_put(L, kv, kind, lat_st[i], kr_st[i], pos[i]);
        for (int64_t h = 0; h < H; h++) /* qn: (H, n, N), a head's n rows together */
            memcpy(s->qn + (h * n + i) * N, qi + h * qk, sizeof(float) * (size_t)N);
    }
    if (L->k_b.kind == 0) quant_rows(s->qn, H * n, N, q, 0);
    for (int64_t h = 0; h < H; h++) /* qlat: (H, n, lat) */
        t[h] = batch(&L->k_b, L->k_b.w + h * lat * L->k_b.row_bytes, lat, N, at(q, s->qn, h * n * N),
                     s->qlat + h * n * lat, n, lat);
    run_tasks(t, (int)H);
    int64_t cap = 0;
    for (int64_t i = 0; i < n; i++) cap = pos[i] + 1 > cap ? pos[i] + 1 : cap;
    const float *lat_f[MAX_BATCH], *kr_f[MAX_BATCH];
    float *held[MAX_BATCH];
    for (int64_t i = 0; i < n; i++)
        ds_cache_get(L, kind, lat_st[i], kr_st[i], pos[i] + 1, &lat_f[i], &kr_f[i], &held[i]);
    const int64_t groups = (H + 3) / 4;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t gi = 0; gi < groups * n; gi++) { /* ctx: (H, n, lat); 4 heads of a sequence */
        const int64_t h = 4 * (gi / n), i = gi % n, hi = h * n + i;
        mla_heads((int)(H - h < 4 ? H - h : 4), s->qlat + hi * lat, n * lat,
                  s->q + i * H * qk + h * qk + N, qk, lat_f[i], kr_f[i], pos[i] + 1, lat, R,
                  L->scale, s->probs + hi * cap, n * cap, s->ctx + hi * lat, n * lat);
    }
    for (int64_t i = 0; i < n; i++) free(held[i]);
    if (L->v_b.kind == 0) quant_rows(s->ctx, H * n, lat, q, 0);
    for (int64_t h = 0; h < H; h++) /* vo: (n, H * V) */
        t[h] = batch(&L->v_b, L->v_b.w + h * V * L->v_b.row_bytes, V, lat, at(q, s->ctx, h * n * lat),
                     s->vo + h * V, n, H * V);
    run_tasks(t, (int)H);
    if (L->o.kind == 0) quant_rows(s->vo, n, H * V, q, 0);
    t[0] = batch(&L->o, L->o.w, L->o.rows, H * V, at(q, s->vo, 0), s->tmp, n, d);
    run_tasks(t, 1);
    for (int64_t i = 0; i < n * d; i++) x[i] += s->tmp[i];
}

static void ds_ffn_many(const ds_layer *L, int64_t n, float *x, ds_scratch *s) {
    const int64_t d = L->d, k = L->n_used, E = L->n_experts, F = L->moe_ffn;
    const qbuf *q = &s->q8;
    task t[MAX_TASKS];
    for (int64_t i = 0; i < n; i++) rms(x + i * d, L->ffn_norm, d, L->eps, s->h + i * d);
    if (!L->moe) {
        const int64_t ffn = L->gate.rows;
        quant_rows(s->h, n, d, q, 0);
        t[0] = batch(&L->gate, L->gate.w, ffn, d, at(q, s->h, 0), s->g, n, ffn);
        t[1] = batch(&L->up, L->up.w, ffn, d, at(q, s->h, 0), s->u, n, ffn);
        run_tasks(t, 2);
        for (int64_t i = 0; i < n; i++) silu_mul(s->g + i * ffn, s->u + i * ffn, ffn);
        if (L->down.kind == 0) quant_rows(s->g, n, ffn, q, 0);
        t[0] = batch(&L->down, L->down.w, d, ffn, at(q, s->g, 0), s->tmp, n, d);
        run_tasks(t, 1);
        for (int64_t i = 0; i < n * d; i++) x[i] += s->tmp[i];
        return;
    }
    /* route every token */
    int64_t ids[MAX_BATCH * 64];
    float wts[MAX_BATCH * 64];
    quant_rows(s->h, n, d, q, 0);
    t[0] = batch(&L->router, L->router.w, E, d, at(q, s->h, 0), s->logits, n, E);
    run_tasks(t, 1);
    for (int64_t i = 0; i < n; i++) {
        ds_scratch one = *s;
        one.logits = s->logits + i * E;
        one.scores = s->scores + i * E;
        one.choice = s->choice + i * E;
        route1(L, &one, ids + i * k, wts + i * k);
    }
    /* group by expert, ascending: rows of (token, weight) in expert order */
    int64_t row_tok[MAX_BATCH * 64], first[MAX_TASKS], count[MAX_TASKS], sel[MAX_TASKS];
    float row_w[MAX_BATCH * 64];
    int64_t rows = 0, ne = 0;
    for (int64_t e = 0; e < E; e++) {
        if (L->held && !L->held[e]) continue;
        const int64_t r0 = rows;
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < k; j++)
                if (ids[i * k + j] == e) { row_tok[rows] = i; row_w[rows] = wts[i * k + j]; rows++; }
        if (rows > r0) { sel[ne] = e; first[ne] = r0; count[ne] = rows - r0; ne++; }
    }
    const int64_t S = L->gate.w ? L->gate.rows : 0;
    float *hg = s->y; /* the gathered rows, then (after gate/up) the experts' outputs */
    for (int64_t r = 0; r < rows; r++) memcpy(hg + r * d, s->h + row_tok[r] * d, sizeof(float) * (size_t)d);
    memcpy(hg + rows * d, s->h, sizeof(float) * (size_t)(n * d)); /* the shared expert's */
    quant_rows(hg, rows + n, d, q, 0);
    int nt = 0;
    for (int64_t j = 0; j < ne; j++) {
        const actv a = at(q, hg, first[j] * d);
        t[nt++] = batch(&L->gate_exps, L->gate_exps.w + sel[j] * L->gate_stride, F, d, a, s->g + first[j] * F, count[j], F);
        t[nt++] = batch(&L->up_exps, L->up_exps.w + sel[j] * L->up_stride, F, d, a, s->u + first[j] * F, count[j], F);
    }
    const int64_t so = (rows * F + 127) / 128 * 128; /* the shared expert's: on the quad grid */
    float *gs = s->g + so, *us = s->u + so; /* the shared expert's hidden (n, S) */
    if (S) {
        t[nt++] = batch(&L->gate, L->gate.w, S, d, at(q, hg, rows * d), gs, n, S);
        t[nt++] = batch(&L->up, L->up.w, S, d, at(q, hg, rows * d), us, n, S);
    }
    run_tasks(t, nt);
    for (int64_t r = 0; r < rows; r++) silu_mul(s->g + r * F, s->u + r * F, F);
    for (int64_t i = 0; S && i < n; i++) silu_mul(gs + i * S, us + i * S, S);
    if (L->down_exps.kind == 0) quant_rows(s->g, rows, F, q, 0);
    if (S && L->down.kind == 0) quant_rows(gs, n, S, q, so);
    nt = 0;
    float *y = s->y, *ys = s->y + rows * d;
    for (int64_t j = 0; j < ne; j++)
        t[nt++] = batch(&L->down_exps, L->down_exps.w + sel[j] * L->down_stride, d, F,
                        at(q, s->g, first[j] * F), y + first[j] * d, count[j], d);
    if (S) t[nt++] = batch(&L->down, L->down.w, d, S, at(q, s->g, so), ys, n, d);
    run_tasks(t, nt);
    for (int64_t i = 0; i < n * d; i++) s->tmp[i] = 0.0f;
    for (int64_t r = 0; r < rows; r++) { /* per token, in ascending expert order */
        float *o = s->tmp + row_tok[r] * d;
        for (int64_t c = 0; c < d; c++) o[c] += y[r * d + c] * row_w[r];
    }
    for (int64_t i = 0; S && i < n * d; i++) s->tmp[i] += ys[i];
    for (int64_t i = 0; i < n * d; i++) x[i] += s->tmp[i];
}

/* x (n, d): one token of each of n sequences; pos (n); cs/sn (n, R/2); the caches' latent and
 * RoPE-key stores, one pointer per sequence; scratch for n (cs_ds_scratch_*(L, cap, n)). */
void cs_ds_decode_many(const ds_layer *L, int64_t n, float *x, const int64_t *pos,
                       const float *cs, const float *sn, void *const *lat_st,
                       void *const *kr_st, int64_t cap, int kv, float *f, int8_t *q8) {
    ds_scratch s = carve(L, cap, f, q8, n);
    ds_attention_many(L, n, x, pos, cs, sn, lat_st, kr_st, kv, &s);
    ds_ffn_many(L, n, x, &s);
}
