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
void cs_llama_decode(const llama_layer *L, float *x, int64_t pos, const float *cs,
                     const float *sn, float *k_store, float *v_store, int64_t cap, float *f,
                     int8_t *xq, float *xd, int32_t *xs) {
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
    if (L->q_bias) for (int64_t i = 0; i < qn; i++) q[i] += L->q_bias[i];
    if (L->k_bias) for (int64_t i = 0; i < kn; i++) k[i] += L->k_bias[i];
    if (L->v_bias) for (int64_t i = 0; i < kn; i++) v[i] += L->v_bias[i];
    if (L->q_norm) {
        for (int64_t i = 0; i < L->n_heads; i++) rms(q + i * hd, L->q_norm, hd, L->eps, q + i * hd);
        for (int64_t i = 0; i < L->n_kv; i++) rms(k + i * hd, L->k_norm, hd, L->eps, k + i * hd);
    }
    rope(q, L->n_heads, hd, L->rope_dim, (int)L->rope_neox, cs, sn);
    rope(k, L->n_kv, hd, L->rope_dim, (int)L->rope_neox, cs, sn);
    /* the cache: keys component-major (n_kv, hd, keys_ld(cap)), values (n_kv, cap, hd) */
    const int64_t ldk = keys_ld(cap);
    for (int64_t i = 0; i < L->n_kv; i++) {
        for (int64_t j = 0; j < hd; j++) k_store[(i * hd + j) * ldk + pos] = k[i * hd + j];
        memcpy(v_store + (i * cap + pos) * hd, v + i * hd, sizeof(float) * (size_t)hd);
    }
    (void)probs;
    attend1(q, k_store, v_store, L->n_heads, L->n_kv, cap, pos + 1, hd, L->scale, att);
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
 * layer i's cache, all of capacity cap. */
void cs_llama_decode_layers(const llama_layer *const *L, int64_t n, float *x, int64_t pos,
                            const float *cs, const float *sn, float *const *k_stores,
                            float *const *v_stores, int64_t cap, float *f, int8_t *xq, float *xd,
                            int32_t *xs) {
    for (int64_t i = 0; i < n; i++)
        cs_llama_decode(L[i], x, pos, cs, sn, k_stores[i], v_stores[i], cap, f, xq, xd, xs);
}
