/* One llama-family layer for one token (models/llama.py), allocation-free.
 *
 * Included at the end of kernels.c, after deepseek.c, whose task runner it shares: the
 * products that read the same input run as one parallel loop over all their rows (Q, K and V;
 * gate and up), so a layer costs four thread fork/joins, not seven. Each row is computed
 * whole by one thread with the one-row kernel, so the result does not depend on threads.
 *
 * scratch floats: 3*d + (n_heads + 2*n_kv)*head_dim + 2*ffn + n_heads*(pos+1);
 * xq: 2 * the widest of d, n_heads*head_dim, ffn bytes (values, then their AVX-512 quad
 * layout); xd: 12 * widest/32 floats (scales, block sums, then the outliers and vector starts
 * of qbuf); xs: widest/16 ints. */
/* One token's q, k, v after their products: biases, QK-norm, RoPE at `pos`, then k and v
 * into the cache as its kind stores them (kv.c kv_put_key, kv_put) — keys component-major
 * (n_kv, hd, keys_ld(cap)) for f32/f16, values (n_kv, cap, hd). */
static void qkv_into_cache(const llama_layer *L, float *q, float *k, float *v, int64_t pos,
                           const float *cs, const float *sn, void *k_store, void *v_store,
                           int64_t cap, int kind) {
    const int64_t hd = L->head_dim, qn = L->n_heads * hd, kn = L->n_kv * hd;
    if (L->q_bias) for (int64_t i = 0; i < qn; i++) q[i] += L->q_bias[i];
    if (L->k_bias) for (int64_t i = 0; i < kn; i++) k[i] += L->k_bias[i];
    if (L->v_bias) for (int64_t i = 0; i < kn; i++) v[i] += L->v_bias[i];
    if (L->q_norm) {
        for (int64_t i = 0; i < L->n_heads; i++) rms(q + i * hd, L->q_norm, hd, L->eps, q + i * hd);
        for (int64_t i = 0; i < L->n_kv; i++) rms(k + i * hd, L->k_norm, hd, L->eps, k + i * hd);
    }
    rope(q, L->n_heads, hd, L->rope_dim, (int)L->rope_neox, cs, sn);
    rope(k, L->n_kv, hd, L->rope_dim, (int)L->rope_neox, cs, sn);
    for (int64_t i = 0; i < L->n_kv; i++) {
        kv_put_key(kind, k + i * hd, hd, k_store, i, cap, pos);
        kv_put(kind, v + i * hd, hd, v_store, i * cap + pos);
    }
}

void cs_llama_decode(const llama_layer *L, float *x, int64_t pos, const float *cs,
                     const float *sn, void *k_store, void *v_store, int64_t cap, int kv,
                     float *f, int8_t *xq, float *xd, int32_t *xs) {
    const int64_t d = L->d, hd = L->head_dim, qn = L->n_heads * hd, kn = L->n_kv * hd;
    int64_t widest = d > qn ? d : qn;
    widest = L->ffn > widest ? L->ffn : widest;
    float *h = f, *att = h + d, *q = att + qn, *k = q + qn, *v = k + kn, *g = v + kn;
    float *u = g + L->ffn, *tmp = u + L->ffn, *probs = tmp + d;
    outliers *ol = (outliers *)(xd + 2 * (widest / 32));
    const qbuf qb = {xq, xd, xs, xd + widest / 32, xq + widest, ol, (int32_t *)(ol + widest / 32)};
    rms(x, L->attn_norm, d, L->eps, h);
    quant(h, d, &qb);
    const actv ah = at(&qb, h, 0);
    task t[3] = {whole(&L->q, d, ah, q), whole(&L->k, d, ah, k), whole(&L->v, d, ah, v)};
    run_tasks(t, 3);
    qkv_into_cache(L, q, k, v, pos, cs, sn, k_store, v_store, cap, kv);
    (void)probs;
    attend1_kv(kv, q, k_store, v_store, L->n_heads, L->n_kv, cap, pos + 1, hd, L->scale, att);
    if (L->o.kind == 0) quant(att, qn, &qb);
    t[0] = whole(&L->o, qn, at(&qb, att, 0), tmp);
    run_tasks(t, 1);
    for (int64_t i = 0; i < d; i++) x[i] += tmp[i];
    rms(x, L->ffn_norm, d, L->eps, h);
    quant(h, d, &qb);
    t[0] = whole(&L->gate, d, at(&qb, h, 0), g);
    t[1] = whole(&L->up, d, at(&qb, h, 0), u);
    run_tasks(t, 2);
    silu_mul(g, u, L->ffn);
    if (L->down.kind == 0) quant(g, L->ffn, &qb);
    t[0] = whole(&L->down, L->ffn, at(&qb, g, 0), tmp);
    run_tasks(t, 1);
    for (int64_t i = 0; i < d; i++) x[i] += tmp[i];
}

/* Layers L[0..n) in turn, one call for a stage's whole stack (the Python around each layer's
 * call cost ~10-20 us: pointers fetched, the cache looked up); k_stores[i] / v_stores[i]:
 * layer i's cache, all of capacity cap and of kind kv (kv.c). */
void cs_llama_decode_layers(const llama_layer *const *L, int64_t n, float *x, int64_t pos,
                            const float *cs, const float *sn, void *const *k_stores,
                            void *const *v_stores, int64_t cap, int kv, float *f, int8_t *xq,
                            float *xd, int32_t *xs) {
    for (int64_t i = 0; i < n; i++)
        cs_llama_decode(L[i], x, pos, cs, sn, k_stores[i], v_stores[i], cap, kv, f, xq, xd, xs);
}

/* ---- one token of each of n sequences through a stack of layers (continuous batching) ----
 * The stage's ready sequences stepped together: each matrix reads its weight rows once for
 * the n tokens (the 16-row tiles, or each row kept in L1 for the one-row kernel), RMSNorm,
 * RoPE, the cache write and attention stay per sequence (its own cache, position and
 * capacity). Every value is what cs_llama_decode computes for that token alone — the same
 * functions per row, attention through attend_heads — so a sequence's bits do not depend on
 * which others share the step (tests/test_batch_decode.py). Scratch: cs_llama_scratch_*. */

static int64_t llama_widest(const llama_layer *L) {
    const int64_t qn = L->n_heads * L->head_dim;
    int64_t w = L->d > qn ? L->d : qn;
    return L->ffn > w ? L->ffn : w;
}

int64_t cs_llama_scratch_floats(const llama_layer *L, int64_t n) {
    const int64_t qn = L->n_heads * L->head_dim, kn = L->n_kv * L->head_dim;
    return n * (2 * L->d + 2 * qn + 2 * kn + 2 * L->ffn + llama_widest(L) / 32) + 64;
}

int64_t cs_llama_scratch_qbytes(const llama_layer *L, int64_t n) {
    const int64_t w = n * llama_widest(L);
    return 2 * w + 4 * (w / 32) + 4 * (w / 16) + (int64_t)(sizeof(outliers) + 4) * (w / 32) + 128;
}

/* attention of every sequence's heads in one parallel loop over (sequence, KV head) pairs:
 * the query heads that share a KV head together on one thread (attend_heads: its keys and
 * values read once for them; with (sequence, query head) pairs as units each query head's
 * read of them went to whichever thread was free, from memory again) */
static void attend_many(const llama_layer *L, int64_t n, const float *q, void *const *k_st,
                        void *const *v_st, const int64_t *caps, const int64_t *pos, int kv,
                        float *att) {
    const int64_t H = L->n_heads, hd = L->head_dim, KV = L->n_kv, g = H / KV;
    int64_t most = 0, work = 0;
    for (int64_t i = 0; i < n; i++) {
        most = pos[i] + 1 > most ? pos[i] + 1 : most;
        work += H * (pos[i] + 1) * hd;
    }
    const int use = gov_threads_for(work);
    const int64_t lp = keys_ld(most);
#pragma omp parallel num_threads(use) if (use > 1)
    {
        /* the scores, then (a cache not of f32) the KV head decoded: kv.c kv_head */
        float *p = (float *)malloc(sizeof(float) * (size_t)(4 * lp + kv_head_floats(kv, hd, hd, most)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < n * KV; j++) {
            const int64_t i = j / KV, kvh = j % KV, h = kvh * g;
            const kv_view c = kv_head(kv, k_st[i], v_st[i], kvh, caps[i], hd, hd, pos[i] + 1, p + 4 * lp);
            attend_heads(q + (i * H + h) * hd, g, c.kt, c.ld, c.v, pos[i] + 1, hd, hd, L->scale, p,
                         lp, att + (i * H + h) * hd);
        }
        free(p);
    }
}

/* silu(g) * u for each sequence's row, the rows over the threads from 4 sequences on (each
 * row is silu_mul's one call, the bits of a decode step alone): at 32 sequences it was 3%
 * of a step, on one thread while the other waited */
static void silu_mul_many(float *g, const float *u, int64_t n, int64_t ffn) {
    const int use = n >= 4 ? gov_threads() : 1;
#pragma omp parallel for num_threads(use) if (use > 1) schedule(static)
    for (int64_t i = 0; i < n; i++) silu_mul(g + i * ffn, u + i * ffn, ffn);
}

static void llama_decode_many(const llama_layer *L, int64_t n, float *x, const int64_t *pos,
                              const float *cs, const float *sn, void *const *k_st,
                              void *const *v_st, const int64_t *caps, int kv, float *f,
                              int8_t *q8) {
    const int64_t d = L->d, hd = L->head_dim, qn = L->n_heads * hd, kn = L->n_kv * hd;
    const int64_t ffn = L->ffn, w = n * llama_widest(L), half = L->rope_dim / 2;
    float *h = f, *tmp = h + n * d, *q = tmp + n * d, *att = q + n * qn, *k = att + n * qn;
    float *v = k + n * kn, *g = v + n * kn, *u = g + n * ffn, *sum = u + n * ffn;
    qbuf qb = {q8, NULL, NULL, sum, NULL, NULL, NULL};
    qb.d = (float *)(((uintptr_t)(q8 + 2 * w) + 15) & ~(uintptr_t)15);
    qb.s = (int32_t *)(qb.d + w / 32);
    qb.ol = (outliers *)(qb.s + w / 16);
    qb.vid = (int32_t *)(qb.ol + w / 32);
    for (int64_t i = 0; i < n; i++) rms(x + i * d, L->attn_norm, d, L->eps, h + i * d);
    quant_rows(h, n, d, &qb, 0);
    const actv ah = at(&qb, h, 0);
    task t[3] = {batch(&L->q, L->q.w, L->q.rows, d, ah, q, n, qn),
                 batch(&L->k, L->k.w, L->k.rows, d, ah, k, n, kn),
                 batch(&L->v, L->v.w, L->v.rows, d, ah, v, n, kn)};
    run_tasks(t, 3);
    for (int64_t s = 0; s < n; s++)
        qkv_into_cache(L, q + s * qn, k + s * kn, v + s * kn, pos[s], cs + s * half, sn + s * half,
                       k_st[s], v_st[s], caps[s], kv);
    attend_many(L, n, q, k_st, v_st, caps, pos, kv, att);
    if (L->o.kind == 0) quant_rows(att, n, qn, &qb, 0);
    t[0] = batch(&L->o, L->o.w, L->o.rows, qn, at(&qb, att, 0), tmp, n, d);
    run_tasks(t, 1);
    for (int64_t i = 0; i < n * d; i++) x[i] += tmp[i];
    for (int64_t i = 0; i < n; i++) rms(x + i * d, L->ffn_norm, d, L->eps, h + i * d);
    quant_rows(h, n, d, &qb, 0);
    t[0] = batch(&L->gate, L->gate.w, ffn, d, at(&qb, h, 0), g, n, ffn);
    t[1] = batch(&L->up, L->up.w, ffn, d, at(&qb, h, 0), u, n, ffn);
    run_tasks(t, 2);
    silu_mul_many(g, u, n, ffn);
    if (L->down.kind == 0) quant_rows(g, n, ffn, &qb, 0);
    t[0] = batch(&L->down, L->down.w, d, ffn, at(&qb, g, 0), tmp, n, d);
    run_tasks(t, 1);
    for (int64_t i = 0; i < n * d; i++) x[i] += tmp[i];
}

/* x (n, d): one token of each of n <= MAX_BATCH sequences through layers L[0..m); pos (n);
 * cs/sn (n, rope_dim / 2); k_st / v_st: m * n pointers, layer-major (layer i, sequence s at
 * i * n + s); caps (n): each sequence's cache capacity; kv: the caches' kind (kv.c), one
 * for all. */
void cs_llama_decode_many(const llama_layer *const *L, int64_t m, int64_t n, float *x,
                          const int64_t *pos, const float *cs, const float *sn,
                          void *const *k_st, void *const *v_st, const int64_t *caps, int kv,
                          float *f, int8_t *q8) {
    for (int64_t i = 0; i < m; i++)
        llama_decode_many(L[i], n, x, pos, cs, sn, k_st + i * n, v_st + i * n, caps, kv, f, q8);
}
