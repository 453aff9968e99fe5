/* ---- the KV cache's storage: f32, f16 or q8_0 (models/kv_cache.py, cache_types.py) ---------
 * Included by kernels.c before the fused layers (deepseek.c, llama.c), which write the cache
 * here and read it back here. A cached vector (a head's key or value, a latent, a RoPE key)
 * is stored as f32, f16, or Q8_0 blocks of 32 values (an f16 scale d, 32 int8 q): the kinds
 * are GGUF's type numbers. Why these functions, and not F16C or a libm round:
 * - writing rounds in integer arithmetic exactly as numpy does (astype(np.float16): to
 *   nearest even, subnormals, overflow to infinity, a NaN's payload kept as numpy keeps it;
 *   F16C's vcvtps2ph quiets a signalling NaN, numpy does not) and as quant/formats.py's Q8_0
 *   codec (bit-exact with gguf-py), so the Python path, which writes with numpy, and the
 *   fused layers write the same bytes on every CPU;
 * - reading is exact: an f16 is a float, and d * q is one rounding, the same everywhere.
 * Attention then runs on f32 (attend_heads, mla_heads) as for an f32 cache: a non-f32 head's
 * [0, seen) is decoded into the thread's buffer first, so a cache type gives the same bits on
 * every instruction set, thread count and batch. The NaN bits of a q8_0 block with a NaN in
 * it are not promised (its scale is NaN, so all 32 values read back as NaN anyway). */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8_0 = 8 };

/* numpy's npy_floatbits_to_halfbits (round to nearest even), line for line */
static inline uint16_t f32_to_f16(float x) {
    uint32_t f;
    memcpy(&f, &x, 4);
    const uint16_t sign = (uint16_t)((f & 0x80000000u) >> 16);
    uint32_t e = f & 0x7F800000u, m = f & 0x007FFFFFu;
    if (e >= 0x47800000u) { /* overflow, infinity or NaN */
        if (e == 0x7F800000u && m) {
            uint16_t r = (uint16_t)(0x7C00u + (m >> 13));
            return (uint16_t)(sign + (r == 0x7C00u ? r + 1 : r)); /* stays a NaN */
        }
        return (uint16_t)(sign + 0x7C00u);
    }
    if (e <= 0x38000000u) { /* a subnormal half, or zero */
        if (e < 0x33000000u) return sign;
        e >>= 23;
        m = (0x00800000u + m) >> (113 - e);
        if ((m & 0x3FFFu) != 0x1000u || (f & 0x7FFu)) m += 0x1000u;
        return (uint16_t)(sign + (m >> 13)); /* a carry into the exponent is right */
    }
    const uint16_t he = (uint16_t)((e - 0x38000000u) >> 13);
    if ((m & 0x3FFFu) != 0x1000u) m += 0x1000u;
    return (uint16_t)(sign + he + (m >> 13)); /* a carry may make it infinity: right */
}

typedef uint16_t v16h __attribute__((vector_size(32)));

/* 16 halves to floats, exactly, in lane-wise integer arithmetic (the same on every target):
 * normal and infinite/NaN halves by rebiasing the exponent, subnormals as m * 2^-24 (an exact
 * float product: the result is a normal float, so flush-to-zero CPUs agree) */
static inline v16f f16x16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u);
    const v16u sign = (u & 0x8000u) << 16, em = u & 0x7FFFu;
    const v16u big = (v16u)(em >= 0x7C00u), small = (v16u)(em < 0x0400u);
    const v16u norm = (em << 13) + 0x38000000u + (big & 0x38000000u);
    const v16u sub = (v16u)(__builtin_convertvector((v16i)em, v16f) * 0x1p-24f);
    return (v16f)(sign | (small & sub) | (~small & norm));
}

/* n halves to floats (n >= 0; the tail one at a time, as fp16_to_f32: the same values) */
static void f16_row(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16f v = f16x16(src + i);
        memcpy(dst + i, &v, sizeof v);
    }
    for (; i < n; i++) dst[i] = fp16_to_f32(src[i]);
}

/* round to nearest, ties away from zero, of |v| < 128.5, exactly (formats._round_half_away:
 * the fraction of a float is exact, so comparing it with 0.5 is); a NaN gives 0 */
static inline int8_t round_away(float v) {
    const float a = v < 0.0f ? -v : v;
    if (!(a < 128.0f)) return 0;
    int32_t w = (int32_t)a;
    w += a - (float)w >= 0.5f;
    return (int8_t)(v < 0.0f ? -w : w);
}

/* 32 values to one Q8_0 block, as formats.Q8_0Format.quantize_blocks: d = max|x| / 127 in
 * float, q = round(x * (1 / d)) with the float reciprocal (not the f16 d, as ggml), d stored
 * as f16, little-endian on every CPU (the bytes are GGUF's) */
static void q8_0_block(const float *x, uint8_t *b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float a = x[j] < 0.0f ? -x[j] : x[j];
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t h = f32_to_f16(d);
    b[0] = (uint8_t)(h & 0xFF);
    b[1] = (uint8_t)(h >> 8);
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)round_away(x[j] * id);
}

/* a Q8_0 row of n values back: d * q, one rounding */
static void q8_0_row(const uint8_t *b, int64_t n, float *dst) {
    for (int64_t k = 0; k < n / 32; k++, b += 34) {
        const float d = fp16_to_f32(rd16(b));
        for (int j = 0; j < 32; j++) dst[k * 32 + j] = d * (float)(int8_t)b[2 + j];
    }
}

static inline int64_t kv_row_bytes(int kind, int64_t n) {
    return kind == KV_F32 ? 4 * n : kind == KV_F16 ? 2 * n : n / 32 * 34;
}

/* one vector of n values into row `row` of a token-major store (rows kv_row_bytes apart) */
static void kv_put(int kind, const float *x, int64_t n, void *store, int64_t row) {
    uint8_t *dst = (uint8_t *)store + row * kv_row_bytes(kind, n);
    if (kind == KV_F32) {
        memcpy(dst, x, sizeof(float) * (size_t)n);
    } else if (kind == KV_F16) {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_f16(x[i]);
    } else {
        for (int64_t k = 0; k < n / 32; k++) q8_0_block(x + k * 32, dst + k * 34);
    }
}

/* rows [0, rows) of n values of a token-major store, as floats into dst (rows, n) */
static void kv_get(int kind, const void *store, int64_t n, int64_t rows, float *dst) {
    if (kind == KV_F32) {
        memcpy(dst, store, sizeof(float) * (size_t)(rows * n));
    } else if (kind == KV_F16) {
        f16_row((const uint16_t *)store, rows * n, dst);
    } else {
        for (int64_t t = 0; t < rows; t++)
            q8_0_row((const uint8_t *)store + t * kv_row_bytes(kind, n), n, dst + t * n);
    }
}

/* a KV head's keys: f32 and f16 component-major (n_kv, d, keys_ld(cap)), element `pos` of
 * each of the d rows; q8_0 token-major (n_kv, cap, d / 32 blocks), one row */
static void kv_put_key(int kind, const float *k, int64_t d, void *store, int64_t kvh, int64_t cap,
                       int64_t pos) {
    const int64_t ld = keys_ld(cap);
    if (kind == KV_F32) {
        for (int64_t j = 0; j < d; j++) ((float *)store)[(kvh * d + j) * ld + pos] = k[j];
    } else if (kind == KV_F16) {
        for (int64_t j = 0; j < d; j++) ((uint16_t *)store)[(kvh * d + j) * ld + pos] = f32_to_f16(k[j]);
    } else {
        kv_put(kind, k, d, store, kvh * cap + pos);
    }
}

/* What attend_heads reads of KV head kvh over [0, seen): keys (d, ld) component-major and
 * values (seen, dv) rows, as floats. An f32 cache's own storage; any other decoded into buf
 * (d * keys_ld(seen) + seen * dv floats: kv_head_floats), the keys' tail past `seen` zeroed
 * (attention reads whole vectors of 16 keys). */
typedef struct {
    const float *kt, *v;
    int64_t ld;
} kv_view;

static inline int64_t kv_head_floats(int kind, int64_t d, int64_t dv, int64_t seen) {
    return kind == KV_F32 ? 0 : d * keys_ld(seen) + seen * dv;
}

static kv_view kv_head(int kind, const void *kt, const void *v, int64_t kvh, int64_t cap,
                       int64_t d, int64_t dv, int64_t seen, float *buf) {
    const int64_t ld = keys_ld(cap);
    if (kind == KV_F32)
        return (kv_view){(const float *)kt + kvh * d * ld, (const float *)v + kvh * cap * dv, ld};
    const int64_t lp = keys_ld(seen);
    float *keys = buf, *vals = buf + d * lp;
    if (kind == KV_F16) {
        for (int64_t j = 0; j < d; j++)
            f16_row((const uint16_t *)kt + (kvh * d + j) * ld, seen, keys + j * lp);
    } else {
        float row[32];
        for (int64_t t = 0; t < seen; t++)
            for (int64_t c = 0; c < d; c += 32) {
                q8_0_row((const uint8_t *)kt + (kvh * cap + t) * kv_row_bytes(kind, d) + c / 32 * 34, 32, row);
                for (int j = 0; j < 32; j++) keys[(c + j) * lp + t] = row[j];
            }
    }
    for (int64_t j = 0; j < d; j++) memset(keys + j * lp + seen, 0, sizeof(float) * (size_t)(lp - seen));
    kv_get(kind, (const uint8_t *)v + kvh * cap * kv_row_bytes(kind, dv), dv, seen, vals);
    return (kv_view){keys, vals, lp};
}

/* rows [0, rows) of a token-major store as floats: the store itself for f32, else decoded
 * into buf (rows * n floats) */
static const float *kv_rows(int kind, const void *store, int64_t n, int64_t rows, float *buf) {
    if (kind == KV_F32) return (const float *)store;
    kv_get(kind, store, n, rows, buf);
    return buf;
}

/* for tests and the same-bits harness: n values (rows of `width`) to a cache type's bytes
 * and back, through the functions the fused layers use */
void cs_kv_encode(int kind, const float *x, int64_t rows, int64_t width, void *out) {
    for (int64_t r = 0; r < rows; r++) kv_put(kind, x + r * width, width, out, r);
}

void cs_kv_decode(int kind, const void *stored, int64_t rows, int64_t width, float *out) {
    kv_get(kind, stored, width, rows, out);
}

/* One new token's q (n_heads, d) against the s_len cached tokens of a cache of any kind:
 * attend1's loop over KV heads, each head decoded by kv_head first (f32: attend1 itself) */
static void attend1_kv(int kind, const float *q, const void *kt, const void *v, int64_t n_heads,
                       int64_t n_kv, int64_t cap, int64_t s_len, int64_t d, float scale,
                       float *out) {
    if (kind == KV_F32) {
        attend1(q, (const float *)kt, (const float *)v, n_heads, n_kv, cap, s_len, d, scale, out);
        return;
    }
    const int64_t g = n_heads / n_kv, lp = keys_ld(s_len);
    const int use = gov_threads_for(n_heads * s_len * d);
#pragma omp parallel num_threads(use) if (use > 1)
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(4 * lp + kv_head_floats(kind, d, d, s_len)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t kvh = 0; kvh < n_kv; kvh++) {
            const kv_view h = kv_head(kind, kt, v, kvh, cap, d, d, s_len, p + 4 * lp);
            attend_heads(q + kvh * g * d, g, h.kt, h.ld, h.v, s_len, d, d, scale, p, lp,
                         out + kvh * g * d);
        }
        free(p);
    }
}
