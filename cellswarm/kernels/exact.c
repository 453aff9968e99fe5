/* ---- one arithmetic on every CPU ----------------------------------------------------------
 * Included by kernels.c. Every float that reaches a token is computed here in one fixed order
 * of IEEE operations, so a result is a function of the weights and the input alone: not of
 * the instruction set (AVX-512, AVX2, SSE2, NEON, AltiVec, none), the thread count, the batch
 * or which sequences share it. Why: a request recovered on another node must give the same
 * text, and --verify quorum can only tell an honest node from a broken one if honest nodes
 * agree to the bit (issue 32).
 *
 * The rules, kept by every function below:
 * - Integer parts are exact (int8 products summed in int32), so they may be computed in any
 *   order, by any instructions: that is where the SIMD paths differ (dot32 / dot16).
 * - A float reduction of n terms t_u goes into 16 accumulators, A[u % 16] = A[u % 16] + t_u in
 *   order of u, then one tree: A[l] + A[l + 8], then + 4, + 2, + 1 (fold16). A v16f holds the
 *   16 accumulators: gcc lowers it to one AVX-512 register, two AVX2 or four SSE/NEON/VMX
 *   registers, or 16 scalars, with the same lane-wise operations on every target.
 * - No fused multiply-add: kernels are built with -ffp-contract=off, so a * b + c is two
 *   roundings everywhere (an FMA on one path and not another would change the last bits).
 * - No libm and no fast-math: exp is exp16 (kernels.c), sqrt and division are IEEE
 *   correctly rounded everywhere.
 *
 * Quantized rows go by units: a block of 32 weights (Q8_0, Q4_0, Q4_1), a sub-block of 32 with
 * its own scale (Q4_K), or a group of 16 (Q6_K, Q2_K). A unit's weights are ws * q - wm with q
 * small integers, so against activations x = xd * xq (int8 blocks of 32, cs_quantize_act):
 *
 *     t_u = (float)n_u * (ws_u * xd_u) - wm_u * xsum_u,   n_u = sum q xq exactly
 *
 * (xsum_u = xd_u * (float)sum xq over the unit), and the row is fold16 of A[u % 16] += t_u,
 * then + the outliers' float products (plan_row) when the activations had outliers. Float
 * weights (F32, F16, BF16) are the same reduction over columns: t_i = w_i * x_i. */

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v16c __attribute__((vector_size(16)));
typedef uint8_t v16uc __attribute__((vector_size(16)));

typedef struct {
    const int8_t *xq; const float *xd; const int32_t *xs; int64_t cols; int64_t nx;
    const float *xsum; /* per 32 block: xd * sum(xq), the float sum of the block */
    /* per 16 values (units of 16: Q6_K, Q2_K, ...): their block's xd, and xd * sum(xq) over
     * them; made once per matmul (matmul_q) instead of once per weight row; NULL: per row */
    const float *xd16, *xsum16;
} acts;

static inline v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the fixed tree over 16 accumulators */
static inline float fold16(v16f acc) {
    float a[16];
    memcpy(a, &acc, sizeof a);
    for (int l = 0; l < 8; l++) a[l] += a[l + 8];
    for (int l = 0; l < 4; l++) a[l] += a[l + 4];
    a[0] += a[2];
    a[1] += a[3];
    return a[0] + a[1];
}

/* ---- exact integer dot products of a unit (any instructions: integers) ------------------ */

#if defined(__AVX2__)
#include <immintrin.h>
/* |a| (unsigned) times b with a's sign: products <= 128 * 127, pairs < 2^15: no saturation */
static inline __m256i dot_s8_256(__m256i a, __m256i b) {
    const __m256i ua = _mm256_sign_epi8(a, a), sb = _mm256_sign_epi8(b, a);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ua, sb);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1));
#endif
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* n[l] = q[l] . x[32 l ..] for 16 units of 32: 8 at a time, reduced across lanes together */
static inline void dots32(const int8_t (*q)[32], const int8_t *x, int32_t *n) {
    for (int l0 = 0; l0 < 16; l0 += 8) {
        __m256i d[8];
        for (int l = 0; l < 8; l++)
            d[l] = dot_s8_256(_mm256_loadu_si256((const __m256i *)q[l0 + l]),
                              _mm256_loadu_si256((const __m256i *)(x + 32 * (l0 + l))));
        const __m256i h01 = _mm256_hadd_epi32(d[0], d[1]), h23 = _mm256_hadd_epi32(d[2], d[3]);
        const __m256i h45 = _mm256_hadd_epi32(d[4], d[5]), h67 = _mm256_hadd_epi32(d[6], d[7]);
        const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
        const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                                           _mm256_permute2x128_si256(a, b, 0x31));
        _mm256_storeu_si256((__m256i *)(n + l0), s);
    }
}

/* the 8 int32 sums of 8 vectors of 8 lanes, in order */
static inline __m256i sums8(const __m256i *d) {
    const __m256i h01 = _mm256_hadd_epi32(d[0], d[1]), h23 = _mm256_hadd_epi32(d[2], d[3]);
    const __m256i h45 = _mm256_hadd_epi32(d[4], d[5]), h67 = _mm256_hadd_epi32(d[6], d[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* unsigned bytes (< 128) times signed bytes, summed by 4 into 8 int32 lanes */
static inline __m256i dot_u8_256(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#define HAVE_PACKED32 1
/* n[l] = the exact sum q . x of units u0 + l (l < nn <= 16) of a row of 32-blocks (Q8_0, Q4_0,
 * Q4_1) straight from its packed bytes (0 past nn); x at unit u0, xs its 16-value sums. */
static inline void dots_packed32(int fmt, const uint8_t *row, int64_t u0, int nn, const int8_t *x,
                                 const int32_t *xs, __m256i *n) {
    const int bb = fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20, hdr = fmt == Q4_1 ? 4 : 2;
    const __m256i lo = _mm256_set1_epi8(0x0F);
    for (int l0 = 0; l0 < 16; l0 += 8) {
        __m256i d[8];
        for (int l = 0; l < 8; l++) {
            if (l0 + l >= nn) { d[l] = _mm256_setzero_si256(); continue; }
            const int64_t u = u0 + l0 + l;
            const uint8_t *q = row + u * bb + hdr;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * (l0 + l)));
            if (fmt == Q8_0) {
                d[l] = dot_s8_256(_mm256_loadu_si256((const __m256i *)q), xv);
            } else if (fmt == Q4_K) { /* sub-block u % 8: 32 nibbles, low or high, 0..15 */
                const __m256i b = _mm256_loadu_si256((const __m256i *)(row + 144 * (u / 8) + 16 + 32 * ((u % 8) / 2)));
                d[l] = dot_u8_256(_mm256_and_si256(u & 1 ? _mm256_srli_epi16(b, 4) : b, lo), xv);
            } else {
                const __m128i t = _mm_loadu_si128((const __m128i *)q);
                const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), lo);
                d[l] = dot_u8_256(u, xv);
            }
        }
        __m256i s = sums8(d);
        if (fmt == Q4_0) { /* q = u - 8: minus 8 times each unit's activation sum */
            __m256i pairs;
            if (l0 + 8 <= nn) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(xs + 2 * l0));
                const __m256i b = _mm256_loadu_si256((const __m256i *)(xs + 2 * l0 + 8));
                pairs = _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8);
            } else { /* lanes past nn: anything (their scales are 0, see exact_row_q) */
                int32_t t[8] = {0};
                for (int l = l0; l < nn; l++) t[l - l0] = xs[2 * l] + xs[2 * l + 1];
                pairs = _mm256_loadu_si256((const __m256i *)t);
            }
            s = _mm256_sub_epi32(s, _mm256_slli_epi32(pairs, 3));
        }
        n[l0 / 8] = s;
    }
}

static inline void dots16(const int8_t *q, const int8_t *x, int32_t *n) {
    for (int l0 = 0; l0 < 16; l0 += 8) {
        __m256i d[4];
        for (int l = 0; l < 4; l++) /* two units of 16 per register: 32 values of both */
            d[l] = dot_s8_256(_mm256_loadu_si256((const __m256i *)(q + 16 * (l0 + 2 * l))),
                              _mm256_loadu_si256((const __m256i *)(x + 16 * (l0 + 2 * l))));
        /* lanes 0-3 of d[l]: unit 2l, lanes 4-7: unit 2l + 1 */
        const __m256i h01 = _mm256_hadd_epi32(d[0], d[1]), h23 = _mm256_hadd_epi32(d[2], d[3]);
        const __m256i a = _mm256_hadd_epi32(h01, h23); /* lo: units 0,2,4,6 · hi: 1,3,5,7 */
        int32_t t[8];
        _mm256_storeu_si256((__m256i *)t, a);
        for (int l = 0; l < 4; l++) { n[l0 + 2 * l] = t[l]; n[l0 + 2 * l + 1] = t[4 + l]; }
    }
}
#else
static inline void dots32(const int8_t (*q)[32], const int8_t *x, int32_t *n) {
    for (int l = 0; l < 16; l++) {
        int32_t s = 0;
        for (int i = 0; i < 32; i++) s += (int32_t)q[l][i] * (int32_t)x[32 * l + i];
        n[l] = s;
    }
}

static inline void dots16(const int8_t *q, const int8_t *x, int32_t *n) {
    for (int l = 0; l < 16; l++) {
        int32_t s = 0;
        for (int i = 0; i < 16; i++) s += (int32_t)q[16 * l + i] * (int32_t)x[16 * l + i];
        n[l] = s;
    }
}
#endif

/* ---- 16 units of a row: integer weights, scale and min ---------------------------------- */

/* Units u0 .. u0 + 15 of a row (those at or past nu: zeros): q (len values each), ws, wm. */
typedef struct { int8_t q[16][32]; v16f ws, wm; } units; /* len-16 units: q flat, 16 apart */

/* A format's unit: 16 where its scales are per 16 weights, else 32. Part of the arithmetic
 * (a unit is one term of the reduction), so fixed per format on every path. */
static inline int unit_len(int fmt) {
    switch (fmt) {
    case Q6_K: case Q2_K: case Q3_K: case IQ2_XS: case IQ2_S: case IQ1_M: case NVFP4: return 16;
    default: return 32;
    }
}

/* the f16 at byte `off` of blocks u0 .. u0 + 15 (bb bytes apart; zeros past nn), as floats:
 * exact conversions, F16C or not */
static inline void f16s(const uint8_t *row, int64_t u0, int nn, int bb, int off, float *out) {
#if defined(__AVX512F__)
    /* one gather of the 16 blocks' words (a block is >= 18 bytes: the 4 read are inside it;
     * x86 is little-endian: the f16 is the low half), one conversion, one 64-byte store (a
     * store of another width than the load after it would stall) */
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(bb));
    const __mmask16 m = (__mmask16)(nn >= 16 ? 0xFFFF : (1u << nn) - 1);
    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, row + u0 * bb + off, 1);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
#elif defined(__F16C__)
    /* the 16 words gathered by hand, then converted 8 at a time (not one by one) */
    uint16_t h[16];
    for (int l = 0; l < 16; l++) h[l] = l < nn ? rd16(row + (u0 + l) * bb + off) : 0;
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
    _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))));
#else
    for (int l = 0; l < 16; l++) out[l] = l < nn ? fp16_to_f32(rd16(row + (u0 + l) * bb + off)) : 0.0f;
#endif
}

/* ws, wm of units u0 .. u0 + 15 of a row of 32-blocks (zeros past nn), the weights left packed */
static inline void scales_32(int fmt, const uint8_t *row, int64_t u0, int nn, units *o) {
    const int bb = fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20;
    f16s(row, u0, nn, bb, 0, (float *)&o->ws);
    if (fmt == Q4_1) {
        f16s(row, u0, nn, bb, 2, (float *)&o->wm);
        o->wm = -o->wm; /* w = d q + m */
    } else {
        o->wm = (v16f){0};
    }
}

static void units_32(int fmt, const uint8_t *row, int64_t u0, int64_t nu, units *o) {
    const int64_t bb = fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20;
    for (int l = 0; l < 16; l++) {
        const int64_t u = u0 + l;
        if (u >= nu) { memset(o->q[l], 0, 32); o->ws[l] = o->wm[l] = 0.0f; continue; }
        const uint8_t *b = row + u * bb;
        o->ws[l] = fp16_to_f32(rd16(b));
        if (fmt == Q8_0) {
            memcpy(o->q[l], b + 2, 32);
            o->wm[l] = 0.0f;
            continue;
        }
        const uint8_t *qs = b + (fmt == Q4_1 ? 4 : 2);
        const int off = fmt == Q4_1 ? 0 : 8;
        for (int j = 0; j < 16; j++) {
            o->q[l][j] = (int8_t)((qs[j] & 0xF) - off);
            o->q[l][j + 16] = (int8_t)((qs[j] >> 4) - off);
        }
        o->wm[l] = fmt == Q4_1 ? -fp16_to_f32(rd16(b + 2)) : 0.0f; /* Q4_1: w = d q + m */
    }
}

/* ws, wm of units u0 .. u0 + 15 of a Q4_K row (two blocks; zeros past nu), weights left packed */
static inline void scales_q4_k(const uint8_t *row, int64_t u0, int64_t nu, units *o) {
    float ws[16], wm[16];
    for (int h = 0; h < 2; h++) {
        const int64_t u = u0 + 8 * h;
        const uint8_t *b = row + 144 * (u / 8);
        const float d = u < nu ? fp16_to_f32(rd16(b)) : 0.0f, dmin = u < nu ? fp16_to_f32(rd16(b + 2)) : 0.0f;
        for (int j = 0; j < 8; j++) {
            uint8_t sc = 0, m = 0;
            if (u < nu) k4_scale_min(j, b + 4, &sc, &m);
            ws[8 * h + j] = d * (float)sc;
            wm[8 * h + j] = dmin * (float)m;
        }
    }
    memcpy(&o->ws, ws, sizeof ws);
    memcpy(&o->wm, wm, sizeof wm);
}

static void units_q4_k(const uint8_t *row, int64_t u0, int64_t nu, units *o) {
    for (int h = 0; h < 2; h++) { /* two blocks of 8 sub-blocks */
        const int64_t u = u0 + 8 * h;
        if (u >= nu) {
            memset(o->q[8 * h], 0, 8 * 32);
            for (int j = 0; j < 8; j++) o->ws[8 * h + j] = o->wm[8 * h + j] = 0.0f;
            continue;
        }
        const uint8_t *b = row + 144 * (u / 8);
        const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = b + 16 + 32 * (j / 2);
            int8_t *q = o->q[8 * h + j];
            for (int l = 0; l < 32; l++) q[l] = (int8_t)(j & 1 ? qs[l] >> 4 : qs[l] & 0xF);
            uint8_t sc, m;
            k4_scale_min(j, b + 4, &sc, &m);
            o->ws[8 * h + j] = d * (float)sc;
            o->wm[8 * h + j] = dmin * (float)m;
        }
    }
}

/* the 16 groups of one 256-block (Q6_K, Q2_K): values flat (group g at 16 g), scales
 * converted 16 at a time (a vector built from scalar stores would wait on them) */
static void units_16(int fmt, const uint8_t *row, int64_t u0, units *o) {
    const uint8_t *b = row + (fmt == Q6_K ? 210 : 84) * (u0 / 16);
    v16c sc;
    memcpy(&sc, fmt == Q6_K ? b + 192 : b, 16);
    if (fmt == Q6_K) {
        q6_k_values(b, &o->q[0][0]);
        o->ws = fp16_to_f32(rd16(b + 208)) * __builtin_convertvector(sc, v16f);
        o->wm = (v16f){0};
    } else {
        q2_k_values(b, &o->q[0][0]);
        const v16uc u = (v16uc)sc;
        o->ws = fp16_to_f32(rd16(b + 80)) * __builtin_convertvector(u & 15, v16f);
        o->wm = fp16_to_f32(rd16(b + 82)) * __builtin_convertvector(u >> 4, v16f);
    }
}

/* units u0 .. u0 + 15 of a row of the low-bit formats (lowbit.c), zeros past nu: each block
 * decoded straight into place (the 16 units are 1, 2, 4 or 16 whole blocks) */
static inline __attribute__((always_inline)) void units_decoded(const int fmt, const uint8_t *row,
                                                                int64_t u0, int64_t nu, units *o) {
    const int len = unit_len(fmt), n = lowbit_elems(fmt), bb = lowbit_bytes(fmt);
    const int per = n / len, nblocks = 16 / per; /* units a block, blocks in the 16 units */
    int8_t *q = &o->q[0][0];
    float sc[32], mn[32]; /* per 16 weights: 16 units of 32 hold 32 groups */
    const int64_t first = u0 / per, have = (nu - u0 + per - 1) / per; /* blocks in the row from here */
    const int whole = have < nblocks ? (int)have : nblocks;
    dec_lowbit_run(fmt, row + first * bb, whole, q, sc, mn);
    for (int i = whole; i < nblocks; i++) { /* past the row's end: zeros */
        memset(q + i * n, 0, (size_t)n);
        for (int g = 0; g < n / 16; g++) sc[i * (n / 16) + g] = mn[i * (n / 16) + g] = 0.0f;
    }
    float ws[16], wm[16];
    for (int l = 0; l < 16; l++) {
        const int g = l * len / 16; /* the unit's first group of 16 */
        ws[l] = u0 + l < nu ? sc[g] : 0.0f;
        wm[l] = u0 + l < nu ? mn[g] : 0.0f;
    }
    memcpy(&o->ws, ws, sizeof ws);
    memcpy(&o->wm, wm, sizeof wm);
}

static inline __attribute__((always_inline)) void fill_units(const int fmt, const int dec, const uint8_t *row,
                                                             int64_t u0, int64_t nu, units *o) {
    if (dec != fmt) units_decoded(dec, row, u0, nu, o); /* a low-bit format in Q2_K's / Q4_1's loop */
    else if (fmt == Q4_K) units_q4_k(row, u0, nu, o);
    else if (fmt == Q6_K || fmt == Q2_K) units_16(fmt, row, u0, o);
    else units_32(fmt, row, u0, nu, o);
}

/* ---- one quantized row times a's rows ---------------------------------------------------- */

/* out[k] = row . x_k for the nx activation rows of a (before outliers); always inlined into
 * exact_row_q's switch, so each format gets its own copy with its branches folded away */
/* fmt: the format whose copy of this loop runs; dec: the format of the row, fmt itself or a
 * low-bit one with fmt's unit length (exact_row_q) */
static inline __attribute__((always_inline)) void row_q(const int fmt, const int dec, const uint8_t *row,
                                                        const acts *a, float *out) {
    const int len = unit_len(fmt);
    const int64_t cols = a->cols, nu = cols / len, nx = a->nx;
    v16f acc[MAX_BATCH];
    for (int64_t k = 0; k < nx; k++) acc[k] = (v16f){0};
    units w;
#ifdef HAVE_PACKED32
    /* one activation row: no decode, straight reads; more: decoded once for all of them */
    const int packed = dec == fmt && (fmt == Q4_K || (nx == 1 && (fmt == Q8_0 || fmt == Q4_0 || fmt == Q4_1)));
#else
    const int packed = 0;
#endif
    for (int64_t u0 = 0; u0 < nu; u0 += 16) {
        const int full = u0 + 16 <= nu, nn = full ? 16 : (int)(nu - u0);
        if (packed && fmt == Q4_K) scales_q4_k(row, u0, nu, &w);
        else if (packed) scales_32(fmt, row, u0, nn, &w);
        else fill_units(fmt, dec, row, u0, nu, &w);
        for (int64_t k = 0; k < nx; k++) {
            const int8_t *x = a->xq + k * cols + u0 * len;
            const float *xd = a->xd + k * (cols / 32);
            int8_t xpad[16 * 32];
            if (!full && !packed) { /* the row's last units: activations past its end as 0 */
                memset(xpad, 0, sizeof xpad);
                memcpy(xpad, x, (size_t)((nu - u0) * len));
                x = xpad;
            }
            int32_t n[16];
            v16f nf;
#ifdef HAVE_PACKED32
            if (packed) { /* the sums stay in registers (a store then a wider load stalls) */
                __m256i nv2[2];
                dots_packed32(fmt, row, u0, nn, x, a->xs + k * (cols / 16) + 2 * u0, nv2);
#if defined(__AVX512F__)
                nf = (v16f)_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(nv2[0]), nv2[1], 1));
#else
                _mm256_storeu_si256((__m256i *)n, nv2[0]);
                _mm256_storeu_si256((__m256i *)(n + 8), nv2[1]);
                v16i nv;
                memcpy(&nv, n, sizeof nv);
                nf = __builtin_convertvector(nv, v16f);
#endif
            } else
#endif
            {
                if (len == 32) dots32((const int8_t (*)[32])w.q, x, n);
                else dots16(&w.q[0][0], x, n);
                v16i nv;
                memcpy(&nv, n, sizeof nv);
                nf = __builtin_convertvector(nv, v16f);
            }
            float d[16], s[16];
            const float *dp = d, *sp = s;
            v16f dv16, sv16;
            if (len == 32 && full) { /* the activations' scales and sums as they lie */
                dp = xd + u0;
                sp = a->xsum + k * (cols / 32) + u0;
            } else if (len == 16 && full && a->xd16) { /* made once for the matmul */
                dp = a->xd16 + k * (cols / 16) + u0;
                sp = a->xsum16 + k * (cols / 16) + u0;
            } else if (len == 16 && full) { /* groups of 16: each block's scale twice */
                v8f h;
                memcpy(&h, xd + u0 / 2, sizeof h);
                dv16 = __builtin_shufflevector(h, h, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
                v16i xs16;
                memcpy(&xs16, a->xs + k * (cols / 16) + u0, sizeof xs16);
                sv16 = dv16 * __builtin_convertvector(xs16, v16f);
                dp = (const float *)&dv16;
                sp = (const float *)&sv16;
            } else {
                for (int l = 0; l < 16; l++) {
                    const int64_t u = u0 + l;
                    if (u >= nu) { d[l] = s[l] = 0.0f; continue; }
                    if (len == 32) {
                        d[l] = xd[u];
                        s[l] = a->xsum[k * (cols / 32) + u];
                    } else {
                        d[l] = xd[u / 2];
                        s[l] = xd[u / 2] * (float)a->xs[k * (cols / 16) + u];
                    }
                }
            }
            acc[k] = acc[k] + (nf * (w.ws * load16(dp)) - w.wm * load16(sp));
        }
    }
    for (int64_t k = 0; k < nx; k++) out[k] = fold16(acc[k]);
}

static void exact_row_q(int fmt, const uint8_t *row, const acts *a, float *out) {
    switch (fmt) {
    case Q8_0: row_q(Q8_0, Q8_0, row, a, out); break;
    case Q4_0: row_q(Q4_0, Q4_0, row, a, out); break;
    case Q4_1: row_q(Q4_1, Q4_1, row, a, out); break;
    case Q4_K: row_q(Q4_K, Q4_K, row, a, out); break;
    case Q6_K: row_q(Q6_K, Q6_K, row, a, out); break;
    case Q2_K: row_q(Q2_K, Q2_K, row, a, out); break;
    default: /* the low-bit formats run the loop of a format with their unit (Q2_K: 16, Q4_1:
              * 32), their blocks decoded by lowbit.c: one more copy of it each made the
              * kernels' compile twice as long, which every cold node pays */
        if (unit_len(fmt) == 16) row_q(Q2_K, fmt, row, a, out);
        else row_q(Q4_1, fmt, row, a, out);
        break;
    }
}

/* ---- float rows (F32, F16, BF16) --------------------------------------------------------- */

/* 16 weights from column c (those past cols: zeros) as floats; conversions are exact */
static inline v16f widen16(int fmt, const uint8_t *row, int64_t c, int64_t cols) {
    float w[16];
    const int64_t n = cols - c < 16 ? cols - c : 16;
    if (fmt == F32) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (n == 16) return load16((const float *)(const void *)(row + 4 * c)); /* as stored */
#endif
        for (int64_t i = 0; i < n; i++) w[i] = rdf32(row + 4 * (c + i));
    } else {
#if defined(__F16C__)
        if (fmt == F16 && n == 16) {
            const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * c)));
            const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * c + 16)));
            _mm256_storeu_ps(w, lo);
            _mm256_storeu_ps(w + 8, hi);
            return load16(w);
        }
#endif
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = rd16(row + 2 * (c + i));
            if (fmt == BF16) {
                const uint32_t bits = (uint32_t)h << 16;
                memcpy(w + i, &bits, 4);
            } else {
                w[i] = fp16_to_f32(h);
            }
        }
    }
    for (int64_t i = n; i < 16; i++) w[i] = 0.0f;
    return load16(w);
}

static inline v16f xload16(const float *x, int64_t c, int64_t cols) {
    if (c + 16 <= cols) return load16(x + c);
    float t[16] = {0};
    memcpy(t, x + c, sizeof(float) * (size_t)(cols - c));
    return load16(t);
}

/* out[k] = row . x_k, x_k = x + k * ldx, for nx rows: A[i % 16] += w_i x_i, folded */
static void exact_row_f(int fmt, const uint8_t *row, int64_t cols, const float *x, int64_t nx,
                        int64_t ldx, float *out) {
    int64_t k = 0;
    const int64_t whole = cols / 16 * 16;
    /* eight rows of x a pass: each row's sum is one chain of adds (its order is fixed), so
     * eight chains side by side keep the adder busy; their sums stay in registers */
    for (; k + 8 <= nx; k += 8) {
        v16f a[8] = {{0}};
        const float *xk = x + k * ldx;
        for (int64_t c = 0; c < whole; c += 16) {
            const v16f w = widen16(fmt, row, c, cols);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) a[j] = a[j] + w * load16(xk + j * ldx + c);
        }
        if (whole < cols) {
            const v16f w = widen16(fmt, row, whole, cols);
            for (int j = 0; j < 8; j++) a[j] = a[j] + w * xload16(xk + j * ldx, whole, cols);
        }
        for (int j = 0; j < 8; j++) out[k + j] = fold16(a[j]);
    }
    for (; k < nx; k++) {
        v16f a = {0};
        for (int64_t c = 0; c < cols; c += 16) a = a + widen16(fmt, row, c, cols) * xload16(x + k * ldx, c, cols);
        out[k] = fold16(a);
    }
}

/* a . b over n floats, in the same order (attention's q . k) */
static inline float dot_exact(const float *a, const float *b, int64_t n) {
    v16f acc = {0};
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) acc = acc + load16(a + c) * load16(b + c);
    if (c < n) acc = acc + xload16(a, c, n) * xload16(b, c, n);
    return fold16(acc);
}

/* sum of n floats in the same order */
static inline float sum_exact(const float *a, int64_t n) {
    v16f acc = {0};
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) acc = acc + load16(a + c);
    if (c < n) acc = acc + xload16(a, c, n);
    return fold16(acc);
}

/* ---- exp, log and sin/cos in double, for tables (RoPE) ------------------------------------
 * Series in plain double arithmetic (no FMA, no libm: glibc's cos and pow differ by version
 * and by the FMA they are built with; numpy's float32 cos by SIMD path). Accurate to a few
 * units in the 16th digit, then rounded once to float32: the same bits on every CPU. */

static double pow2i(int n) { /* 2^n for -1022 <= n <= 1023 */
    const uint64_t bits = (uint64_t)(n + 1023) << 52;
    double v;
    memcpy(&v, &bits, 8);
    return v;
}

static const double LN2_HI = 6.93147180369123816490e-01, LN2_LO = 1.90821492927058770002e-10;

/* exp(x) for |x| < 700: x = n ln2 + r, |r| <= ln2 / 2, Taylor to degree 15 */
static double exp_d(double x) {
    const double t = x * 1.44269504088896338700e+00;
    const int n = (int)(t < 0 ? t - 0.5 : t + 0.5);
    const double r = (x - (double)n * LN2_HI) - (double)n * LN2_LO;
    double p = 1.0 / 1307674368000.0; /* 1/15! */
    static const double inv_fact[] = {1.0 / 87178291200.0, 1.0 / 6227020800.0, 1.0 / 479001600.0,
                                      1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                      1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                                      1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
    for (int i = 0; i < 15; i++) p = p * r + inv_fact[i];
    return p * pow2i(n);
}

/* log(x) for finite x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s),
 * s = (m - 1) / (m + 1), |s| < 0.172, its series to s^25 */
double cs_log(double x) {
    uint64_t bits;
    memcpy(&bits, &x, 8);
    int e = (int)((bits >> 52) & 0x7FF) - 1023;
    bits = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull; /* m in [1, 2) */
    double m;
    memcpy(&m, &bits, 8);
    if (m > 1.41421356237309504880) { m = m * 0.5; e = e + 1; }
    const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double p = 1.0 / 25.0;
    for (int k = 23; k >= 1; k -= 2) p = p * s2 + 1.0 / (double)k;
    return ((double)e * LN2_HI + (double)e * LN2_LO) + 2.0 * s * p;
}

/* out[i] = base ** e[i] (base > 0), rounded to float32 */
void cs_pow(double base, const float *e, int64_t n, float *out) {
    const double lb = cs_log(base);
    for (int64_t i = 0; i < n; i++) out[i] = (float)exp_d((double)e[i] * lb);
}

/* cos and sin of a (|a| < 2^20): a = k pi/2 + r by pi/2 in three 33-bit parts (k pio2_1 is
 * exact), then Taylor on |r| <= pi/4 to degree 19 / 18 */
static void sincos_d(double a, double *c, double *s) {
    static const double P1 = 1.57079632673412561417e+00, P2 = 6.07710050630396597660e-11,
                        P3 = 2.02226624871116645580e-21;
    const double t = a * 6.36619772367581382433e-01;
    const int64_t k = (int64_t)(t < 0 ? t - 0.5 : t + 0.5);
    const double kd = (double)k, r = ((a - kd * P1) - kd * P2) - kd * P3, r2 = r * r;
    double ps = 1.0 / 121645100408832000.0, pc = 1.0 / 6402373705728000.0; /* 1/19!, 1/18! */
    static const double sf[] = {-1.0 / 355687428096000.0, 1.0 / 1307674368000.0,
                                -1.0 / 6227020800.0, 1.0 / 39916800.0, -1.0 / 362880.0,
                                1.0 / 5040.0, -1.0 / 120.0, 1.0 / 6.0};
    static const double cf[] = {-1.0 / 20922789888000.0, 1.0 / 87178291200.0,
                                -1.0 / 479001600.0, 1.0 / 3628800.0, -1.0 / 40320.0,
                                1.0 / 720.0, -1.0 / 24.0, 0.5};
    for (int i = 0; i < 8; i++) ps = ps * r2 + sf[i]; /* sin r = r - r^3 (1/3! - r^2/5! ...) */
    for (int i = 0; i < 8; i++) pc = pc * r2 + cf[i]; /* cos r = 1 - r^2 (1/2! - r^2/4! ...) */
    const double sr = r - r * r2 * ps, cr = 1.0 - r2 * pc;
    switch ((int)(k & 3)) {
    case 0: *c = cr; *s = sr; break;
    case 1: *c = -sr; *s = cr; break;
    case 2: *c = -cr; *s = -sr; break;
    default: *c = sr; *s = -cr; break;
    }
}

void cs_sincos(const float *a, int64_t n, float *c, float *s) {
    for (int64_t i = 0; i < n; i++) {
        double cd, sd;
        sincos_d((double)a[i], &cd, &sd);
        c[i] = (float)cd;
        s[i] = (float)sd;
    }
}

/* exp of doubles x <= 0 (a sampler's softmax, a score's log-sum-exp): 0 below -700 */
void cs_exp_d(const double *x, int64_t n, double *out) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] < -700.0 ? 0.0 : exp_d(x[i]);
}

/* the sum of n doubles, in order */
double cs_sum_d(const double *x, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += x[i];
    return s;
}
