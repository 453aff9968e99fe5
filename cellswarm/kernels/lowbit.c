/* ---- the low-bit formats: K-quants with odd widths, i-quants, ternary, FP4 ---------------
 * Included by kernels.c after its own decoders. Each block is decoded to what every other
 * format decodes to (`decoded`: int8 values with a scale and a min per 16 weights), so the
 * rest of the kernels take it unchanged: the exact row product (exact.c: units of 32 or 16,
 * one float order on every CPU), dequantizing, the outliers' weights. Every value is a small
 * integer whose scale is one float product, so the integer part stays exact on any CPU and
 * the float part is the same IEEE operations everywhere:
 *
 *   Q5_1, Q5_K         5-bit q with a min, as Q4_1 / Q4_K
 *   Q3_K               q in -4..3, a 6-bit signed scale per 16
 *   IQ4_NL, IQ4_XS     a nibble indexes a 16-entry int8 table (-127..113)
 *   IQ2_XXS/XS/S       codebook entries of 8 values (8, 25 or 43) with their signs apart
 *   IQ3_XXS, IQ3_S     codebook entries of 4 values
 *   IQ1_S, IQ1_M       entries of 8 values in -1..1 plus a delta of +-1/8 per 32 (IQ1_S) or
 *                      per 8 (IQ1_M): stored as 8 * (value + delta), an odd integer in
 *                      -9..9, with the scale divided by 8 (exact: a power of two)
 *   TQ1_0, TQ2_0       ternary -1..1, one f16 scale per 256
 *   MXFP4, NVFP4       e2m1 (doubled) values with an E8M0 / unsigned E4M3 scale
 *
 * The tables (codebooks, sign patterns, non-linear values) are gguf-py's, in grids.c. All
 * multi-byte fields are read byte by byte (rd16/rd32), so big-endian CPUs decode the same. */

#include "grids.c"
#if defined(__SSSE3__)
#include <immintrin.h>
#endif

enum {
    Q5_1 = 7, Q3_K = 11, Q5_K = 13, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19,
    IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, TQ1_0 = 34, TQ2_0 = 35,
    MXFP4 = 39, NVFP4 = 40
};

static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* elements in a block and bytes it takes, for the formats of this file */
static inline int lowbit_elems(int fmt) {
    return fmt == Q5_1 || fmt == IQ4_NL || fmt == MXFP4 ? 32 : fmt == NVFP4 ? 64 : 256;
}

static inline int lowbit_bytes(int fmt) {
    switch (fmt) {
    case Q5_1: return 24;
    case Q3_K: return 110;
    case Q5_K: return 176;
    case IQ2_XXS: return 66;
    case IQ2_XS: return 74;
    case IQ3_XXS: return 98;
    case IQ1_S: return 50;
    case IQ4_NL: return 18;
    case IQ3_S: return 110;
    case IQ2_S: return 82;
    case IQ4_XS: return 136;
    case IQ1_M: return 56;
    case TQ1_0: return 54;
    case TQ2_0: return 66;
    case MXFP4: return 17;
    default: return 36; /* NVFP4 */
    }
}

/* Each decoder writes a block's int8 values to q and a scale and a min per 16 of them to sc
 * and mn (w = sc * q - mn). Written as loops over whole planes with constant shifts so gcc
 * vectorizes them; table lookups of nibbles go 16 at a time through a byte shuffle where the
 * CPU has one (the same bytes either way). */

static inline void set_scale(float *sc, float *mn, int g0, int n, float s) {
    for (int g = g0; g < g0 + n; g++) { sc[g] = s; mn[g] = 0.0f; }
}

/* y[0..16) = table[low nibbles of b[0..16)], y[16..32) = table[high nibbles] */
static inline void nibble_table32(const uint8_t *b, const int8_t *table, int8_t *y) {
#if defined(__SSSE3__)
    const __m128i t = _mm_loadu_si128((const __m128i *)table), m = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128((const __m128i *)b);
    _mm_storeu_si128((__m128i *)y, _mm_shuffle_epi8(t, _mm_and_si128(v, m)));
    _mm_storeu_si128((__m128i *)(y + 16), _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(v, 4), m)));
#else
    for (int j = 0; j < 16; j++) {
        y[j] = table[b[j] & 0xF];
        y[j + 16] = table[b[j] >> 4];
    }
#endif
}

/* the same for 8 bytes: y[0..8) low nibbles, y[8..16) high */
static inline void nibble_table16(const uint8_t *b, const int8_t *table, int8_t *y) {
#if defined(__SSSE3__)
    const __m128i t = _mm_loadu_si128((const __m128i *)table), m = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadl_epi64((const __m128i *)b);
    const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
    _mm_storeu_si128((__m128i *)y, _mm_shuffle_epi8(t, both));
#else
    for (int j = 0; j < 8; j++) {
        y[j] = table[b[j] & 0xF];
        y[j + 8] = table[b[j] >> 4];
    }
#endif
}

/* 8 values e (all > 0, so negating a byte never borrows) with the signs of the bits of s (bit j:
 * value j negative), in one 64-bit word: the sign bits spread to bytes, then -e = (e ^ ff) + 1 */
static inline void signed8(int8_t *y, const int8_t *e, unsigned s) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    const uint64_t pick = 0x0102040810204080ull; /* byte j in memory: bit j */
#else
    const uint64_t pick = 0x8040201008040201ull;
#endif
    const uint64_t bits = ((uint64_t)(s & 0xFF) * 0x0101010101010101ull) & pick;
    const uint64_t set = ((bits + 0x7F7F7F7F7F7F7F7Full) | bits) & 0x8080808080808080ull; /* 0x80 where set */
    const uint64_t mask = (set >> 7) * 0xFF, one = set >> 7;
    uint64_t v;
    memcpy(&v, e, 8);
    v = (v ^ mask) + one;
    memcpy(y, &v, 8);
}

/* the 8 bits of a byte as 8 bytes of 0 or 1 (byte j in memory: bit j) */
static inline uint64_t bits_to_bytes(unsigned byte) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    const uint64_t pick = 0x0102040810204080ull;
#else
    const uint64_t pick = 0x8040201008040201ull;
#endif
    const uint64_t bits = ((uint64_t)(byte & 0xFF) * 0x0101010101010101ull) & pick;
    return (((bits + 0x7F7F7F7F7F7F7F7Full) | bits) & 0x8080808080808080ull) >> 7;
}

/* bytes a + b, each on its own (no carry from one byte into the next) */
static inline uint64_t add_bytes(uint64_t a, uint64_t b) {
    const uint64_t low = 0x7F7F7F7F7F7F7F7Full;
    return ((a & low) + (b & low)) ^ ((a ^ b) & ~low);
}

/* two groups of 8 signed at once: entries e0, e1 of 8 values with sign bytes s0, s1; with
 * SSSE3 one 16-byte vector (the sign bits spread to bytes, _mm_sign_epi8 negates) */
#if defined(__SSSE3__)
static inline void signed16v(int8_t *y, __m128i v, unsigned s) {
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ull);
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)s), _mm_set_epi64x(0x0101010101010101ll, 0));
    const __m128i neg = _mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit);
    _mm_storeu_si128((__m128i *)y, _mm_sign_epi8(v, _mm_or_si128(neg, _mm_set1_epi8(1))));
}
#endif

static inline void signed8x2(int8_t *y, const int8_t *e0, const int8_t *e1, unsigned s0, unsigned s1) {
#if defined(__SSSE3__)
    long long a, b;
    memcpy(&a, e0, 8);
    memcpy(&b, e1, 8);
    signed16v(y, _mm_set_epi64x(b, a), (s0 & 0xFF) | (s1 & 0xFF) << 8);
#else
    signed8(y, e0, s0);
    signed8(y + 8, e1, s1);
#endif
}

/* d (0.5 + s) step, in this order (gguf-py's and ggml's) */
static inline float iq_scale(float d, unsigned s, float step) { return d * (0.5f + (float)s) * step; }

static inline void dec_q5_1(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b)), m = fp16_to_f32(rd16(b + 2));
    static const int8_t nibble[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    nibble_table32(b + 8, nibble, q);
    for (int k = 0; k < 4; k++) { /* fifth bits: byte k of the mask holds values 8k .. 8k + 7 */
        uint64_t v;
        memcpy(&v, q + 8 * k, 8);
        v |= bits_to_bytes(b[4 + k]) << 4;
        memcpy(q + 8 * k, &v, 8);
    }
    sc[0] = sc[1] = d;
    mn[0] = mn[1] = -m; /* w = d q + m */
}

static inline void dec_q5_k(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++) { /* 64 weights: 32 low nibbles, 32 high; fifth bits 2c, 2c+1 */
        const uint8_t *ql = qs + 32 * c;
        int8_t *y = q + 64 * c;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)((ql[l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4));
            y[l + 32] = (int8_t)((ql[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4));
        }
        for (int h = 0; h < 2; h++) {
            uint8_t s, m;
            k4_scale_min(2 * c + h, scales, &s, &m);
            const int g = 4 * c + 2 * h;
            sc[g] = sc[g + 1] = d * (float)s;
            mn[g] = mn[g + 1] = dmin * (float)m;
        }
    }
}

static inline void dec_q3_k(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    const float d = fp16_to_f32(rd16(b + 108));
    for (int g = 0; g < 16; g++) { /* low nibble from bytes 0-7, top 2 bits from bytes 8-11 */
        const int lo = g < 8 ? s[g] & 0xF : s[g - 8] >> 4, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        sc[g] = d * (float)((lo | hi << 4) - 32);
        mn[g] = 0.0f;
    }
    /* 2-bit planes j of 32 bytes per 128 (n); high bit 4n + j of hm[l]; a clear one: -4 */
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++) {
            int8_t *y = q + 128 * n + 32 * j;
            const uint8_t *ql = qs + 32 * n;
            const int hb = 4 * n + j;
            for (int l = 0; l < 32; l++)
                y[l] = (int8_t)(((ql[l] >> (2 * j)) & 3) - ((~hm[l] >> hb) & 1) * 4);
        }
}

static inline void dec_iq4_nl(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    nibble_table32(b + 2, kvalues_iq4nl, q);
    set_scale(sc, mn, 0, 2, fp16_to_f32(rd16(b)));
}

static inline void dec_iq4_xs(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b));
    const unsigned high = rd16(b + 2);
    for (int s = 0; s < 8; s++) {
        const int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | ((high >> (2 * s)) & 3) << 4;
        nibble_table32(b + 8 + 16 * s, kvalues_iq4nl, q + 32 * s);
        set_scale(sc, mn, 2 * s, 2, d * (float)(ls - 32));
    }
}

static inline void dec_iq2_xxs(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b));
    for (int s = 0; s < 8; s++) {
        const uint8_t *idx = b + 2 + 8 * s;
        const uint32_t aux = rd32(idx + 4);
        for (int k = 0; k < 4; k += 2)
            signed8x2(q + 32 * s + 8 * k, iq2xxs_grid[idx[k]], iq2xxs_grid[idx[k + 1]],
                      ksigns_iq2xs[(aux >> (7 * k)) & 127], ksigns_iq2xs[(aux >> (7 * k + 7)) & 127]);
        set_scale(sc, mn, 2 * s, 2, iq_scale(d, aux >> 28, 0.25f));
    }
}

static inline void dec_iq2_xs(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b));
    for (int k = 0; k < 32; k += 2) {
        const unsigned w0 = rd16(b + 2 + 2 * k), w1 = rd16(b + 4 + 2 * k);
        signed8x2(q + 8 * k, iq2xs_grid[w0 & 511], iq2xs_grid[w1 & 511], ksigns_iq2xs[w0 >> 9], ksigns_iq2xs[w1 >> 9]);
    }
    for (int g = 0; g < 16; g++) set_scale(sc, mn, g, 1, iq_scale(d, (b[66 + g / 2] >> (4 * (g % 2))) & 0xF, 0.25f));
}

static inline void dec_iq2_s(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b));
    const uint8_t *low = b + 2, *signs = b + 34, *tops = b + 66, *s = b + 74;
    for (int m = 0; m < 8; m++) { /* a byte of 2-bit tops: 4 entries, 32 values */
        const unsigned t = tops[m];
        const uint8_t *l = low + 4 * m;
        signed8x2(q + 32 * m, iq2s_grid[l[0] | (t & 3) << 8], iq2s_grid[l[1] | (t & 12) << 6], signs[4 * m],
                  signs[4 * m + 1]);
        signed8x2(q + 32 * m + 16, iq2s_grid[l[2] | (t & 48) << 4], iq2s_grid[l[3] | (t & 192) << 2],
                  signs[4 * m + 2], signs[4 * m + 3]);
    }
    for (int g = 0; g < 16; g++) set_scale(sc, mn, g, 1, iq_scale(d, (s[g / 2] >> (4 * (g % 2))) & 0xF, 0.25f));
}

/* four codebook entries of 4 (IQ3) side by side as the 16 values two sign bytes cover */
static inline void signed4x4(int8_t *y, const int8_t *e0, const int8_t *e1, const int8_t *e2,
                             const int8_t *e3, unsigned s0, unsigned s1) {
    int8_t e[16];
    memcpy(e, e0, 4);
    memcpy(e + 4, e1, 4);
    memcpy(e + 8, e2, 4);
    memcpy(e + 12, e3, 4);
    signed8x2(y, e, e + 8, s0, s1);
}

static inline void dec_iq3_xxs(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b));
    const uint8_t *idx = b + 2;
    for (int s = 0; s < 8; s++) {
        const uint32_t aux = rd32(b + 66 + 4 * s);
        const uint8_t *i = idx + 8 * s;
        for (int k = 0; k < 4; k += 2)
            signed4x4(q + 32 * s + 8 * k, iq3xxs_grid[i[2 * k]], iq3xxs_grid[i[2 * k + 1]], iq3xxs_grid[i[2 * k + 2]],
                      iq3xxs_grid[i[2 * k + 3]], ksigns_iq2xs[(aux >> (7 * k)) & 127],
                      ksigns_iq2xs[(aux >> (7 * k + 7)) & 127]);
        set_scale(sc, mn, 2 * s, 2, iq_scale(d, aux >> 28, 0.5f));
    }
}

static inline void dec_iq3_s(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b));
    const uint8_t *low = b + 2, *ninth = b + 66, *signs = b + 74, *s = b + 106;
    for (int m = 0; m < 8; m++) { /* a ninth-bit byte: 8 entries, 32 values */
        const unsigned h = ninth[m];
        const uint8_t *l = low + 8 * m;
        signed4x4(q + 32 * m, iq3s_grid[l[0] | (h & 1) << 8], iq3s_grid[l[1] | (h & 2) << 7],
                  iq3s_grid[l[2] | (h & 4) << 6], iq3s_grid[l[3] | (h & 8) << 5], signs[4 * m], signs[4 * m + 1]);
        signed4x4(q + 32 * m + 16, iq3s_grid[l[4] | (h & 16) << 4], iq3s_grid[l[5] | (h & 32) << 3],
                  iq3s_grid[l[6] | (h & 64) << 2], iq3s_grid[l[7] | (h & 128) << 1], signs[4 * m + 2], signs[4 * m + 3]);
    }
    for (int t = 0; t < 8; t++) {
        const unsigned ls = (s[t / 2] >> (4 * (t % 2))) & 0xF;
        set_scale(sc, mn, 2 * t, 2, d * (float)(1 + 2 * ls));
    }
}

/* 8 values of an IQ1 entry as 8 * (value + delta): 8 v - 1 or 8 v + 1 */
static inline void iq1_8(int8_t *y, unsigned index, unsigned negative_delta) {
    uint64_t v;
    memcpy(&v, iq1s_grid[index], 8);
    v = (v << 3) & 0xF8F8F8F8F8F8F8F8ull; /* 8 * value, byte by byte */
    v = add_bytes(v, negative_delta ? 0xFFFFFFFFFFFFFFFFull : 0x0101010101010101ull);
    memcpy(y, &v, 8);
}

/* two groups of 8: entries i0, i1 with their deltas' signs n0, n1 */
static inline void iq1_16(int8_t *y, unsigned i0, unsigned i1, unsigned n0, unsigned n1) {
#if defined(__SSSE3__)
    long long a, b;
    memcpy(&a, iq1s_grid[i0], 8);
    memcpy(&b, iq1s_grid[i1], 8);
    const __m128i v = _mm_and_si128(_mm_slli_epi16(_mm_set_epi64x(b, a), 3), _mm_set1_epi8((char)0xF8));
    const __m128i delta = _mm_set_epi64x(n1 ? -1ll : 0x0101010101010101ll, n0 ? -1ll : 0x0101010101010101ll);
    _mm_storeu_si128((__m128i *)y, _mm_add_epi8(v, delta));
#else
    iq1_8(y, i0, n0);
    iq1_8(y + 8, i1, n1);
#endif
}

static inline void dec_iq1_s(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const float d = fp16_to_f32(rd16(b));
    for (int s = 0; s < 8; s++) {
        const unsigned w = rd16(b + 34 + 2 * s), neg = w >> 15;
        const uint8_t *l = b + 2 + 4 * s;
        iq1_16(q + 32 * s, l[0] | (w & 7) << 8, l[1] | (w & 0x38) << 5, neg, neg);
        iq1_16(q + 32 * s + 16, l[2] | (w & 0x1C0) << 2, l[3] | (w & 0xE00) >> 1, neg, neg);
        const float dl = d * (float)(2 * ((w >> 12) & 7) + 1);
        set_scale(sc, mn, 2 * s, 2, dl * 0.125f);
    }
}

static inline void dec_iq1_m(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    const uint8_t *low = b, *nib = b + 32;
    unsigned w[4];
    for (int k = 0; k < 4; k++) w[k] = rd16(b + 48 + 2 * k);
    const float d = fp16_to_f32((uint16_t)((w[0] >> 12) | ((w[1] >> 8) & 0xF0) | ((w[2] >> 4) & 0xF00) | (w[3] & 0xF000)));
    for (int k = 0; k < 32; k += 2) { /* a byte of two nibbles: (3 index top bits, delta sign) */
        const unsigned h = nib[k / 2];
        iq1_16(q + 8 * k, low[k] | (h & 7) << 8, low[k + 1] | (h & 0x70) << 4, h & 8, h & 0x80);
    }
    for (int g = 0; g < 16; g++) {
        const float dl = d * (float)(2 * ((w[g / 4] >> (3 * (g % 4))) & 7) + 1);
        set_scale(sc, mn, g, 1, dl * 0.125f);
    }
}

/* digit k (0..4) of n TQ1_0 bytes: a byte is a fixed-point fraction of 5 base-3 digits; times
 * 3^k (mod 256) brings digit k to the top, times 3 >> 8 reads it */
#if defined(__SSSE3__)
/* the same for 16 bytes: in 16-bit lanes, (b 3^k mod 256) 3 >> 8, packed back to bytes */
static inline void tq1_digits16(const uint8_t *b, int k, int8_t *y) {
    static const short pow3[5] = {1, 3, 9, 27, 81};
    const __m128i x = _mm_loadu_si128((const __m128i *)b), z = _mm_setzero_si128();
    const __m128i p = _mm_set1_epi16(pow3[k]), ff = _mm_set1_epi16(0xFF), three = _mm_set1_epi16(3);
    __m128i lo = _mm_and_si128(_mm_mullo_epi16(_mm_unpacklo_epi8(x, z), p), ff);
    __m128i hi = _mm_and_si128(_mm_mullo_epi16(_mm_unpackhi_epi8(x, z), p), ff);
    lo = _mm_srli_epi16(_mm_mullo_epi16(lo, three), 8);
    hi = _mm_srli_epi16(_mm_mullo_epi16(hi, three), 8);
    _mm_storeu_si128((__m128i *)y, _mm_sub_epi8(_mm_packus_epi16(lo, hi), _mm_set1_epi8(1)));
}
#endif

static inline void tq1_digits(const uint8_t *b, int n, int k, int8_t *y) {
#if defined(__SSSE3__)
    if (n % 16 == 0) {
        for (int j = 0; j < n; j += 16) tq1_digits16(b + j, k, y + j);
        return;
    }
#endif
    static const uint16_t pow3[5] = {1, 3, 9, 27, 81};
    for (int j = 0; j < n; j++) { /* in 16 bits: ppc64's vectorized 8-bit multiply differed */
        const uint16_t frac = (uint16_t)((b[j] * pow3[k]) & 0xFF);
        y[j] = (int8_t)(((frac * 3) >> 8) - 1);
    }
}

/* not inlined: inlined into the row product, gcc 12 for ppc64 (-mcpu=cell -maltivec, SLP
 * vectorizer) computed other values there (tests/test_bits_cross.py caught it) */
static __attribute__((noinline)) void dec_tq1_0(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    for (int k = 0; k < 5; k++) tq1_digits(b, 32, k, q + 32 * k);
    for (int k = 0; k < 5; k++) tq1_digits(b + 32, 16, k, q + 160 + 16 * k);
    for (int k = 0; k < 4; k++) tq1_digits(b + 48, 4, k, q + 240 + 4 * k);
    set_scale(sc, mn, 0, 16, fp16_to_f32(rd16(b + 52)));
}

static inline void dec_tq2_0(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) q[128 * n + 32 * j + l] = (int8_t)(((b[32 * n + l] >> (2 * j)) & 3) - 1);
    set_scale(sc, mn, 0, 16, fp16_to_f32(rd16(b + 64)));
}

/* 2^(e - 128) (ggml_e8m0_to_fp32_half) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void dec_mxfp4(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    nibble_table32(b + 1, kvalues_mxfp4, q);
    set_scale(sc, mn, 0, 2, e8m0_half(b[0]));
}

/* half an unsigned E4M3 (bias 7) as float, exactly; 0 and 0x7F are 0, bit 7 is not read */
static inline float ue4m3_half(uint8_t x) {
    const int e = (x >> 3) & 0xF, m = x & 7;
    if (x == 0 || x == 0x7F) return 0.0f;
    const uint32_t bits = e == 0 ? 0 : (uint32_t)(e - 7 + 127 - 1) << 23 | (uint32_t)m << 20;
    float f;
    memcpy(&f, &bits, 4);
    return e == 0 ? (float)m * 0.0009765625f : f; /* m 2^-9 / 2, or 1.m 2^(e-7) / 2 */
}

static inline void dec_nvfp4(const uint8_t *b, int8_t *q, float *sc, float *mn) {
    for (int s = 0; s < 4; s++) {
        nibble_table16(b + 4 + 8 * s, kvalues_mxfp4, q + 16 * s);
        set_scale(sc, mn, s, 1, ue4m3_half(b[s]));
    }
}

/* Every format of this file with its decoder: the switches below and in exact.c / kernels.c
 * expand it, so that each format gets its own inlined copy of the code around its decoder
 * (its branches folded away), and a new format is one more line here. */
#define LOWBIT_FORMATS(X)                                                                     \
    X(Q5_1, dec_q5_1) X(Q3_K, dec_q3_k) X(Q5_K, dec_q5_k) X(IQ2_XXS, dec_iq2_xxs)           \
    X(IQ2_XS, dec_iq2_xs) X(IQ3_XXS, dec_iq3_xxs) X(IQ1_S, dec_iq1_s) X(IQ4_NL, dec_iq4_nl)   \
    X(IQ3_S, dec_iq3_s) X(IQ2_S, dec_iq2_s) X(IQ4_XS, dec_iq4_xs) X(IQ1_M, dec_iq1_m)         \
    X(TQ1_0, dec_tq1_0) X(TQ2_0, dec_tq2_0) X(MXFP4, dec_mxfp4) X(NVFP4, dec_nvfp4)

static inline int is_lowbit(int fmt) {
#define LOWBIT_CASE(f, dec) case f:
    switch (fmt) {
    LOWBIT_FORMATS(LOWBIT_CASE) return 1;
    default: return 0;
    }
#undef LOWBIT_CASE
}

static inline __attribute__((always_inline)) void dec_lowbit(const int fmt, const uint8_t *b, int8_t *q,
                                                              float *sc, float *mn) {
#define LOWBIT_DECODE(f, dec) case f: dec(b, q, sc, mn); break;
    switch (fmt) {
    LOWBIT_FORMATS(LOWBIT_DECODE)
    default: break;
    }
#undef LOWBIT_DECODE
}

/* n consecutive blocks (bb bytes each) into q and the per-16 scales and mins, in one call.
 * Not inlined: one copy of every decoder for all callers (a copy inlined into each doubled
 * the kernels' compile time and took cc1 to 190 MB, which a 256 MB node pays when it builds
 * them), called once per 16 units of a row */
static __attribute__((noinline)) void dec_lowbit_run(int fmt, const uint8_t *b, int n, int8_t *q, float *sc,
                                                     float *mn) {
    const int bb = lowbit_bytes(fmt), e = lowbit_elems(fmt);
#define LOWBIT_RUN(f, dec) \
    case f: for (int i = 0; i < n; i++) dec(b + i * bb, q + i * e, sc + i * (e / 16), mn + i * (e / 16)); break;
    switch (fmt) {
    LOWBIT_FORMATS(LOWBIT_RUN)
    default: break;
    }
#undef LOWBIT_RUN
}

static inline void decode_lowbit(int fmt, const uint8_t *b, decoded *o) {
    dec_lowbit_run(fmt, b, 1, o->q, o->scale, o->min);
}

/* Element j of a row of this file's formats: scale * q - min, as dequantizing gives it (an
 * outlier's weight: its block decoded, one value read) */
static inline float lowbit_weight_at(int fmt, const uint8_t *row, int64_t j) {
    const int n = lowbit_elems(fmt);
    decoded dw;
    decode_lowbit(fmt, row + lowbit_bytes(fmt) * (j / n), &dw);
    const int e = (int)(j % n);
    return dw.scale[e / 16] * (float)dw.q[e] - dw.min[e / 16];
}
