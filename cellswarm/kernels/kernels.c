/* Fused kernels on packed GGUF blocks: y = x @ W.T without unpacking W to float32.
 *
 * Activations are quantized once per call to int8 in blocks of 32 (a float scale per block,
 * plus the int sum of every 16 values), as llama.cpp's Q8_0/Q8_K dot products do. Each weight
 * block is then decoded to int8 values with a scale and a min for every 16 weights, and
 * multiplied with integer arithmetic; floats only combine the per-16 integer sums:
 *
 *     y = sum_g  xd[g/2] * (scale_g * sum(wq * xq over g) - min_g * sum(xq over g))
 *
 * Every weight byte is read once per call, whatever the batch (1..16 rows of x share each
 * decoded block). Rows of W are split over OpenMP threads. Q4_0, Q8_0, Q4_K and Q6_K weights
 * may also come repacked in groups of 16 rows (cs_repack, "in 16-row groups" below), read in
 * the same arithmetic as the file's layout: the same bits. Written as plain C loops with
 * constant trip counts so gcc vectorizes them for the host (-O3 -march=native): AVX2/AVX-512
 * on x86-64, NEON on aarch64, VSX on ppc64.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QUANT_ZMM 1 /* cs_quantize_act in 16-lane registers */
#endif
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q2_K = 10, Q4_K = 12, Q6_K = 14, BF16 = 30 };
/* The same formats repacked in 16-row groups (cs_repack: only on CPUs that have the kernels
 * for them; elsewhere never made), and the format of a row after a weight's last group. */
enum { Q4_0R = 102, Q8_0R = 108, Q4_KR = 112, Q6_KR = 114 };
#define IS_R16(f) ((f) == Q4_0R || (f) == Q8_0R || (f) == Q4_KR || (f) == Q6_KR)
#define R16_NATURAL(f) \
    ((f) == Q4_0R ? Q4_0 : (f) == Q8_0R ? Q8_0 : (f) == Q4_KR ? Q4_K : (f) == Q6_KR ? Q6_K : (f))
#define MAX_BATCH 16

static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- threads when cores are busy ----------------------------------------------------------
 * A parallel loop ends when its last thread does. When another process holds a core, one of
 * our threads is preempted for a whole scheduler slice (milliseconds), holding its chunk or
 * not yet at the loop, and the loop waits for it while the other thread idles: two threads
 * ran ten times slower than one beside a busy process. So every loop notes how long the first
 * thread out of work waited for the last, and a window of loops (GOV_WINDOW_S of them) sums
 * those waits against the loops' whole time. When more than GOV_LOST of it was waiting, a thread is
 * losing its core again and again, and loops run on one thread for the next GOV_SOLO_S, then
 * two are tried again for a window (so a lasting neighbour costs a few percent). One late thread does not decide it: on an idle
 * virtual machine a vCPU is sometimes held back for a millisecond or two (seen here every
 * few dozen tokens), and going solo for each of those cost two threads a third of their
 * speed. */
#include <time.h>
enum { GOV_MAX_THREADS = 256 };
#define GOV_SOLO_S 1.0
#define GOV_WINDOW_S 0.05 /* long enough that one held-back vCPU is a few percent of it */
#define GOV_LOST 0.25
static double gov_solo_until;         /* loops run on one thread until this time */
static double gov_wait_s, gov_span_s; /* the window's summed waits and whole loop times */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int gov_threads(void) { /* threads for the next parallel loop */
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
    if (nt > 1 && now_s() < gov_solo_until) return 1;
    return nt < GOV_MAX_THREADS ? nt : GOV_MAX_THREADS;
#else
    return 1;
#endif
}

/* after a loop that started at t0: each thread's time out of work in done[0..n). Called by
 * the thread that ran the loop (loops are not nested), so the window needs no lock. */
static void gov_note(double t0, const double *done, int n) {
    double first = done[0], last = done[0];
    for (int i = 1; i < n; i++) {
        first = done[i] < first ? done[i] : first;
        last = done[i] > last ? done[i] : last;
    }
    gov_wait_s += last - first;
    gov_span_s += last - t0;
    if (gov_span_s < GOV_WINDOW_S) return;
    if (gov_wait_s > GOV_LOST * gov_span_s) gov_solo_until = now_s() + GOV_SOLO_S;
    gov_wait_s = gov_span_s = 0.0;
}

/* threads for an elementwise loop over n values: below ELEMENTS_PAR a fork/join costs more
 * than the split saves */
#define ELEMENTS_PAR 65536
static int gov_threads_for(int64_t n) { return n >= ELEMENTS_PAR ? gov_threads() : 1; }

int cs_solo(void) { return now_s() < gov_solo_until; } /* benches: on one thread now? */

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ---- activations -------------------------------------------------------------------- */

/* x: (nx, cols) float32 -> xq int8 (nx, cols), xd (nx, cols/32), xs (nx, cols/16).
 * A block holding a NaN or an infinity gets a NaN scale (and zero values), so every output
 * it touches is NaN, as in float math: fmaxf skips NaNs and (int8_t)NaN is undefined, which
 * would otherwise turn a corrupt activation into finite garbage downstream.
 * Written without libm calls so gcc vectorizes it (roundf and fmaxf were calls per value,
 * ~20 us for 4096 values: more than a small matvec): the largest |x| is an integer max over
 * the bits with the sign cleared (the order of non-negative floats), which also says whether
 * the block holds an all-ones exponent; roundf is truncation plus a step where the dropped
 * fraction is at least one half (exact: |x * id| <= 127 + a rounding). */
void cs_quantize_act(const float *x, int64_t nx, int64_t cols, int8_t *xq, float *xd,
                     int32_t *xs) {
    const int64_t nb = cols / 32;
    for (int64_t r = 0; r < nx; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * cols + b * 32;
            uint32_t top = 0;
#ifdef QUANT_ZMM
            const __m512i sign = _mm512_set1_epi32(0x7FFFFFFF);
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            top = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(v0), sign),
                                                           _mm512_and_si512(_mm512_castps_si512(v1), sign)));
#else
            uint32_t u[32];
            memcpy(u, v, sizeof u);
            for (int i = 0; i < 32; i++) {
                const uint32_t m = u[i] & 0x7FFFFFFFu;
                top = m > top ? m : top;
            }
#endif
            int8_t *q = xq + r * cols + b * 32;
            if (top >= 0x7F800000u) { /* NaN or infinity */
                memset(q, 0, 32);
                xd[r * nb + b] = NAN;
                xs[r * 2 * nb + 2 * b] = xs[r * 2 * nb + 2 * b + 1] = 0;
                continue;
            }
            float amax;
            memcpy(&amax, &top, 4);
            const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
            xd[r * nb + b] = d;
#ifdef QUANT_ZMM /* the same arithmetic, 16 lanes at a time */
            const __m512 vid = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f), mhalf = _mm512_set1_ps(-0.5f);
            const __m512 y0 = _mm512_mul_ps(v0, vid), y1 = _mm512_mul_ps(v1, vid);
            __m512i k0 = _mm512_cvttps_epi32(y0), k1 = _mm512_cvttps_epi32(y1);
            const __m512 f0 = _mm512_sub_ps(y0, _mm512_cvtepi32_ps(k0)), f1 = _mm512_sub_ps(y1, _mm512_cvtepi32_ps(k1));
            const __m512i one = _mm512_set1_epi32(1);
            k0 = _mm512_mask_add_epi32(k0, _mm512_cmp_ps_mask(f0, half, _CMP_GE_OQ), k0, one);
            k0 = _mm512_mask_sub_epi32(k0, _mm512_cmp_ps_mask(f0, mhalf, _CMP_LE_OQ), k0, one);
            k1 = _mm512_mask_add_epi32(k1, _mm512_cmp_ps_mask(f1, half, _CMP_GE_OQ), k1, one);
            k1 = _mm512_mask_sub_epi32(k1, _mm512_cmp_ps_mask(f1, mhalf, _CMP_LE_OQ), k1, one);
            _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(k0));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(k1));
            xs[r * 2 * nb + 2 * b] = _mm512_reduce_add_epi32(k0);
            xs[r * 2 * nb + 2 * b + 1] = _mm512_reduce_add_epi32(k1);
            continue;
#endif
            int32_t t[32];
            for (int i = 0; i < 32; i++) {
                const float y = v[i] * id;
                const int32_t k = (int32_t)y; /* toward zero */
                const float f = y - (float)k;
                t[i] = k + (f >= 0.5f) - (f <= -0.5f);
            }
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 32; i++) q[i] = (int8_t)t[i];
            for (int i = 0; i < 16; i++) { s0 += t[i]; s1 += t[16 + i]; }
            xs[r * 2 * nb + 2 * b] = s0;
            xs[r * 2 * nb + 2 * b + 1] = s1;
        }
    }
}

/* ---- weight blocks: decode to int8 + per-16 scale and min -------------------------------- */

/* A decoded block of `n` weights (32 or 256): w = scale[g] * q - min[g] for group g = i/16. */
typedef struct { int8_t q[256]; float scale[16]; float min[16]; } decoded;

static inline void decode_q8_0(const uint8_t *b, decoded *o) {
    const float d = fp16_to_f32(rd16(b));
    memcpy(o->q, b + 2, 32);
    o->scale[0] = o->scale[1] = d;
    o->min[0] = o->min[1] = 0.0f;
}

static inline void decode_q4_0(const uint8_t *b, decoded *o) {
    const float d = fp16_to_f32(rd16(b));
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        o->q[j] = (int8_t)((qs[j] & 0xF) - 8);
        o->q[j + 16] = (int8_t)((qs[j] >> 4) - 8);
    }
    o->scale[0] = o->scale[1] = d;
    o->min[0] = o->min[1] = 0.0f;
}

static inline void decode_q4_1(const uint8_t *b, decoded *o) {
    const float d = fp16_to_f32(rd16(b)), m = fp16_to_f32(rd16(b + 2));
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        o->q[j] = (int8_t)(qs[j] & 0xF);
        o->q[j + 16] = (int8_t)(qs[j] >> 4);
    }
    o->scale[0] = o->scale[1] = d;
    o->min[0] = o->min[1] = -m; /* w = d*q + m */
}

static inline void k4_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static inline void decode_q4_k(const uint8_t *b, decoded *o) {
    const float d = fp16_to_f32(rd16(b)), dmin = fp16_to_f32(rd16(b + 2));
    const uint8_t *scales = b + 4, *qs = b + 16;
    for (int c = 0; c < 4; c++) { /* 64 weights: 32 low nibbles, then 32 high nibbles */
        const uint8_t *q = qs + 32 * c;
        for (int l = 0; l < 32; l++) {
            o->q[64 * c + l] = (int8_t)(q[l] & 0xF);
            o->q[64 * c + 32 + l] = (int8_t)(q[l] >> 4);
        }
        uint8_t sc, m;
        for (int h = 0; h < 2; h++) {
            k4_scale_min(2 * c + h, scales, &sc, &m);
            const int g = 4 * c + 2 * h;
            o->scale[g] = o->scale[g + 1] = d * sc;
            o->min[g] = o->min[g + 1] = dmin * m;
        }
    }
}

static inline void decode_q6_k(const uint8_t *b, decoded *o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = fp16_to_f32(rd16(b + 208));
    for (int n = 0; n < 2; n++) {
        const uint8_t *l8 = ql + 64 * n, *h8 = qh + 32 * n;
        int8_t *y = o->q + 128 * n;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)(((l8[l] & 0xF) | (((h8[l] >> 0) & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4)) - 32);
        }
    }
    for (int g = 0; g < 16; g++) {
        o->scale[g] = d * sc[g];
        o->min[g] = 0.0f;
    }
}

static inline void decode_q2_k(const uint8_t *b, decoded *o) {
    const uint8_t *scales = b, *qs = b + 16;
    const float d = fp16_to_f32(rd16(b + 80)), dmin = fp16_to_f32(rd16(b + 82));
    for (int n = 0; n < 2; n++) {
        const uint8_t *q = qs + 32 * n;
        for (int j = 0; j < 4; j++) {
            const int shift = 2 * j;
            int8_t *y = o->q + 128 * n + 32 * j;
            for (int l = 0; l < 32; l++) y[l] = (int8_t)((q[l] >> shift) & 3);
        }
    }
    for (int g = 0; g < 16; g++) {
        o->scale[g] = d * (scales[g] & 0xF);
        o->min[g] = dmin * (scales[g] >> 4);
    }
}

static inline int block_elems(int fmt) { return fmt == Q2_K || fmt == Q4_K || fmt == Q6_K ? 256 : 32; }

static inline void decode(int fmt, const uint8_t *b, decoded *o) {
    switch (fmt) {
    case Q8_0: decode_q8_0(b, o); break;
    case Q4_0: decode_q4_0(b, o); break;
    case Q4_1: decode_q4_1(b, o); break;
    case Q4_K: decode_q4_k(b, o); break;
    case Q6_K: decode_q6_k(b, o); break;
    default: decode_q2_k(b, o); break;
    }
}


/* ---- x86-64 AVX2 (and AVX-512 VNNI) row kernels -------------------------------------------
 * One function per format computes `nx` dot products of one packed row with the quantized
 * activations, keeping 8-lane float accumulators and summing them once per row. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_SIMD_ROWS 1

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float h2f(const uint8_t *p) {
#ifdef __F16C__
    return _cvtsh_ss(rd16(p));
#else
    return fp16_to_f32(rd16(p));
#endif
}

/* unsigned bytes u (0..127 fine, values < 128 here) x signed bytes s -> 8 x int32 */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* signed x signed: move the sign of a onto b, so the left operand is |a| (unsigned) */
static inline __m256i dot_s8s8(__m256i a, __m256i b) {
    return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

static inline __m256i load_nibbles16(const uint8_t *qs) { /* 16 bytes -> 32 values 0..15 */
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

typedef struct {
    const int8_t *xq; const float *xd; const int32_t *xs; int64_t cols; int64_t nx;
    const float *xsum; /* per 32 block: xd * sum(xq), the float sum of the block */
    const int8_t *xt;  /* xq with every 4 blocks' 4-byte groups interleaved (see z32), or NULL */
    const uint8_t (*qidx)[64]; /* byte permutes for z32's quads (quad_idx), with xt */
} acts;

static void row_q8_0_1(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    /* one activation row: accumulators stay in registers, two chains for the FMA latency */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *p0 = row + 34 * b, *p1 = p0 + 34;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p0 + 2));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p1 + 2));
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->xq + 32 * b));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a->xq + 32 * b + 32));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(p0) * a->xd[b]), _mm256_cvtepi32_ps(dot_s8s8(w0, x0)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(p1) * a->xd[b + 1]), _mm256_cvtepi32_ps(dot_s8s8(w1, x1)), acc1);
    }
    for (; b < nb; b++) {
        const uint8_t *p0 = row + 34 * b;
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p0 + 2));
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->xq + 32 * b));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(h2f(p0) * a->xd[b]), _mm256_cvtepi32_ps(dot_s8s8(w0, x0)), acc0);
    }
    out[0] = hsum(_mm256_add_ps(acc0, acc1));
}

static void row_q8_0(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    if (a->nx == 1) { row_q8_0_1(row, nb, a, out); return; }
    __m256 acc[MAX_BATCH];
    for (int64_t k = 0; k < a->nx; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 34 * b;
        const float d = h2f(blk);
        const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        const __m256i wa = _mm256_sign_epi8(w, w);
        for (int64_t k = 0; k < a->nx; k++) {
            const int64_t o = k * a->cols + 32 * b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + o));
            const __m256i dot = dot_u8s8(wa, _mm256_sign_epi8(x, w));
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->xd[o / 32]), _mm256_cvtepi32_ps(dot), acc[k]);
        }
    }
    for (int64_t k = 0; k < a->nx; k++) out[k] = hsum(acc[k]);
}

/* Q4_0 (w = d*(q - 8)) and Q4_1 (w = d*q + m): both as unsigned nibbles times signed
 * activations, the offset folded into the block's activation sum. */
static void row_q4_1row(const uint8_t *row, int64_t nb, const acts *a, float *out, int has_min) {
    const int bb = has_min ? 20 : 18, qo = has_min ? 4 : 2;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float mins = 0.0f;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *p0 = row + bb * b, *p1 = p0 + bb;
        const float d0 = h2f(p0), d1 = h2f(p1);
        const float m0 = has_min ? h2f(p0 + 2) : -8.0f * d0, m1 = has_min ? h2f(p1 + 2) : -8.0f * d1;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->xq + 32 * b));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a->xq + 32 * b + 32));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * a->xd[b]), _mm256_cvtepi32_ps(dot_u8s8(load_nibbles16(p0 + qo), x0)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * a->xd[b + 1]), _mm256_cvtepi32_ps(dot_u8s8(load_nibbles16(p1 + qo), x1)), acc1);
        mins += m0 * a->xsum[b] + m1 * a->xsum[b + 1];
    }
    for (; b < nb; b++) {
        const uint8_t *p0 = row + bb * b;
        const float d0 = h2f(p0), m0 = has_min ? h2f(p0 + 2) : -8.0f * d0;
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->xq + 32 * b));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * a->xd[b]), _mm256_cvtepi32_ps(dot_u8s8(load_nibbles16(p0 + qo), x0)), acc0);
        mins += m0 * a->xsum[b];
    }
    out[0] = hsum(_mm256_add_ps(acc0, acc1)) + mins;
}

static void row_q4(const uint8_t *row, int64_t nb, const acts *a, float *out, int has_min) {
    if (a->nx == 1) { row_q4_1row(row, nb, a, out, has_min); return; }
    const int bb = has_min ? 20 : 18;
    __m256 acc[MAX_BATCH];
    float mins[MAX_BATCH] = {0};
    for (int64_t k = 0; k < a->nx; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + bb * b;
        const float d = h2f(blk), m = has_min ? h2f(blk + 2) : -8.0f * d;
        const __m256i w = load_nibbles16(blk + (has_min ? 4 : 2));
        for (int64_t k = 0; k < a->nx; k++) {
            const int64_t o = k * a->cols + 32 * b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + o));
            const float dx = a->xd[o / 32];
            acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(dot_u8s8(w, x)), acc[k]);
            mins[k] += m * a->xsum[o / 32];
        }
    }
    for (int64_t k = 0; k < a->nx; k++) out[k] = hsum(acc[k]) + mins[k];
}

static inline void k4_unpack(const uint8_t *s, float *sc, float *m) {
    uint8_t a, b;
    for (int j = 0; j < 8; j++) {
        k4_scale_min(j, s, &a, &b);
        sc[j] = a;
        m[j] = b;
    }
}

/* The 12 packed bytes of 6-bit scales and mins -> 8 scales (bytes 0-7), 8 mins (bytes 8-15),
 * the bit shuffle llama.cpp's kernels use. */
static inline void k4_unpack_bytes(const uint8_t *s, uint32_t u[4]) {
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t t = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = t;
    u[0] &= k1;
}

static void row_q4_k_1(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), minv = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 144 * b;
        uint32_t u[4];
        k4_unpack_bytes(blk + 4, u);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u)));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2))));
        const __m256 f = _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_loadu_ps(a->xd + 8 * b)), _mm256_set1_ps(h2f(blk)));
        minv = _mm256_fmadd_ps(_mm256_mul_ps(mn, _mm256_set1_ps(h2f(blk + 2))), _mm256_loadu_ps(a->xsum + 8 * b), minv);
        const int8_t *xq = a->xq + 256 * b;
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            const __m256i lo = _mm256_and_si256(q, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * c));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32));
            const __m256 f0 = _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(2 * c));
            const __m256 f1 = _mm256_permutevar8x32_ps(f, _mm256_set1_epi32(2 * c + 1));
            acc0 = _mm256_fmadd_ps(f0, _mm256_cvtepi32_ps(dot_u8s8(lo, x0)), acc0);
            acc1 = _mm256_fmadd_ps(f1, _mm256_cvtepi32_ps(dot_u8s8(hi, x1)), acc1);
        }
    }
    out[0] = hsum(_mm256_add_ps(acc0, acc1)) - hsum(minv);
}

static void row_q4_k(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    if (a->nx == 1) { row_q4_k_1(row, nb, a, out); return; }
    __m256 acc[MAX_BATCH];
    float mins[MAX_BATCH] = {0};
    for (int64_t k = 0; k < a->nx; k++) acc[k] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 144 * b;
        const float d = h2f(blk), dmin = h2f(blk + 2);
        for (int c = 0; c < 4; c++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            const __m256i lo = _mm256_and_si256(q, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            uint8_t sc0, m0, sc1, m1;
            k4_scale_min(2 * c, blk + 4, &sc0, &m0);
            k4_scale_min(2 * c + 1, blk + 4, &sc1, &m1);
            for (int64_t k = 0; k < a->nx; k++) {
                const int64_t o = k * a->cols + 256 * b + 64 * c;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->xq + o));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a->xq + o + 32));
                const float dx0 = a->xd[o / 32], dx1 = a->xd[o / 32 + 1];
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc0 * dx0), _mm256_cvtepi32_ps(dot_u8s8(lo, x0)), acc[k]);
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc1 * dx1), _mm256_cvtepi32_ps(dot_u8s8(hi, x1)), acc[k]);
                mins[k] += dmin * (m0 * dx0 * (float)(a->xs[o / 16] + a->xs[o / 16 + 1]) +
                                   m1 * dx1 * (float)(a->xs[o / 16 + 2] + a->xs[o / 16 + 3]));
            }
        }
    }
    for (int64_t k = 0; k < a->nx; k++) out[k] = hsum(acc[k]) - mins[k];
}

/* 8 int32 lanes of a 32-value dot: lanes 0-3 come from values 0-15, lanes 4-7 from 16-31 */
static inline __m256 scale_halves(__m256i dot, float s0, float s1) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set_ps(s1, s1, s1, s1, s0, s0, s0, s0));
}

static void row_q6_k(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    __m256 acc[MAX_BATCH];
    for (int64_t k = 0; k < a->nx; k++) acc[k] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03), m30 = _mm256_set1_epi8(0x30);
    const __m256i m0c = _mm256_set1_epi8(0x0C), off = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 210 * b;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = h2f(blk + 208);
        for (int n = 0; n < 2; n++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(h, m0c), 2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
            for (int j = 0; j < 4; j++) q[j] = _mm256_sub_epi8(q[j], off);
            for (int64_t k = 0; k < a->nx; k++) {
                for (int j = 0; j < 4; j++) {
                    const int64_t o = k * a->cols + 256 * b + 128 * n + 32 * j;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + o));
                    const int g = 8 * n + 2 * j;
                    const __m256 v = scale_halves(dot_s8s8(q[j], x), (float)sc[g], (float)sc[g + 1]);
                    acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->xd[o / 32]), v, acc[k]);
                }
            }
        }
    }
    for (int64_t k = 0; k < a->nx; k++) out[k] = hsum(acc[k]);
}

static void row_q2_k(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    __m256 acc[MAX_BATCH];
    float mins[MAX_BATCH] = {0};
    for (int64_t k = 0; k < a->nx; k++) acc[k] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(0x03);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 84 * b, *scales = blk;
        const float d = h2f(blk + 80), dmin = h2f(blk + 82);
        for (int n = 0; n < 2; n++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * n));
            for (int j = 0; j < 4; j++) {
                const __m256i w = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                const int g = 8 * n + 2 * j;
                for (int64_t k = 0; k < a->nx; k++) {
                    const int64_t o = k * a->cols + 256 * b + 128 * n + 32 * j;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + o));
                    const float dx = a->xd[o / 32];
                    const __m256 v = scale_halves(dot_u8s8(w, x), (float)(scales[g] & 0xF), (float)(scales[g + 1] & 0xF));
                    acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), v, acc[k]);
                    mins[k] += dmin * dx * ((scales[g] >> 4) * (float)a->xs[o / 16] +
                                            (scales[g + 1] >> 4) * (float)a->xs[o / 16 + 1]);
                }
            }
        }
    }
    for (int64_t k = 0; k < a->nx; k++) out[k] = hsum(acc[k]) - mins[k];
}

/* ---- AVX-512 VNNI row kernels ----------------------------------------------------------
 * Why the AVX2 kernels above are slower than memory on Q4/Q6/Q2: per 18-byte Q4_0 block they
 * spend ~20 instructions, half of them scalar (two f16 conversions, scale products, a
 * broadcast, a serial float chain for the offset term): ~4 cycles a block, 16 GB/s of Q4_0
 * on one core where Q8_0's 34-byte blocks at the same cost give 36. Here (measured on one
 * Zen 4 core, rows in L2): Q4_0 ~2.7 cycles a block, Q4_1 ~2.7, Q8_0 ~3.2, Q6_K ~25 and Q2_K
 * ~26 cycles per 256 weights (were 50 and 90):
 * - Q4_0/Q4_1/Q8_0 go by quads of blocks (z32): one byte permute (VBMI) lays 4 blocks' weights
 *   out as lanes of 4 bytes, lane l from block l % 4, matching activations laid out alike once
 *   per call; both halves of the 4 blocks accumulate in the same int32 lanes, and one convert
 *   and one FMA serve 4 blocks. Their f16 scales come 16 blocks at a time by byte permutes
 *   (a gather costs ~1 cycle a block on Zen 4), and the offset / min terms are one FMA per 16
 *   blocks against the activations' block sums. Q8_0's signed weights are read as unsigned
 *   q + 128 (dpbusd multiplies unsigned by signed), the 128 folded into that FMA.
 * - K formats go 64 weights a register; Q6_K's 6-bit weights unsigned, the -32 folded into
 *   the per-16 activation sums; Q4_K's high nibbles multiplied in place (AND 0xF0, 16q,
 *   summed exactly in int32) and their lanes scaled by 1/16 once per row (a power of two).
 * Without VBMI (Cascade Lake) the 32-blocks go by pairs and scales by a gather. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_ZMM_ROWS 1
#ifdef __AVX512VBMI__
#define HAVE_ZMM_VBMI 1 /* byte permutes across a register: quads, scales without a gather */
#endif
#define ZINL static inline __attribute__((always_inline))

ZINL __m512i zdot(__m512i u, __m512i s) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s); }

/* s + u . (the 4 bytes at x, in every lane): the broadcast folded into the instruction's
 * memory operand ({1to16}), which GCC does not do for _mm512_set1_epi32 of a loaded int */
ZINL __m512i dpbusd_bcst(__m512i s, __m512i u, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(u), "m"(*x));
    return s;
}

/* Moving bits within each byte: with GFNI one affine op (a bit matrix per byte) where a shift
 * and a mask take two; 16-bit shifts also carry bits across bytes, which the mask must clear.
 * Row i of the matrix (byte 7 - i of the qword) picks the input bits of output bit i. The
 * weights come out the same integers either way: only the instruction count changes (Q6_K's
 * group kernel issued ~576 vector ops a block, ~270 of them unpacking). */
#define BITS_HI_NIBBLE 0x1020408000000000LL /* in 4..7 -> out 0..3, the rest 0 */
#define BITS_01_TO_45 0x0000000001020000LL  /* in 0,1 -> out 4,5 */
#define BITS_23_TO_45 0x0000000004080000LL  /* in 2,3 -> out 4,5 */
#define BITS_67_TO_45 0x0000000040800000LL  /* in 6,7 -> out 4,5 */
#ifdef __GFNI__
#define BYTE_BITS(v, matrix, shift_left, shift_right, mask) \
    _mm512_gf2p8affine_epi64_epi8((v), _mm512_set1_epi64(matrix), 0)
#else
#define BYTE_BITS(v, matrix, shift_left, shift_right, mask) \
    _mm512_and_si512(_mm512_srli_epi16(_mm512_slli_epi16((v), (shift_left)), (shift_right)), \
                     _mm512_set1_epi8(mask))
#endif

/* lanes 0-7 <- s[i0], lanes 8-15 <- s[i1] (the scales of the two blocks of a pair) */
ZINL __m512i idx_pair(int i0, int i1) {
    return _mm512_set_epi32(i1, i1, i1, i1, i1, i1, i1, i1, i0, i0, i0, i0, i0, i0, i0, i0);
}

/* lanes 4i..4i+3 <- s[g + i]: the scales of four 16-weight groups */
ZINL __m512i idx_quad(int g) {
    return _mm512_set_epi32(g + 3, g + 3, g + 3, g + 3, g + 2, g + 2, g + 2, g + 2, g + 1, g + 1,
                            g + 1, g + 1, g, g, g, g);
}

/* 16-bit lanes: 16 copies of lo (bytes 0-31), then 16 of hi (bytes 32-63) */
ZINL __m512i w16x2(long long lo, long long hi) {
    const long long r = 0x0001000100010001LL;
    return _mm512_set_epi64(hi * r, hi * r, hi * r, hi * r, lo * r, lo * r, lo * r, lo * r);
}

/* f16 field at byte `off` of 16 consecutive blocks `bb` bytes apart (mask: blocks that exist) */
ZINL __m512i gather16(const uint8_t *p, int bb, __mmask16 m) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(bb));
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, (const void *)p, 1);
}
/* The same for 16 whole blocks, without a gather (16 loads, ~1 cycle a block on AMD Zen 4):
 * windows of 128 bytes, each a two-register byte permute (VBMI) picking the 4 bytes at the
 * start of every block it holds; loads never pass the 16th block. */
#ifdef HAVE_ZMM_VBMI
ZINL __m512i fields16(const uint8_t *p, const int bb) {
    const int per = 124 / bb + 1, end = 16 * bb;
    const __m512i i16 = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i r = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int w = 0; w * per < 16; w++) {
        const int st = bb * per * w, n_hi = end - st - 64 < 64 ? end - st - 64 : 64;
        const __m512i lo = _mm512_loadu_si512((const void *)(p + st));
        const __m512i hi = n_hi == 64 ? _mm512_loadu_si512((const void *)(p + st + 64))
                           : n_hi > 0 ? _mm512_maskz_loadu_epi8((1ull << n_hi) - 1, p + st + 64)
                                      : _mm512_setzero_si512();
        const __m512i idx = _mm512_add_epi32(
            _mm512_mullo_epi32(_mm512_sub_epi32(_mm512_mullo_epi32(i16, _mm512_set1_epi32(bb)), _mm512_set1_epi32(st)),
                               _mm512_set1_epi32(0x01010101)), _mm512_set1_epi32(0x03020100));
        const __mmask16 k = (__mmask16)((((1u << per) - 1) << (per * w)) & 0xFFFF);
        r = _mm512_mask_mov_epi32(r, k, _mm512_permutex2var_epi8(lo, idx, hi));
    }
    return r;
}
#else
#define fields16(p, bb) gather16(p, bb, 0xFFFF)
#endif
ZINL __m512 f16_lo(__m512i g) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)); }
ZINL __m512 f16_hi(__m512i g) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))); }

/* Q8_0 (fmt 8), Q4_0 (2), Q4_1 (3): blocks of 32 weights, 16 blocks per scale fetch.
 * Whole groups of 16 blocks go by quads: 4 blocks' weights in one register, 4-byte groups
 * interleaved by one byte permute (lane l holds block l % 4), the activations laid out the
 * same way once per call (`xt`), so the low and high halves of the quad accumulate into the
 * same int32 lanes and one convert + one FMA (scales: lanes 4q..4q+3 broadcast) serve four
 * blocks. Tails (fewer than 16 blocks) go by pairs, in the natural layout: a zmm holds two
 * blocks, lanes 0-7 the first, and their scales are permuted into place. */
ZINL void z32(const uint8_t *row, int64_t nb, const acts *a, float *out, const int fmt,
              const int64_t nx) {
    const int bb = fmt == Q8_0 ? 34 : fmt == Q4_1 ? 20 : 18, qo = fmt == Q4_1 ? 4 : 2;
    const int64_t nbx = a->cols / 32; /* activation blocks per row of x */
    const long long r4 = 0x0004000400040004LL; /* shift 16-bit lanes of 128-bit lanes 1, 3 by 4 */
    const __m512i nib_shift = _mm512_set_epi64(r4, r4, 0, 0, r4, r4, 0, 0);
    __m512 acc[MAX_BATCH], acc1[MAX_BATCH], macc[MAX_BATCH], s[MAX_BATCH];
    for (int64_t k = 0; k < nx; k++) acc[k] = acc1[k] = macc[k] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 m = (__mmask16)(n == 16 ? 0xFFFF : (1u << n) - 1);
        const uint8_t *base = row + bb * b0;
        const __m512i g = n == 16 ? fields16(base, bb) : gather16(base, bb, m);
        const __m512 d = f16_lo(g);
        for (int64_t k = 0; k < nx; k++) {
            s[k] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(m, a->xd + k * nbx + b0));
            /* the offset times the block's activation sum: Q8_0 is read as unsigned q + 128
             * (w = d*(q+128) - 128d), Q4_0 as w = d*q - 8d, Q4_1 as w = d*q + m */
            const __m512 mn = fmt == Q4_1 ? f16_hi(g)
                              : _mm512_mul_ps(d, _mm512_set1_ps(fmt == Q8_0 ? -128.0f : -8.0f));
            macc[k] = _mm512_fmadd_ps(mn, _mm512_maskz_loadu_ps(m, a->xsum + k * nbx + b0), macc[k]);
        }
#ifdef HAVE_ZMM_VBMI
        if (n == 16 && a->xt) { /* four quads of blocks, lanes interleaved (see above z32) */
            const __m512i i0 = _mm512_load_si512((const void *)a->qidx[0]);
            const __m512i i1 = _mm512_load_si512((const void *)a->qidx[1]);
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                const uint8_t *qb = base + 4 * bb * q;
                __m512i lo, hi;
                if (fmt == Q8_0) {
                    const __m512i f = _mm512_set1_epi8(-128);
                    lo = _mm512_xor_si512(_mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)qb), i0,
                                          _mm512_loadu_si512((const void *)(qb + 64))), f);
                    hi = _mm512_xor_si512(_mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)(qb + 8)), i1,
                                          _mm512_loadu_si512((const void *)(qb + 72))), f);
                } else {
                    const __m512i t = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)qb), i0,
                        _mm512_loadu_si512((const void *)(qb + (fmt == Q4_1 ? 16 : 8))));
                    lo = _mm512_and_si512(t, _mm512_set1_epi8(0x0F));
                    hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), _mm512_set1_epi8(0x0F));
                }
                for (int64_t k = 0; k < nx; k++) {
                    const int8_t *xp = a->xt + k * a->cols + 32 * (b0 + 4 * q);
                    const __m512i dot = _mm512_dpbusd_epi32(zdot(lo, _mm512_loadu_si512((const void *)xp)), hi,
                                                            _mm512_loadu_si512((const void *)(xp + 64)));
                    const __m512 sq = _mm512_shuffle_f32x4(s[k], s[k], 0x55 * q);
                    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sq, q & 1 ? acc1[k] : acc[k]);
                    if (q & 1) acc1[k] = v; else acc[k] = v;
                }
            }
            continue;
        }
#endif
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) {
            if (2 * p >= n) break;
            const int two = 2 * p + 1 < n;
            const uint8_t *p0 = base + bb * 2 * p, *p1 = p0 + bb;
            __m512i w;
            if (fmt == Q8_0) { /* signed q -> unsigned q + 128 (a tail block's zeros stay 0) */
                const __m256i lo = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p0 + 2)),
                                                    _mm256_set1_epi8(-128));
                w = two ? _mm512_inserti64x4(_mm512_castsi256_si512(lo),
                                             _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p1 + 2)), _mm256_set1_epi8(-128)), 1)
                        : _mm512_zextsi256_si512(lo);
            } else {
                w = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p0 + qo)));
                if (two) w = _mm512_mask_broadcast_i32x4(w, 0xFF00, _mm_loadu_si128((const __m128i *)(p1 + qo)));
                else w = _mm512_maskz_mov_epi32(0x00FF, w);
                w = _mm512_and_si512(_mm512_srlv_epi16(w, nib_shift), _mm512_set1_epi8(0x0F));
            }
            const __m512i ix = idx_pair(2 * p, 2 * p + 1);
            for (int64_t k = 0; k < nx; k++) {
                const int8_t *xp = a->xq + k * a->cols + 32 * (b0 + 2 * p);
                const __m512i x = two ? _mm512_loadu_si512((const void *)xp)
                                      : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xp);
                const __m512i dot = zdot(w, x);
                const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(ix, s[k]),
                                                 p & 1 ? acc1[k] : acc[k]);
                if (p & 1) acc1[k] = v; else acc[k] = v; /* two chains for the FMA latency */
            }
        }
    }
    for (int64_t k = 0; k < nx; k++) {
        out[k] = _mm512_reduce_add_ps(_mm512_add_ps(acc[k], acc1[k])) + _mm512_reduce_add_ps(macc[k]);
    }
}

/* Q4_K: 144-byte blocks of 256; each 32 bytes of nibbles hold 32 weights (low) + 32 (high). */
ZINL void zq4k(const uint8_t *row, int64_t nb, const acts *a, float *out, const int64_t nx) {
    const int64_t nbx = a->cols / 32;
    const __m512i nib = _mm512_set_epi64(-0x0F0F0F0F0F0F0F10LL, -0x0F0F0F0F0F0F0F10LL,
                                         -0x0F0F0F0F0F0F0F10LL, -0x0F0F0F0F0F0F0F10LL,
                                         0x0F0F0F0F0F0F0F0FLL, 0x0F0F0F0F0F0F0F0FLL,
                                         0x0F0F0F0F0F0F0F0FLL, 0x0F0F0F0F0F0F0F0FLL);
    __m512 acc[MAX_BATCH], s[MAX_BATCH];
    __m256 macc[MAX_BATCH];
    for (int64_t k = 0; k < nx; k++) { acc[k] = _mm512_setzero_ps(); macc[k] = _mm256_setzero_ps(); }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 144 * b;
        uint32_t u[4];
        k4_unpack_bytes(blk + 4, u);
        const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(h2f(blk)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u))));
        const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(h2f(blk + 2)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2)))));
        for (int64_t k = 0; k < nx; k++) {
            s[k] = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(a->xd + k * nbx + 8 * b)));
            macc[k] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(a->xsum + k * nbx + 8 * b), macc[k]);
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i w = _mm512_and_si512(
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c))), nib);
            const __m512i ix = idx_pair(2 * c, 2 * c + 1);
            for (int64_t k = 0; k < nx; k++) {
                const __m512i x = _mm512_loadu_si512((const void *)(a->xq + k * a->cols + 256 * b + 64 * c));
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(zdot(w, x)), _mm512_permutexvar_ps(ix, s[k]), acc[k]);
            }
        }
    }
    const float f = 1.0f / 16;
    const __m512 fold = _mm512_set_ps(f, f, f, f, f, f, f, f, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t k = 0; k < nx; k++)
        out[k] = _mm512_reduce_add_ps(_mm512_mul_ps(acc[k], fold)) - hsum(macc[k]);
}

/* 8 per-32 activation scales -> 16 per-16 lanes (each twice) */
ZINL __m512 xd_groups(const float *xd) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                 _mm512_castps256_ps512(_mm256_loadu_ps(xd)));
}

/* Q6_K: 210-byte blocks; weights as unsigned 0..63, the -32 folded into the per-16 sums. */
ZINL void zq6k(const uint8_t *row, int64_t nb, const acts *a, float *out, const int64_t nx) {
    const int64_t nbx = a->cols / 32, ngx = a->cols / 16;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    /* per 16-bit lane: the low 32 bytes (weights 0-31 of a 64) shift by the first count */
    const __m512i shl = w16x2(4, 2), shr = w16x2(0, 2);
    __m512 acc[MAX_BATCH], macc[MAX_BATCH], s[MAX_BATCH];
    for (int64_t k = 0; k < nx; k++) acc[k] = macc[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 210 * b;
        const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(h2f(blk + 208)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        for (int64_t k = 0; k < nx; k++) {
            s[k] = _mm512_mul_ps(sc, xd_groups(a->xd + k * nbx + 8 * b));
            const __m512i xs = _mm512_loadu_si512((const void *)(a->xs + k * ngx + 16 * b));
            macc[k] = _mm512_fmadd_ps(s[k], _mm512_cvtepi32_ps(xs), macc[k]);
        }
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) {
            const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * n));
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
            /* weights 0-63 of this half: low nibbles | bits (h >> 0 | h >> 2) & 3, as << 4 */
            const __m512i wa = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(h, shl), m30));
            /* weights 64-127: high nibbles | (h >> 4 | h >> 6) & 3, as << 4 */
            const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                               _mm512_and_si512(_mm512_srlv_epi16(h, shr), m30));
            const __m512i ia = idx_quad(8 * n), ib = idx_quad(8 * n + 4);
            for (int64_t k = 0; k < nx; k++) {
                const int8_t *xp = a->xq + k * a->cols + 256 * b + 128 * n;
                const __m512i x0 = _mm512_loadu_si512((const void *)xp), x1 = _mm512_loadu_si512((const void *)(xp + 64));
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(zdot(wa, x0)), _mm512_permutexvar_ps(ia, s[k]), acc[k]);
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(zdot(wb, x1)), _mm512_permutexvar_ps(ib, s[k]), acc[k]);
            }
        }
    }
    for (int64_t k = 0; k < nx; k++)
        out[k] = _mm512_reduce_add_ps(acc[k]) - 32.0f * _mm512_reduce_add_ps(macc[k]);
}

/* Q2_K: 84-byte blocks; 2-bit weights, 4-bit scale and min per 16. */
ZINL void zq2k(const uint8_t *row, int64_t nb, const acts *a, float *out, const int64_t nx) {
    const int64_t nbx = a->cols / 32, ngx = a->cols / 16;
    const __m512i m3 = _mm512_set1_epi8(0x03), m4 = _mm512_set1_epi32(0x0F);
    __m512 acc[MAX_BATCH], macc[MAX_BATCH], s[MAX_BATCH];
    for (int64_t k = 0; k < nx; k++) acc[k] = macc[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 84 * b;
        const __m512i sc8 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk));
        const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(h2f(blk + 80)), _mm512_cvtepi32_ps(_mm512_and_si512(sc8, m4)));
        const __m512 mn = _mm512_mul_ps(_mm512_set1_ps(h2f(blk + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc8, 4)));
        for (int64_t k = 0; k < nx; k++) {
            const __m512 xd = xd_groups(a->xd + k * nbx + 8 * b);
            s[k] = _mm512_mul_ps(sc, xd);
            const __m512i xs = _mm512_loadu_si512((const void *)(a->xs + k * ngx + 16 * b));
            macc[k] = _mm512_fmadd_ps(_mm512_mul_ps(mn, xd), _mm512_cvtepi32_ps(xs), macc[k]);
        }
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) {
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * n)));
#pragma GCC unroll 2
            for (int jj = 0; jj < 2; jj++) { /* shifts 2j (low half) and 2j+2 (high half), j = 2jj */
                const __m512i sh16 = w16x2(4 * jj, 4 * jj + 2);
                const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(q, sh16), m3);
                const __m512i ix = idx_quad(8 * n + 4 * jj);
                for (int64_t k = 0; k < nx; k++) {
                    const __m512i x = _mm512_loadu_si512((const void *)(a->xq + k * a->cols + 256 * b + 128 * n + 64 * jj));
                    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(zdot(w, x)), _mm512_permutexvar_ps(ix, s[k]), acc[k]);
                }
            }
        }
    }
    for (int64_t k = 0; k < nx; k++)
        out[k] = _mm512_reduce_add_ps(acc[k]) - _mm512_reduce_add_ps(macc[k]);
}

/* nx == 1 (decode) gets its own copy with the batch loops gone */
#define ZROW(name, call1, calln) \
    static void name(const uint8_t *row, int64_t nb, const acts *a, float *out) { \
        if (a->nx == 1) call1; else calln; }
#ifdef HAVE_ZMM_VBMI /* below, in the arithmetic the 16-row groups share */
static void zrow_q4_0(const uint8_t *row, int64_t nb, const acts *a, float *out);
static void zrow_q8_0(const uint8_t *row, int64_t nb, const acts *a, float *out);
static void zrow_q4_k(const uint8_t *row, int64_t nb, const acts *a, float *out);
static void zrow_q6_k(const uint8_t *row, int64_t nb, const acts *a, float *out);
#else
ZROW(zrow_q4_k, zq4k(row, nb, a, out, 1), zq4k(row, nb, a, out, a->nx))
ZROW(zrow_q8_0, z32(row, nb, a, out, Q8_0, 1), z32(row, nb, a, out, Q8_0, a->nx))
ZROW(zrow_q4_0, z32(row, nb, a, out, Q4_0, 1), z32(row, nb, a, out, Q4_0, a->nx))
ZROW(zrow_q6_k, zq6k(row, nb, a, out, 1), zq6k(row, nb, a, out, a->nx))
#endif
ZROW(zrow_q4_1, z32(row, nb, a, out, Q4_1, 1), z32(row, nb, a, out, Q4_1, a->nx))
ZROW(zrow_q2_k, zq2k(row, nb, a, out, 1), zq2k(row, nb, a, out, a->nx))

/* z32's quads: the activations of every 4 blocks as 16 lanes of 4 bytes, lane l = block l % 4,
 * bytes 4(l/4).. of its first half, then the same for the second half; and the byte permutes
 * that lay the weights out alike (from two loads: [0, 64) and [w2, w2 + 64) of the quad). */
static uint8_t QIDX[3][2][64] __attribute__((aligned(64))); /* Q8_0, Q4_0, Q4_1 */

static void quad_idx_fill(int fmt, uint8_t idx[2][64]) {
    const int bb = fmt == Q8_0 ? 34 : fmt == Q4_1 ? 20 : 18, qo = fmt == Q4_1 ? 4 : 2;
    const int w2 = fmt == Q4_1 ? 16 : 8;
    for (int m = 0; m < 64; m++) {
        const int l = m / 4, j = l % 4, i = 4 * (l / 4) + m % 4, o = bb * j + qo + i;
        if (fmt == Q8_0) { /* windows [0, 128) for weights 0-15, [8, 136) for 16-31 */
            idx[0][m] = (uint8_t)o;
            idx[1][m] = (uint8_t)(o + 16 - 8);
        } else { /* nibble bytes 0-15 of each block: a 4-byte group from the window holding it */
            idx[0][m] = (uint8_t)(bb * j + qo + 4 * (l / 4) + 3 < 64 ? o : 64 + o - w2);
            idx[1][m] = 0;
        }
    }
}

__attribute__((constructor)) static void quad_idx_init(void) {
    quad_idx_fill(Q8_0, QIDX[0]);
    quad_idx_fill(Q4_0, QIDX[1]);
    quad_idx_fill(Q4_1, QIDX[2]);
}

/* The permutes for a format with quads, or NULL (other formats). */
static const uint8_t (*quad_idx(int fmt))[64] {
#ifndef HAVE_ZMM_VBMI
    if (fmt >= 0) return NULL; /* the weights' byte permute needs VBMI */
#endif
    return fmt == Q8_0 ? QIDX[0] : fmt == Q4_0 ? QIDX[1] : fmt == Q4_1 ? QIDX[2] : NULL;
}

/* nx rows of cols activations, each interleaved in whole 128-byte groups from its start */
static void quad_acts(int64_t nx, int64_t cols, const int8_t *xq, int8_t *xt) {
    const __m512i lo = _mm512_set_epi32(27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    for (int64_t k = 0; k < nx; k++)
        for (int64_t c = 0; c + 128 <= cols; c += 128) {
            const int8_t *src = xq + k * cols + c;
            const __m512i a = _mm512_loadu_si512((const void *)src), b = _mm512_loadu_si512((const void *)(src + 64));
            _mm512_storeu_si512((void *)(xt + k * cols + c), _mm512_permutex2var_epi32(a, lo, b));
            _mm512_storeu_si512((void *)(xt + k * cols + c + 64), _mm512_permutex2var_epi32(a, hi, b));
        }
}

static int quad_layout(int fmt, int64_t nx, int64_t cols, const int8_t *xq, int8_t *xt,
                       acts *a) {
    if (!quad_idx(fmt) || cols < 512) return 0;
    quad_acts(nx, cols, xq, xt);
    a->qidx = quad_idx(fmt);
    return 1;
}
#endif

/* ---- Q4_0 and Q8_0 in 16-row groups ---------------------------------------------------
 * Why: a row at a time (z32), a row of a decode-shaped matrix (1024 columns) costs ~48 cycles
 * beyond its blocks (two reductions across lanes, the scale fetch) and every block its own
 * activation shuffle; the layers ran at ~15 GB/s where one core streams ~30. As llama.cpp
 * repacks at load, whole groups of 16 rows are laid out so that one register holds 4 bytes
 * of each of the 16 rows: per 32-block, the 16 rows' f16 scales (32 bytes), then chunks of
 * 64 bytes, chunk k lane r = row r's weight bytes 4k..4k+3 (Q4_0: 4 chunks of nibbles,
 * Q8_0: 8 of int8). A block of 16 rows is then dpbusd against broadcast activations, no
 * reduction across lanes at all, and the group's bytes are one stream (measured on
 * decode-shaped Q4_0 layers: 15 -> 24 GB/s). A group takes exactly the bytes its 16 rows did,
 * so a row outside whole groups sits where it was.
 *
 * One arithmetic for both layouts, so a row is the same bits repacked or not (a sharded run,
 * an expert computed on another node, a tail row): per block b, the exact integer
 * n_b = sum q x with q the signed weight (Q4_0: nibble - 8; read as unsigned u = q + o and
 * n_b = sum u x - o sum x, o = 8 or 128, because dpbusd multiplies unsigned by signed);
 * A[b % 16] = fma((float)n_b, d_b * xd_b, A[b % 16]) in order of b; the row is the tree
 * A[l] + A[l + 8], then + 4, + 2, + 1 (tree16). The 16-row kernel keeps the 16 A's as 16
 * registers (lanes: rows), the one-row kernel as one register (lanes: b % 16). */
#ifdef HAVE_ZMM_VBMI
#define R16_BYTES(f) ((f) == Q8_0 ? 34 : (f) == Q4_K ? 144 : (f) == Q6_K ? 210 : 18) /* one row's block */
#define R16_BLOCK(f) ((f) == Q8_0 ? 544 : (f) == Q4_K ? 2304 : (f) == Q6_K ? 3360 : 288) /* bytes: 16 rows' block */

ZINL float tree16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

/* 16 rows' accumulators (lanes: rows), folded as tree16 folds one row's: out[0..16) */
ZINL void tree16_rows(__m512 *A, float *out) {
    for (int j = 0; j < 8; j++) A[j] = _mm512_add_ps(A[j], A[j + 8]);
    for (int j = 0; j < 4; j++) A[j] = _mm512_add_ps(A[j], A[j + 4]);
    for (int j = 0; j < 2; j++) A[j] = _mm512_add_ps(A[j], A[j + 2]);
    _mm512_storeu_ps(out, _mm512_add_ps(A[0], A[1]));
}

/* the activations' int sums of nn <= 16 blocks (from the per-16 sums xs) as 16 lanes */
ZINL __m512i block_sums16(const int32_t *xs, int64_t nn) {
    const __mmask16 ma = (__mmask16)(nn >= 8 ? 0xFFFF : (1u << (2 * nn)) - 1);
    const __mmask16 mb = (__mmask16)(nn <= 8 ? 0 : nn == 16 ? 0xFFFF : (1u << (2 * nn - 16)) - 1);
    const __m512i a = _mm512_maskz_loadu_epi32(ma, xs), b = _mm512_maskz_loadu_epi32(mb, xs + 16);
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, ev, b),
                            _mm512_permutex2var_epi32(a, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), b));
}

/* one block's sum u x, u the unsigned weights (q + o), any way will do (integers): tails */
ZINL int32_t r16_block_u(const int fmt, const uint8_t *blk, const int8_t *x) {
    const __m256i u = fmt == Q8_0 ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), _mm256_set1_epi8(-128))
                                  : load_nibbles16(blk + 2);
    const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, _mm256_loadu_si256((const __m256i *)x));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* One row in the file's layout (Q4_0 or Q8_0); xt: the quad layout of xq (quad_acts, whole
 * 128-byte groups), or NULL. The int dot products of 4 blocks at a time as z32's quads (lane
 * l: block 4q + l % 4, a quarter of it), folded into one lane per block. */
ZINL float r16_row(const int fmt, const uint8_t *row, int64_t nb, const int8_t *xq,
                   const int8_t *xt, const float *xd, const int32_t *xs) {
    const int bb = fmt == Q8_0 ? 34 : 18, oshift = fmt == Q8_0 ? 7 : 3;
    const uint8_t (*qidx)[64] = fmt == Q8_0 ? QIDX[0] : QIDX[1];
    const __m512i i0 = _mm512_load_si512((const void *)qidx[0]), i1 = _mm512_load_si512((const void *)qidx[1]);
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(-128);
    __m512 A = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t nn = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 mk = (__mmask16)(nn == 16 ? 0xFFFF : (1u << nn) - 1);
        const uint8_t *base = row + bb * b0;
        const __m512i g = nn == 16 ? fields16(base, bb) : gather16(base, bb, mk);
        const __m512 s = _mm512_mul_ps(f16_lo(g), _mm512_maskz_loadu_ps(mk, xd + b0));
        __m512i R = _mm512_setzero_si512();
        const int quads = xt ? (int)(nn / 4) : 0;
        for (int q = 0; q < quads; q++) {
            const uint8_t *qb = base + 4 * bb * q;
            __m512i lo, hi;
            if (fmt == Q8_0) {
                lo = _mm512_xor_si512(_mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)qb), i0,
                                      _mm512_loadu_si512((const void *)(qb + 64))), flip);
                hi = _mm512_xor_si512(_mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)(qb + 8)), i1,
                                      _mm512_loadu_si512((const void *)(qb + 72))), flip);
            } else {
                const __m512i t = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void *)qb), i0,
                                                           _mm512_loadu_si512((const void *)(qb + 8)));
                lo = _mm512_and_si512(t, m4);
                hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), m4);
            }
            const int8_t *xp = xt + 32 * (b0 + 4 * q);
            __m512i dot = _mm512_dpbusd_epi32(zdot(lo, _mm512_loadu_si512((const void *)xp)), hi,
                                              _mm512_loadu_si512((const void *)(xp + 64)));
            /* lane l holds block 4q + l % 4, part l / 4: sum the parts (lanes l, l^4, l^8, l^12) */
            dot = _mm512_add_epi32(dot, _mm512_shuffle_i32x4(dot, dot, 0x4E));
            dot = _mm512_add_epi32(dot, _mm512_shuffle_i32x4(dot, dot, 0xB1));
            R = _mm512_mask_mov_epi32(R, (__mmask16)(0xF << (4 * q)), dot);
        }
        if (4 * quads < nn) {
            int32_t t[16];
            _mm512_storeu_si512((void *)t, R);
            for (int j = 4 * quads; j < nn; j++) t[j] = r16_block_u(fmt, base + bb * j, xq + 32 * (b0 + j));
            R = _mm512_loadu_si512((const void *)t);
        }
        R = _mm512_sub_epi32(R, _mm512_slli_epi32(block_sums16(xs + 2 * b0, nn), oshift)); /* u -> q */
        A = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(R), s, A, mk);
    }
    return tree16(A);
}

/* 16 repacked rows (group g, nb blocks) times one activation row: out[0..16) */
ZINL void r16_group1(const int fmt, const uint8_t *g, int64_t nb, const int8_t *xq,
                     const float *xd, const int32_t *xs, float *out) {
    const int gb = R16_BLOCK(fmt), chunks = fmt == Q8_0 ? 8 : 4, off = fmt == Q8_0 ? 128 : 8;
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(-128);
    __m512 A[16];
    for (int j = 0; j < 16; j++) A[j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const int64_t b = b0 + j;
            if (b >= nb) break;
            const uint8_t *blk = g + gb * b;
            const int32_t *x4 = (const int32_t *)(xq + 32 * b);
            __m512i s0 = _mm512_set1_epi32(-off * (xs[2 * b] + xs[2 * b + 1])), s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < chunks; k++) {
                const __m512i q = _mm512_loadu_si512((const void *)(blk + 32 + 64 * k));
                if (fmt == Q8_0) {
                    const __m512i u = _mm512_xor_si512(q, flip);
                    if (k & 1) s1 = dpbusd_bcst(s1, u, x4 + k);
                    else s0 = dpbusd_bcst(s0, u, x4 + k);
                } else {
                    s0 = dpbusd_bcst(s0, _mm512_and_si512(q, m4), x4 + k);
                    s1 = dpbusd_bcst(s1, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4), x4 + 4 + k);
                }
            }
            const __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk)),
                                           _mm512_set1_ps(xd[b]));
            A[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), s, A[j]);
        }
    }
    tree16_rows(A, out);
}


/* Q4_K in the same scheme, per sub-block t of 32 weights (t = 8 b + j: block b, scale j):
 * n_t = sum q x exact (q 0..15), then A[t % 16] = fma((float)n_t, (d_b * sc_j) * xd_t,
 * A[t % 16]) and A[t % 16] = fnmadd(dmin_b * m_j, xsum_t, A[t % 16]); the same tree.
 * A group's block (2304 bytes): 16 d, 16 dmin (f16), 3 chunks of the 12 scale bytes, 32
 * chunks of the 128 nibble bytes (chunk k lane r = row r's bytes 4k..4k+3). */

/* The 16 lanes' 6-bit scales (m = 0) or mins (m = 1) of sub-block j, from the 3 chunks of a
 * group's scale bytes (k4_scale_min, lanes: rows) */
ZINL __m512i k4_lanes(const __m512i *S, int j, int m) {
    const __m512i b63 = _mm512_set1_epi32(63), b15 = _mm512_set1_epi32(15), b3 = _mm512_set1_epi32(3);
    if (j < 4) return _mm512_and_si512(_mm512_srli_epi32(S[m], 8 * j), b63);
    const __m512i hi = _mm512_srli_epi32(S[2], 8 * (j - 4));
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(S[m], 8 * (j - 4) + 6), b3);
    const __m512i low = m ? _mm512_and_si512(_mm512_srli_epi32(hi, 4), b15) : _mm512_and_si512(hi, b15);
    return _mm512_or_si512(low, _mm512_slli_epi32(top, 4));
}

/* 16 repacked Q4_K rows (nb blocks of 256) times one activation row: out[0..16) */
ZINL void r16_group1_q4k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                         const float *xsum, float *out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 A[16];
    for (int j = 0; j < 16; j++) A[j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 2) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int64_t b = b0 + h;
            if (b >= nb) break;
            const uint8_t *blk = g + 2304 * b;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
            const __m512i S[3] = {_mm512_loadu_si512((const void *)(blk + 64)), _mm512_loadu_si512((const void *)(blk + 128)),
                                  _mm512_loadu_si512((const void *)(blk + 192))};
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const int32_t *x0 = (const int32_t *)(xq + 256 * b + 64 * c), *x1 = x0 + 8;
                __m512i n0 = _mm512_setzero_si512(), n1 = _mm512_setzero_si512();
                __m512i n0b = _mm512_setzero_si512(), n1b = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k += 2) {
                    const __m512i q = _mm512_loadu_si512((const void *)(blk + 256 + 64 * (8 * c + k)));
                    const __m512i r = _mm512_loadu_si512((const void *)(blk + 256 + 64 * (8 * c + k + 1)));
                    n0 = dpbusd_bcst(n0, _mm512_and_si512(q, m4), x0 + k);
                    n1 = dpbusd_bcst(n1, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4), x1 + k);
                    n0b = dpbusd_bcst(n0b, _mm512_and_si512(r, m4), x0 + k + 1);
                    n1b = dpbusd_bcst(n1b, _mm512_and_si512(_mm512_srli_epi16(r, 4), m4), x1 + k + 1);
                }
                const __m512i n[2] = {_mm512_add_epi32(n0, n0b), _mm512_add_epi32(n1, n1b)};
#pragma GCC unroll 2
                for (int e = 0; e < 2; e++) {
                    const int j = 2 * c + e, t = 8 * h + j; /* t: b's sub-block j, mod 16 */
                    const int64_t sub = 8 * b + j;
                    const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(k4_lanes(S, j, 0)));
                    const __m512 mm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(k4_lanes(S, j, 1)));
                    A[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(n[e]), _mm512_mul_ps(a, _mm512_set1_ps(xd[sub])), A[t]);
                    A[t] = _mm512_fnmadd_ps(mm, _mm512_set1_ps(xsum[sub]), A[t]);
                }
            }
        }
    }
    tree16_rows(A, out);
}

/* even (lanes 2i) and odd lanes of the 32 lanes a ++ b, added: 8 groups of n -> n / 2 each */
ZINL __m512i fold_pairs(__m512i a, __m512i b) {
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, ev, b),
                            _mm512_permutex2var_epi32(a, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), b));
}

/* One Q4_K row in the file's layout: two blocks (16 sub-blocks) a register. */
ZINL float r16_row_q4k(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd,
                       const float *xsum) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m512 A = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 2) {
        const int two = b0 + 1 < nb;
        const __mmask16 mk = two ? 0xFFFF : 0x00FF;
        __m512i V[8];
        __m256 a2[2], m2[2];
        for (int h = 0; h < 2; h++) {
            if (h && !two) {
                for (int c = 0; c < 4; c++) V[4 + c] = _mm512_setzero_si512();
                a2[1] = m2[1] = _mm256_setzero_ps();
                break;
            }
            const uint8_t *blk = row + 144 * (b0 + h);
            uint32_t u[4];
            k4_unpack_bytes(blk + 4, u);
            a2[h] = _mm256_mul_ps(_mm256_set1_ps(h2f(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u))));
            m2[h] = _mm256_mul_ps(_mm256_set1_ps(h2f(blk + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2)))));
            for (int c = 0; c < 4; c++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, m4)),
                                                     _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), 1);
                V[4 * h + c] = zdot(w, _mm512_loadu_si512((const void *)(xq + 256 * (b0 + h) + 64 * c)));
            }
        }
        /* V[i]: lanes 0-7 sub-block 2i's eighths, 8-15 sub-block 2i + 1's: fold to one lane each */
        const __m512i W0 = fold_pairs(V[0], V[1]), W1 = fold_pairs(V[2], V[3]);
        const __m512i W2 = fold_pairs(V[4], V[5]), W3 = fold_pairs(V[6], V[7]);
        const __m512i R = fold_pairs(fold_pairs(W0, W1), fold_pairs(W2, W3));
        const __m512 a = _mm512_insertf32x8(_mm512_castps256_ps512(a2[0]), a2[1], 1);
        const __m512 mm = _mm512_insertf32x8(_mm512_castps256_ps512(m2[0]), m2[1], 1);
        const __m512 s = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(mk, xd + 8 * b0));
        A = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(R), s, A, mk);
        A = _mm512_mask3_fnmadd_ps(mm, _mm512_maskz_loadu_ps(mk, xsum + 8 * b0), A, mk);
    }
    return tree16(A);
}

/* Q6_K in the same scheme, per group g of 16 weights (a block's 16 scales): n_g = sum u x -
 * 32 sum x exact (u the unsigned 6-bit weight 0..63: dpbusd multiplies unsigned by signed; the
 * sum from the per-16 sums xs), then A[g] = fma((float)n_g, (d_b * sc_g) * xd_g, A[g]), the
 * same tree. A block has 16 groups, so a row's 16 lanes are its groups and every block adds
 * to each once. A group's block (3360 bytes): 16 d (f16), then 52 chunks of 64 bytes, each
 * one word (4 bytes) of the 208 before d, lane r = row r's: the 4 words of int8 scales, then
 * in the order the kernel reads them (a stream: read out of order, a 41 MB head went at 7
 * GB/s) for each half n and c = 0..7 the low nibbles' words 16n + c and 16n + 8 + c and the
 * high bit pairs' word 8n + c (q6_chunk). Why: a row at a time (zq6k) spent ~50 instructions
 * a block on reductions across lanes and scale shuffles, and Q6_K decoded at ~14 GB/s. */

/* where word k (bytes 4k..4k+3) of a Q6_K block sits in its group's block: chunk q6_chunk(k) */
static inline int q6_chunk(int k) {
    if (k >= 48) return k - 48;             /* scales */
    if (k >= 32) return 4 + 3 * (k - 32) + 2; /* qh: half (k - 32) / 8, c = (k - 32) % 8 */
    return 4 + 3 * (8 * (k / 16) + k % 8) + (k % 16) / 8; /* ql */
}
#define Q6_AT(blk, chunk) ((const void *)((blk) + 32 + 64 * (chunk)))

/* the 16 lanes' (rows') int8 scale g of their block, from the group's 4 chunks of scales */
ZINL __m512 k6_scale_lanes(const uint8_t *blk, int g) {
    const __m512i S = _mm512_loadu_si512(Q6_AT(blk, g / 4));
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(S, 24 - 8 * (g % 4)), 24));
}

/* chunk `at` of a Q6_K group block and the two after it (low nibbles, low nibbles, high bit
 * pairs) -> the unsigned 6-bit weights of 4 groups, w[m] for group 2m + cq of the half */
ZINL void q6_unpack(const uint8_t *blk, int at, __m512i m4, __m512i m30, __m512i w[4]) {
    const __m512i l0 = _mm512_loadu_si512(Q6_AT(blk, at));
    const __m512i l1 = _mm512_loadu_si512(Q6_AT(blk, at + 1));
    const __m512i h = _mm512_loadu_si512(Q6_AT(blk, at + 2));
    /* ternlog 0xEC: (a & c) | b; 0xF8: a | (b & c) */
    w[0] = _mm512_ternarylogic_epi32(l0, BYTE_BITS(h, BITS_01_TO_45, 4, 0, 0x30), m4, 0xEC);
    w[1] = _mm512_ternarylogic_epi32(l1, BYTE_BITS(h, BITS_23_TO_45, 2, 0, 0x30), m4, 0xEC);
    w[2] = _mm512_ternarylogic_epi32(BYTE_BITS(l0, BITS_HI_NIBBLE, 0, 4, 0x0F), h, m30, 0xF8);
    w[3] = _mm512_or_si512(BYTE_BITS(l1, BITS_HI_NIBBLE, 0, 4, 0x0F), BYTE_BITS(h, BITS_67_TO_45, 0, 2, 0x30));
}

/* acc + (float)s * (sg * xd): a group's exact sum into its accumulator, sg = d_b * sc_g per
 * lane. One place for both paths (one row, a batch): their bits are equal because these
 * float operations are the same, in the same order. */
ZINL __m512 q6_group_add(__m512 acc, __m512i s, __m512 sg, float xd) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sg, _mm512_set1_ps(xd)), acc);
}

/* 16 repacked Q6_K rows (nb blocks of 256) times nx activation rows: out[t * ld + lane].
 * Each chunk's weights are unpacked once for all nx rows; per row the same operations in the
 * same order whatever nx is (the same bits alone or in a batch). */
ZINL void r16_group_q6k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                        const int32_t *xs, int64_t cols, const int64_t nx, float *out, int64_t ld) {
    const int64_t nbx = cols / 32, ngx = cols / 16;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc[MAX_BATCH][16];
    for (int64_t t = 0; t < nx; t++)
        for (int j = 0; j < 16; j++) acc[t][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 3360 * b;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) {
#pragma GCC unroll 2
            for (int cq = 0; cq < 2; cq++) { /* c = 4cq..4cq+3: weights 4c.. of each 32: group 2m + cq */
                if (nx == 1) { /* each chunk's 4 vectors into their 4 groups' sums at once:
                                * 8 vectors live, not 16 (fewer accumulators spilled) */
                    const int32_t *x4 = (const int32_t *)(xq + 256 * b + 128 * n + 16 * cq);
                    __m512i s[4];
#pragma GCC unroll 4
                    for (int m = 0; m < 4; m++) s[m] = _mm512_set1_epi32(-32 * xs[16 * b + 8 * n + 2 * m + cq]);
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        __m512i w[4];
                        q6_unpack(blk, 4 + 3 * (8 * n + 4 * cq + i), m4, m30, w);
#pragma GCC unroll 4
                        for (int m = 0; m < 4; m++) s[m] = dpbusd_bcst(s[m], w[m], x4 + 8 * m + i);
                    }
#pragma GCC unroll 4
                    for (int m = 0; m < 4; m++) {
                        const int gi = 8 * n + 2 * m + cq;
                        const __m512 sg = _mm512_mul_ps(d, k6_scale_lanes(blk, gi));
                        acc[0][gi] = q6_group_add(acc[0][gi], s[m], sg, xd[8 * b + gi / 2]);
                    }
                    continue;
                }
                __m512i u[4][4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    __m512i w[4];
                    q6_unpack(blk, 4 + 3 * (8 * n + 4 * cq + i), m4, m30, w);
                    for (int m = 0; m < 4; m++) u[m][i] = w[m];
                }
#pragma GCC unroll 4
                for (int m = 0; m < 4; m++) {
                    const int gi = 8 * n + 2 * m + cq; /* the group, and A's lane */
                    const __m512 sg = _mm512_mul_ps(d, k6_scale_lanes(blk, gi));
                    for (int64_t t = 0; t < nx; t++) {
                        const int32_t *x4 = (const int32_t *)(xq + t * cols + 256 * b + 128 * n + 32 * m + 16 * cq);
                        __m512i s = _mm512_set1_epi32(-32 * xs[t * ngx + 16 * b + gi]);
#pragma GCC unroll 4
                        for (int i = 0; i < 4; i++) s = _mm512_dpbusd_epi32(s, u[m][i], _mm512_set1_epi32(x4[i]));
                        acc[t][gi] = q6_group_add(acc[t][gi], s, sg, xd[t * nbx + 8 * b + gi / 2]);
                    }
                }
            }
        }
    }
    for (int64_t t = 0; t < nx; t++) tree16_rows(acc[t], out + t * ld);
}

/* One Q6_K row in the file's layout: a block's 16 groups in the 16 lanes. */
ZINL float r16_row_q6k(const uint8_t *row, int64_t nb, const int8_t *xq, const float *xd,
                       const int32_t *xs) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = w16x2(4, 2), shr = w16x2(0, 2);
    __m512 A = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + 210 * b;
        __m512i V[4];
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++) { /* as zq6k: weights 0-63 and 64-127 of this half */
            const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * n));
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
            const __m512i wa = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(h, shl), m30));
            const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                               _mm512_and_si512(_mm512_srlv_epi16(h, shr), m30));
            const int8_t *xp = xq + 256 * b + 128 * n;
            V[2 * n] = zdot(wa, _mm512_loadu_si512((const void *)xp));
            V[2 * n + 1] = zdot(wb, _mm512_loadu_si512((const void *)(xp + 64)));
        }
        /* V[i]: 4 groups of 4 lanes each: fold to one lane per group, groups 0..15 in order */
        const __m512i G = fold_pairs(fold_pairs(V[0], V[1]), fold_pairs(V[2], V[3]));
        const __m512i R = _mm512_sub_epi32(G, _mm512_slli_epi32(_mm512_loadu_si512((const void *)(xs + 16 * b)), 5));
        const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(h2f(blk + 208)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        A = _mm512_fmadd_ps(_mm512_cvtepi32_ps(R), _mm512_mul_ps(sc, xd_groups(xd + 8 * b)), A);
    }
    return tree16(A);
}

static void zrow_r16(const int fmt, const uint8_t *row, int64_t nb, const acts *a, float *out) {
    const int64_t nbx = a->cols / 32;
    for (int64_t k = 0; k < a->nx; k++)
        out[k] = r16_row(fmt, row, nb, a->xq + k * a->cols, a->xt ? a->xt + k * a->cols : NULL,
                         a->xd + k * nbx, a->xs + 2 * k * nbx);
}
static void zrow_q4_0(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    zrow_r16(Q4_0, row, nb, a, out);
}
static void zrow_q8_0(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    zrow_r16(Q8_0, row, nb, a, out);
}
static void zrow_q4_k(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    const int64_t nbx = a->cols / 32;
    for (int64_t k = 0; k < a->nx; k++)
        out[k] = r16_row_q4k(row, nb, a->xq + k * a->cols, a->xd + k * nbx, a->xsum + k * nbx);
}
static void zrow_q6_k(const uint8_t *row, int64_t nb, const acts *a, float *out) {
    const int64_t nbx = a->cols / 32;
    for (int64_t k = 0; k < a->nx; k++)
        out[k] = r16_row_q6k(row, nb, a->xq + k * a->cols, a->xd + k * nbx, a->xs + 2 * k * nbx);
}


/* The same for nx <= MAX_BATCH activation rows at once (a batch, a prefill's tile): each
 * block's weights are unpacked once into registers and multiplied with every row's
 * activations, each row's 16 accumulators kept in `acc` (L1). Per row the same operations
 * in the same order as r16_group1: the same bits. */
ZINL void r16_group_tile(const int fmt, const uint8_t *g, int64_t nb, const int8_t *xq,
                         const float *xd, const int32_t *xs, int64_t cols, int64_t nx,
                         float *out, int64_t ld) {
    const int gb = R16_BLOCK(fmt), off = fmt == Q8_0 ? 128 : 8;
    const int64_t nbx = cols / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(-128);
    __m512 acc[MAX_BATCH][16];
    for (int64_t k = 0; k < nx; k++)
        for (int j = 0; j < 16; j++) acc[k][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + gb * b;
        __m512i w[8];
        if (fmt == Q8_0) {
            for (int k = 0; k < 8; k++) w[k] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk + 32 + 64 * k)), flip);
        } else {
            for (int k = 0; k < 4; k++) {
                const __m512i q = _mm512_loadu_si512((const void *)(blk + 32 + 64 * k));
                w[k] = _mm512_and_si512(q, m4);
                w[4 + k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const int j = (int)(b % 16);
        for (int64_t t = 0; t < nx; t++) {
            const int32_t *x4 = (const int32_t *)(xq + t * cols + 32 * b);
            const int32_t *st = xs + 2 * (t * nbx + b);
            __m512i s0 = _mm512_set1_epi32(-off * (st[0] + st[1])), s1 = _mm512_setzero_si512();
            if (fmt == Q8_0) {
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    if (k & 1) s1 = _mm512_dpbusd_epi32(s1, w[k], _mm512_set1_epi32(x4[k]));
                    else s0 = _mm512_dpbusd_epi32(s0, w[k], _mm512_set1_epi32(x4[k]));
                }
            } else {
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    s0 = _mm512_dpbusd_epi32(s0, w[k], _mm512_set1_epi32(x4[k]));
                    s1 = _mm512_dpbusd_epi32(s1, w[4 + k], _mm512_set1_epi32(x4[4 + k]));
                }
            }
            const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(xd[t * nbx + b]));
            acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), sc, acc[t][j]);
        }
    }
    for (int64_t t = 0; t < nx; t++) {
        tree16_rows(acc[t], out + t * ld);
    }
}


/* r16_group1_q4k for nx <= MAX_BATCH rows at once (as r16_group_tile): each pair of
 * sub-blocks' weights unpacked once, the same operations per row in the same order. */
ZINL void r16_group_tile_q4k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                             const float *xsum, int64_t cols, int64_t nx, float *out, int64_t ld) {
    const int64_t nbx = cols / 32;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[MAX_BATCH][16];
    for (int64_t k = 0; k < nx; k++)
        for (int j = 0; j < 16; j++) acc[k][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 2304 * b;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        const __m512i S[3] = {_mm512_loadu_si512((const void *)(blk + 64)), _mm512_loadu_si512((const void *)(blk + 128)),
                              _mm512_loadu_si512((const void *)(blk + 192))};
        for (int c = 0; c < 4; c++) {
            __m512i lo[8], hi[8];
            for (int k = 0; k < 8; k++) {
                const __m512i q = _mm512_loadu_si512((const void *)(blk + 256 + 64 * (8 * c + k)));
                lo[k] = _mm512_and_si512(q, m4);
                hi[k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
            }
            const int j0 = 2 * c, t0 = (int)(8 * (b % 2)) + j0;
            const __m512 a0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(k4_lanes(S, j0, 0)));
            const __m512 a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(k4_lanes(S, j0 + 1, 0)));
            const __m512 mm0 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(k4_lanes(S, j0, 1)));
            const __m512 mm1 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(k4_lanes(S, j0 + 1, 1)));
            const int64_t sub = 8 * b + j0;
            for (int64_t t = 0; t < nx; t++) {
                const int32_t *x0 = (const int32_t *)(xq + t * cols + 256 * b + 64 * c), *x1 = x0 + 8;
                __m512i n0 = _mm512_setzero_si512(), n1 = _mm512_setzero_si512();
                __m512i n0b = _mm512_setzero_si512(), n1b = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k += 2) {
                    n0 = _mm512_dpbusd_epi32(n0, lo[k], _mm512_set1_epi32(x0[k]));
                    n1 = _mm512_dpbusd_epi32(n1, hi[k], _mm512_set1_epi32(x1[k]));
                    n0b = _mm512_dpbusd_epi32(n0b, lo[k + 1], _mm512_set1_epi32(x0[k + 1]));
                    n1b = _mm512_dpbusd_epi32(n1b, hi[k + 1], _mm512_set1_epi32(x1[k + 1]));
                }
                const float *dx = xd + t * nbx, *sx = xsum + t * nbx;
                __m512 A0 = acc[t][t0], A1 = acc[t][t0 + 1];
                A0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(n0, n0b)), _mm512_mul_ps(a0, _mm512_set1_ps(dx[sub])), A0);
                A0 = _mm512_fnmadd_ps(mm0, _mm512_set1_ps(sx[sub]), A0);
                A1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(n1, n1b)), _mm512_mul_ps(a1, _mm512_set1_ps(dx[sub + 1])), A1);
                A1 = _mm512_fnmadd_ps(mm1, _mm512_set1_ps(sx[sub + 1]), A1);
                acc[t][t0] = A0;
                acc[t][t0 + 1] = A1;
            }
        }
    }
    for (int64_t t = 0; t < nx; t++) {
        tree16_rows(acc[t], out + t * ld);
    }
}

/* 16 rows of a group (its format as in the file) times nx activation rows: out[k * ld + lane] */
static void r16_group_acts(int fmt, const uint8_t *g, const int8_t *xq, const float *xd,
                           const int32_t *xs, const float *xsum, int64_t cols, int64_t nx,
                           float *out, int64_t ld) {
    const int64_t nbx = cols / 32;
    if (fmt == Q6_K) { /* one function; nx 1 its own copy */
        if (nx == 1) r16_group_q6k(g, cols / 256, xq, xd, xs, cols, 1, out, ld);
        else r16_group_q6k(g, cols / 256, xq, xd, xs, cols, nx, out, ld);
        return;
    }
    if (nx > 1) { /* several rows: each block's weights unpacked once */
        if (fmt == Q8_0) r16_group_tile(Q8_0, g, nbx, xq, xd, xs, cols, nx, out, ld);
        else if (fmt == Q4_0) r16_group_tile(Q4_0, g, nbx, xq, xd, xs, cols, nx, out, ld);
        else r16_group_tile_q4k(g, cols / 256, xq, xd, xsum, cols, nx, out, ld);
        return;
    }
    for (int64_t k = 0; k < nx; k++) {
        const int8_t *q = xq + k * cols;
        const float *d = xd + k * nbx;
        if (fmt == Q8_0) r16_group1(Q8_0, g, nbx, q, d, xs + 2 * k * nbx, out + k * ld);
        else if (fmt == Q4_0) r16_group1(Q4_0, g, nbx, q, d, xs + 2 * k * nbx, out + k * ld);
        else r16_group1_q4k(g, cols / 256, q, d, xsum + k * nbx, out + k * ld);
    }
}

/* Byte k (0..3) of each of the 16 lanes' words in a 64-byte chunk (lane r's word at 4r). */
ZINL __m512i r16_bytes(const uint8_t *chunk, int k) {
    return _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512((const void *)chunk), 8 * k),
                            _mm512_set1_epi32(0xFF));
}

/* byte i of each lane's block (of a 256-weight format: Q6_K, the words after its d; Q4_K,
 * after its d and dmin), whose word i / 4 sits in chunk `chunk(i / 4)` */
#define R16_BYTE(body, chunk, i) r16_bytes((body) + 64 * (chunk), (i) & 3)

/* The 16 lanes' weights at column col of a group (lane r: row r), as plan_weight decodes
 * each: the same operations in the same order, a lane at a time. Why: an outlier's column is
 * decoded for every row; one lane at a time cost a 512-row prefill more than its integer
 * dot products. */
ZINL __m512 r16_weights(int fmt, const uint8_t *g, int32_t col) {
    if (fmt == Q6_K) { /* as k_weight_at */
        const uint8_t *blk = g + 3360 * (col >> 8), *body = blk + 32;
        const int e = col & 255, gi = e >> 4, n = e >> 7, part = (e >> 5) & 3, l = e & 31;
        const int lo = 64 * n + 32 * (part & 1) + l, hi = 128 + 32 * n + l, sb = 192 + gi;
        const __m512i qlb = R16_BYTE(body, q6_chunk(lo >> 2), lo);
        const __m512i h = _mm512_and_si512(_mm512_srli_epi32(R16_BYTE(body, q6_chunk(hi >> 2), hi),
                                                             2 * part), _mm512_set1_epi32(3));
        const __m512i low = part < 2 ? _mm512_and_si512(qlb, _mm512_set1_epi32(0xF))
                                     : _mm512_srli_epi32(qlb, 4);
        const __m512i q = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(h, 4)),
                                           _mm512_set1_epi32(32));
        const __m512i sc = _mm512_srai_epi32(
            _mm512_slli_epi32(R16_BYTE(body, q6_chunk(sb >> 2), sb), 24), 24); /* int8 */
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 w = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), _mm512_cvtepi32_ps(q));
        return _mm512_sub_ps(w, _mm512_setzero_ps());
    }
    if (fmt == Q4_K) { /* as k_weight_at: the scales' 12 bytes are 3 words, chunks 0..2 */
        const uint8_t *blk = g + 2304 * (col >> 8), *sc12 = blk + 64;
        const int e = col & 255, at = 32 * (e >> 6) + (e & 31), j = e >> 5;
        __m512i sc, m;
        const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(0xF);
        if (j < 4) {
            sc = _mm512_and_si512(R16_BYTE(sc12, j >> 2, j), m63);
            m = _mm512_and_si512(R16_BYTE(sc12, (j + 4) >> 2, j + 4), m63);
        } else {
            const __m512i s4 = R16_BYTE(sc12, (j + 4) >> 2, j + 4);
            const __m512i hi_sc = _mm512_slli_epi32(_mm512_srli_epi32(R16_BYTE(sc12, (j - 4) >> 2, j - 4), 6), 4);
            const __m512i hi_m = _mm512_slli_epi32(_mm512_srli_epi32(R16_BYTE(sc12, j >> 2, j), 6), 4);
            sc = _mm512_or_si512(_mm512_and_si512(s4, m15), hi_sc);
            m = _mm512_or_si512(_mm512_srli_epi32(s4, 4), hi_m);
        }
        const __m512i byte = R16_BYTE(blk + 256, at >> 2, at);
        const __m512i q = (e & 32) ? _mm512_srli_epi32(byte, 4) : _mm512_and_si512(byte, m15);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        const __m512 w = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), _mm512_cvtepi32_ps(q));
        return _mm512_sub_ps(w, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)));
    }
    const uint8_t *blk = g + R16_BLOCK(fmt) * (col >> 5);
    const int e = col & 31;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    if (fmt == Q8_0) {
        const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(r16_bytes(blk + 32 + 64 * (e >> 2), e & 3), 24), 24);
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(q));
    }
    const int i = e & 15;
    const __m512i q = r16_bytes(blk + 32 + 64 * (i >> 2), i & 3);
    const __m512i v = _mm512_and_si512(e >= 16 ? _mm512_srli_epi32(q, 4) : q, _mm512_set1_epi32(0xF));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(8))));
}

int cs_repacked(int fmt) {
    return fmt == Q4_0 ? Q4_0R : fmt == Q8_0 ? Q8_0R : fmt == Q4_K ? Q4_KR : fmt == Q6_K ? Q6_KR : -1;
}

/* one block of row r of a group, from the file's layout (src) into the group's (o), or back */
static inline void r16_lane(int fmt, uint8_t *o, int r, uint8_t *src, int back) {
    const int head = fmt == Q4_K ? 4 : 2, bb = R16_BYTES(fmt);
    const int words = (bb - head) / 4, body = fmt == Q4_K ? 64 : 32; /* Q4_K: + dmin */
    const int first = fmt == Q6_K ? 0 : head; /* Q6_K: d after the 208 bytes of words */
    uint8_t *f[2] = {o + 2 * r, fmt == Q6_K ? src + 208 : src};
    memcpy(f[back], f[!back], 2);
    if (fmt == Q4_K) {
        uint8_t *g2[2] = {o + 32 + 2 * r, src + 2};
        memcpy(g2[back], g2[!back], 2);
    }
    for (int k = 0; k < words; k++) {
        uint8_t *p[2] = {o + body + 64 * (fmt == Q6_K ? q6_chunk(k) : k) + 4 * r, src + first + 4 * k};
        memcpy(p[back], p[!back], 4);
    }
}

/* out = w (rows of Q4_0, Q8_0, Q4_K or Q6_K) with its whole 16-row groups repacked; the same size */
void cs_repack(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, uint8_t *out) {
    const int bb = R16_BYTES(fmt), gb = R16_BLOCK(fmt);
    const int64_t nb = row_bytes / bb, ng = rows / 16;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < ng; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < 16; r++)
                r16_lane(fmt, out + 16 * g * row_bytes + gb * b, r,
                         (uint8_t *)(w + (16 * g + r) * row_bytes + bb * b), 0);
    memcpy(out + 16 * ng * row_bytes, w + 16 * ng * row_bytes, (size_t)((rows - 16 * ng) * row_bytes));
}
#endif

static void simd_row(int fmt, const uint8_t *row, int64_t cols, const acts *a, float *out) {
#ifdef HAVE_ZMM_ROWS
    switch (fmt) {
    case Q8_0: zrow_q8_0(row, cols / 32, a, out); break;
    case Q4_0: zrow_q4_0(row, cols / 32, a, out); break;
    case Q4_1: zrow_q4_1(row, cols / 32, a, out); break;
    case Q4_K: zrow_q4_k(row, cols / 256, a, out); break;
    case Q6_K: zrow_q6_k(row, cols / 256, a, out); break;
    default: zrow_q2_k(row, cols / 256, a, out); break;
    }
#else
    switch (fmt) {
    case Q8_0: row_q8_0(row, cols / 32, a, out); break;
    case Q4_0: row_q4(row, cols / 32, a, out, 0); break;
    case Q4_1: row_q4(row, cols / 32, a, out, 1); break;
    case Q4_K: row_q4_k(row, cols / 256, a, out); break;
    case Q6_K: row_q6_k(row, cols / 256, a, out); break;
    default: row_q2_k(row, cols / 256, a, out); break;
    }
#endif
}
#endif

#ifndef HAVE_ZMM_VBMI /* no repacked layout on this CPU */
int cs_repacked(int fmt) { (void)fmt; return -1; }
void cs_repack(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, uint8_t *out) {
    (void)fmt; (void)w; (void)rows; (void)row_bytes; (void)out;
}
#endif

/* ---- outliers: the largest activations multiplied in float ------------------------------
 * The vectors a trained model multiplies carry a few values 10-100x their RMS (RMSNorm's
 * outputs above all: the same few "massive activation" channels, token after token). Int8
 * blocks of 32 with one scale each, as here and in llama.cpp, give such a block a step that
 * leaves its other 31 values a few levels: on the demo model that block is ~70% of a vector's
 * rounding error, and the decode path's logits were KL 0.0021 from the float path's (llama.cpp
 * on the same file and text: 0.0026). So a vector's few dominant values are taken out of their
 * blocks (each such block is quantized again without them) and multiplied in float by their
 * weight, decoded alone, once the row's integer dot product is done, while the row is still
 * in cache:
 *
 *     y[r] = int8 dot(W[r], x without its outliers) + sum_i x[j_i] * W[r, j_i]
 *
 * Up to four per vector bring that KL to 0.0006 (bench/quant_quality.py), for ~2 ns per
 * weight row per outlier. A vector is what one token gives one matrix (one head's slice for a
 * per-head matrix), the same unit on every path (cs_matmul_qx, the fused layers one token or
 * n at a time), so a result's bits do not depend on the path. */
#define OUTLIERS 4
#define DOMINANCE 2.0f
typedef struct { int32_t n, idx[OUTLIERS]; float val[OUTLIERS]; } outliers;

static int outlier_max = OUTLIERS; /* cs_set_outliers: 0 turns them off (int8 blocks alone) */

/* At most how many a vector of cols gives: OUTLIERS, one per 128 values in a shorter one (a
 * head's slice: each costs every row about what a block's integer dot product does). */
int cs_outlier_count(int64_t cols) {
    const int64_t k = cols / 128 < 1 ? 1 : cols / 128;
    return k > outlier_max ? outlier_max : (int)k;
}

void cs_set_outliers(int n) { outlier_max = n < 0 ? 0 : n > OUTLIERS ? OUTLIERS : n; }

float cs_outlier_dominance(void) { return DOMINANCE; }

/* After cs_quantize_act of one vector x (cols) into xq/xd/xs, up to cs_outlier_count times:
 * the block holding the largest value left (the largest scale not yet passed over); if that
 * value is more than DOMINANCE times every other value of its block, it goes into o and the
 * block is quantized again with it at zero; else taking it out would barely shrink the
 * block's step, and the block is passed over. So a vector without outliers (most of a random
 * model's) keeps its int8 blocks as they were and costs nothing more. Zero blocks, and NaN
 * blocks (a NaN scale compares false), are never picked: a NaN stays a NaN. */
static void take_outliers(const float *x, int64_t cols, int8_t *xq, float *xd, int32_t *xs,
                          outliers *o) {
    const int64_t nb = cols / 32;
    const int count = cs_outlier_count(cols);
    int64_t passed[OUTLIERS];
    int n_passed = 0;
    o->n = 0;
    for (int k = 0; k < count; k++) {
        int64_t best = -1;
        float top = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int skip = 0;
            for (int i = 0; i < n_passed; i++) skip |= passed[i] == b;
            if (xd[b] > top && !skip) { top = xd[b]; best = b; }
        }
        if (best < 0) break;
        float v[32];
        memcpy(v, x + 32 * best, sizeof v);
        for (int i = 0; i < o->n; i++) {
            if (o->idx[i] / 32 == best) v[o->idx[i] % 32] = 0.0f;
        }
        int m = 0;
        for (int i = 1; i < 32; i++) m = fabsf(v[i]) > fabsf(v[m]) ? i : m;
        float next = 0.0f; /* the largest other value of the block */
        for (int i = 0; i < 32; i++) next = i != m && fabsf(v[i]) > next ? fabsf(v[i]) : next;
        if (!(fabsf(v[m]) > DOMINANCE * next)) {
            passed[n_passed++] = best;
            continue;
        }
        o->idx[o->n] = (int32_t)(32 * best + m);
        o->val[o->n] = v[m];
        o->n++;
        v[m] = 0.0f;
        cs_quantize_act(v, 1, 32, xq + 32 * best, xd + best, xs + 2 * best);
    }
}

/* n vectors of cols each; vid (one per 32-block) says how many blocks back its vector starts,
 * o (one per 32-block) holds a vector's outliers at its first block. */
static void take_outliers_rows(const float *x, int64_t n, int64_t cols, int8_t *xq, float *xd,
                               int32_t *xs, outliers *o, int32_t *vid) {
    const int64_t nb = cols / 32;
    for (int64_t r = 0; r < n; r++) {
        for (int64_t b = 0; b < nb; b++) vid[r * nb + b] = (int32_t)b;
        take_outliers(x + r * cols, cols, xq + r * cols, xd + r * nb, xs + 2 * r * nb, &o[r * nb]);
    }
}

static inline float f16_at(const uint8_t *p) {
#ifdef HAVE_SIMD_ROWS
    return h2f(p);
#else
    return fp16_to_f32(rd16(p));
#endif
}

/* Element j of a packed row of 256-blocks (Q4_K, Q6_K, Q2_K): scale * q - min, as decode()
 * and cs_dequantize give it. */
static inline float k_weight_at(int fmt, const uint8_t *row, int64_t j) {
    const uint8_t *b;
    const int e = (int)(j & 255), g = e >> 4, n = e >> 7, part = (e >> 5) & 3, l = e & 31;
    if (fmt == Q4_K) {
        b = row + 144 * (j >> 8);
        const uint8_t *qs = b + 16 + 32 * (e >> 6);
        const int q = (e & 32) ? qs[l] >> 4 : qs[l] & 0xF;
        uint8_t sc, m;
        k4_scale_min(e >> 5, b + 4, &sc, &m);
        return f16_at(b) * sc * (float)q - f16_at(b + 2) * m;
    }
    if (fmt == Q6_K) {
        b = row + 210 * (j >> 8);
        const uint8_t *ql = b + 64 * n + 32 * (part & 1);
        const int h = (b[128 + 32 * n + l] >> (2 * part)) & 3;
        const int q = ((part < 2 ? ql[l] & 0xF : ql[l] >> 4) | (h << 4)) - 32;
        return f16_at(b + 208) * ((const int8_t *)(b + 192))[g] * (float)q - 0.0f;
    }
    b = row + 84 * (j >> 8); /* Q2_K */
    const int q = (b[16 + 32 * n + l] >> (2 * part)) & 3;
    return f16_at(b + 80) * (b[g] & 0xF) * (float)q - f16_at(b + 82) * (b[g] >> 4);
}

/* The outliers of nx activation rows (each its vector's columns [off, off + cols)) against
 * one matrix: the distinct columns, where each one's weight sits in any row, and per activation
 * row its values and which column each multiplies. Made once per matrix (a task of the fused
 * layers), read for every weight row: a column several tokens share is decoded once. */
#define PLAN_MAX (MAX_BATCH * OUTLIERS)
typedef struct {
    int nx, nu;
    int32_t col[PLAN_MAX], boff[PLAN_MAX], qoff[PLAN_MAX], sh[PLAN_MAX];
    int n[MAX_BATCH];
    uint8_t use[MAX_BATCH][OUTLIERS];
    float val[MAX_BATCH][OUTLIERS];
} ol_plan;

/* activation row k of the plan: the outliers o (NULL: none) of the vector it is columns
 * [off, off + cols) of */
static void plan_add(ol_plan *p, int fmt, int k, const outliers *o, int64_t off, int64_t cols) {
    fmt = R16_NATURAL(fmt); /* offsets as in a row left as it is */
    const int bb = fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20, hdr = fmt == Q4_1 ? 4 : 2;
    if (k == 0) p->nu = 0;
    p->nx = k + 1;
    p->n[k] = 0;
    for (int i = 0; o && i < o->n; i++) {
        const int64_t j = o->idx[i] - off;
        if (j < 0 || j >= cols) continue;
        int u = 0;
        while (u < p->nu && p->col[u] != j) u++;
        if (u == p->nu) {
            const int e = (int)(j & 31);
            p->col[u] = (int32_t)j;
            p->boff[u] = (int32_t)(bb * (j >> 5));
            p->qoff[u] = p->boff[u] + hdr + (fmt == Q8_0 ? e : (e & 15));
            p->sh[u] = fmt != Q8_0 && e >= 16 ? 4 : 0;
            p->nu++;
        }
        p->use[k][p->n[k]] = (uint8_t)u;
        p->val[k][p->n[k]++] = o->val[i];
    }
}

/* The plan's distinct column u in a row: scale * q - min, as cs_dequantize decodes it */
static inline float plan_weight(int fmt, const uint8_t *row, const ol_plan *p, int u) {
    const uint8_t *b = row + p->boff[u], *q = row + p->qoff[u];
    switch (fmt) {
    case Q8_0: return f16_at(b) * (float)(int8_t)*q;
    case Q4_0: return f16_at(b) * (float)(((*q >> p->sh[u]) & 0xF) - 8);
    case Q4_1: return f16_at(b) * (float)((*q >> p->sh[u]) & 0xF) + f16_at(b + 2);
    default: return k_weight_at(fmt, row, p->col[u]);
    }
}

/* s[k] = sum_i x_k[j_i] * w[u_i] for the plan's activation rows, w the decoded weights of
 * the plan's distinct columns in one row: what the row's integer dot products left out. */
static inline void plan_sum(const ol_plan *p, const float *w, float *s) {
    for (int k = 0; k < p->nx; k++) {
        float t = 0.0f;
        for (int i = 0; i < p->n[k]; i++) t += p->val[k][i] * w[p->use[k][i]];
        s[k] = t;
    }
}

static inline void plan_row(int fmt, const uint8_t *row, const ol_plan *p, float *s) {
    float w[PLAN_MAX];
    for (int u = 0; u < p->nu; u++) w[u] = plan_weight(fmt, row, p, u);
    plan_sum(p, w, s);
}

#ifdef HAVE_ZMM_VBMI
/* The 16 rows of group g of a repacked weight (format rfmt) times nx activation rows:
 * out[k * ld + lane], outliers added. */
static void r16_group(int rfmt, const uint8_t *g, int64_t cols, const int8_t *xq, const float *xd,
                      const int32_t *xs, const float *xsum, int64_t nx, const ol_plan *pl,
                      float *out, int64_t ld) {
    const int fmt = R16_NATURAL(rfmt);
    r16_group_acts(fmt, g, xq, xd, xs, xsum, cols, nx, out, ld);
    if (!pl->nu) return;
    __m512 w[PLAN_MAX]; /* plan_row's, for the 16 rows at once: the same bits in each lane */
    for (int u = 0; u < pl->nu; u++) w[u] = r16_weights(fmt, g, pl->col[u]);
    for (int64_t k = 0; k < nx; k++) {
        __m512 t = _mm512_setzero_ps();
        for (int i = 0; i < pl->n[k]; i++)
            t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(pl->val[k][i]), w[pl->use[k][i]]));
        _mm512_storeu_ps(out + k * ld, _mm512_add_ps(_mm512_loadu_ps(out + k * ld), t));
    }
}
#endif

/* ---- fused matmul ----------------------------------------------------------------------- */

static inline float dot_decoded(const decoded *w, int n, const int8_t *xq, const float *xd,
                                const int32_t *xs) {
    float acc = 0.0f;
    for (int g = 0; g < n / 16; g++) {
        int32_t s = 0;
        const int8_t *a = w->q + 16 * g, *x = xq + 16 * g;
        for (int i = 0; i < 16; i++) s += (int32_t)a[i] * (int32_t)x[i];
        acc += xd[g / 2] * (w->scale[g] * (float)s - w->min[g] * (float)xs[g]);
    }
    return acc;
}

/* How a matmul's rows are dealt to threads. Dynamically, in chunks: a thread whose core is
 * shared with another busy process (or that was woken late) takes fewer chunks instead of
 * holding every other thread at the end of a static split for its fixed share. A chunk is
 * 16..256 KB of weights (the shared counter is touched once per chunk, prefetch streams stay
 * long), about 8 per thread when the matrix allows. Below PAR_MIN_BYTES one thread does it
 * all: a fork/join costs more than the split saves. */
#define PAR_MIN_BYTES (96 * 1024)
static inline int64_t chunk_rows(int64_t rows, int64_t row_bytes) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const int64_t lo = (16384 + row_bytes - 1) / row_bytes, hi = (262144 + row_bytes - 1) / row_bytes;
    const int64_t c = rows / (8 * (int64_t)threads);
    return c < lo ? lo : c > hi ? hi : c;
}

#ifdef HAVE_SIMD_ROWS
/* one row of W in the file's layout times a's rows, the outliers added: out[k * ld] */
static inline void one_row(int fmt, const uint8_t *row, int64_t cols, const acts *a,
                           const ol_plan *pl, float *out, int64_t ld) {
    float o[MAX_BATCH];
    simd_row(fmt, row, cols, a, o);
    if (pl->nu) {
        float t[MAX_BATCH];
        plan_row(fmt, row, pl, t);
        for (int64_t k = 0; k < a->nx; k++) o[k] += t[k];
    }
    for (int64_t k = 0; k < a->nx; k++) out[k * ld] = o[k];
}
#endif

#ifdef HAVE_ZMM_VBMI
/* matmul_q of a repacked weight: whole groups, then the rows after them one at a time. The
 * activations come in `tiles` of up to MAX_BATCH rows (a[i], pl[i]: rows 16i.. of x and of
 * out): each group is read once for all of them, from cache after the first. */
static void matmul_r16(int rfmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                       const acts *a, const ol_plan *pl, int64_t tiles, int par, int64_t chunk,
                       float *out) {
    const int64_t ng = rows / 16, units = ng + rows - 16 * ng;
    const int64_t gchunk = chunk / 16 > 1 ? chunk / 16 : 1;
    const int use = par ? gov_threads() : 1;
    double done[GOV_MAX_THREADS], t0 = now_s();
#pragma omp parallel num_threads(use) if (use > 1)
    {
#pragma omp for schedule(dynamic, gchunk) nowait
        for (int64_t u = 0; u < units; u++) {
            for (int64_t i = 0; i < tiles; i++) {
                const acts *ai = &a[i];
                const int64_t nx = ai->nx;
                float *oi = out + MAX_BATCH * i * rows;
                if (u < ng) {
                    r16_group(rfmt, w + 16 * u * row_bytes, cols, ai->xq, ai->xd, ai->xs, ai->xsum, nx,
                              &pl[i], oi + 16 * u, rows);
                    continue;
                }
                const int64_t r = 16 * ng + (u - ng);
                one_row(R16_NATURAL(rfmt), w + r * row_bytes, cols, ai, &pl[i], oi + r, rows);
            }
        }
#ifdef _OPENMP
        done[omp_get_thread_num()] = now_s();
#endif
    }
    if (use > 1) gov_note(t0, done, use);
}

/* cs_matmul_qx of a repacked weight for any number of activation rows (a prefill): one call,
 * so one parallel loop whose threads share the whole product (calls of 16 rows were each
 * too short for a second thread's wake-up), each group read from memory once. Per row the
 * same arithmetic as 16 or 1 at a time: the same bits. */
static void matmul_r16_many(int rfmt, const uint8_t *w, int64_t rows, int64_t row_bytes,
                            int64_t cols, const float *x, int64_t nx, float *out) {
    const int64_t nv = nx * cols, nbx = cols / 32, tiles = (nx + MAX_BATCH - 1) / MAX_BATCH;
    int8_t *xq = (int8_t *)malloc((size_t)nv);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(2 * (nv / 32)));
    float *xsum = xd + nv / 32;
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(nv / 16));
    outliers *ol = (outliers *)malloc(sizeof(outliers) * (size_t)nx);
    acts *a = (acts *)malloc(sizeof(acts) * (size_t)tiles);
    ol_plan *pl = (ol_plan *)malloc(sizeof(ol_plan) * (size_t)tiles);
    /* each row's int8 blocks and outliers on its own (the same bits however rows are dealt):
     * on one thread this was ~1.5 ms of a 512-row call, every matmul of a prefill */
    const int use = gov_threads_for(nv);
#pragma omp parallel for num_threads(use) if (use > 1) schedule(static)
    for (int64_t k = 0; k < nx; k++) {
        cs_quantize_act(x + k * cols, 1, cols, xq + k * cols, xd + k * nbx, xs + 2 * k * nbx);
        take_outliers(x + k * cols, cols, xq + k * cols, xd + k * nbx, xs + 2 * k * nbx, &ol[k]);
        for (int64_t i = k * nbx; i < (k + 1) * nbx; i++)
            xsum[i] = xd[i] * (float)(xs[2 * i] + xs[2 * i + 1]);
    }
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r0 = MAX_BATCH * i, n = nx - r0 < MAX_BATCH ? nx - r0 : MAX_BATCH;
        a[i] = (acts){xq + r0 * cols, xd + r0 * nbx, xs + 2 * r0 * nbx, cols, n, xsum + r0 * nbx, NULL, NULL};
        for (int k = 0; k < (int)n; k++) plan_add(&pl[i], rfmt, k, &ol[r0 + k], 0, cols);
    }
    matmul_r16(rfmt, w, rows, row_bytes, cols, a, pl, tiles, 1, chunk_rows(rows, row_bytes), out);
    free(xq);
    free(xd);
    free(xs);
    free(ol);
    free(a);
    free(pl);
}
#endif

/* out (nx, rows) = x @ W.T for a quantized W (rows, row_bytes); x given as cs_quantize_act,
 * and, unless ol is NULL, each row of x's outliers (take_outliers) */
static void matmul_q(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                     const int8_t *xq, const float *xd, const int32_t *xs, int64_t nx,
                     const outliers *ol, float *out) {
    const int n = block_elems(fmt);
    const int64_t nblocks = cols / n, bbytes = row_bytes / nblocks;
    const int64_t chunk = chunk_rows(rows, row_bytes);
    const int par = rows * row_bytes >= PAR_MIN_BYTES && rows > chunk;
    ol_plan pl;
    for (int k = 0; k < (int)nx; k++) plan_add(&pl, fmt, k, ol ? &ol[k] : NULL, 0, cols);
#ifdef HAVE_SIMD_ROWS
    /* per call: block sums as floats, and (AVX-512) the interleaved activations; on the stack
     * up to 16 x 4096 values, else one allocation */
    enum { STACK = MAX_BATCH * 4096 };
    float xsum[STACK / 32];
    int8_t xt_stack[STACK] __attribute__((aligned(64)));
    const int64_t nv = nx * cols;
    void *heap = nv > STACK ? malloc((size_t)nv + sizeof(float) * (size_t)(nv / 32)) : NULL;
    int8_t *xt = heap ? (int8_t *)heap : xt_stack;
    float *xsum_p = heap ? (float *)(xt + nv) : xsum;
    for (int64_t i = 0; i < nv / 32; i++) xsum_p[i] = xd[i] * (float)(xs[2 * i] + xs[2 * i + 1]);
    acts a = {xq, xd, xs, cols, nx, xsum_p, NULL, NULL};
#ifdef HAVE_ZMM_ROWS
    if (quad_layout(fmt, nx, cols, xq, xt, &a)) a.xt = xt;
#else
    (void)xt;
#endif
#ifdef HAVE_ZMM_VBMI
    if (IS_R16(fmt)) {
        matmul_r16(fmt, w, rows, row_bytes, cols, &a, &pl, 1, par, chunk, out);
        free(heap);
        return;
    }
#endif
    const int use = par ? gov_threads() : 1;
    double done[GOV_MAX_THREADS], t0 = now_s();
#pragma omp parallel num_threads(use) if (use > 1)
    {
#pragma omp for schedule(dynamic, chunk) nowait
        for (int64_t r = 0; r < rows; r++) one_row(fmt, w + r * row_bytes, cols, &a, &pl, out + r, rows);
#ifdef _OPENMP
        done[omp_get_thread_num()] = now_s();
#endif
    }
    if (use > 1) gov_note(t0, done, use);
    free(heap);
    return;
#endif
#pragma omp parallel for schedule(dynamic, chunk) if (par)
    for (int64_t r = 0; r < rows; r++) {
        float acc[MAX_BATCH] = {0};
        decoded dw;
        const uint8_t *row = w + r * row_bytes;
        for (int64_t b = 0; b < nblocks; b++) {
            decode(fmt, row + b * bbytes, &dw);
            const int64_t off = b * n;
            for (int64_t k = 0; k < nx; k++) {
                acc[k] += dot_decoded(&dw, n, xq + k * cols + off, xd + (k * cols + off) / 32,
                                      xs + (k * cols + off) / 16);
            }
        }
        if (pl.nu) {
            float t[MAX_BATCH];
            plan_row(fmt, row, &pl, t);
            for (int64_t k = 0; k < nx; k++) acc[k] += t[k];
        }
        for (int64_t k = 0; k < nx; k++) out[k * rows + r] = acc[k];
    }
}

void cs_matmul_q(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                 const int8_t *xq, const float *xd, const int32_t *xs, int64_t nx, float *out) {
    matmul_q(fmt, w, rows, row_bytes, cols, xq, xd, xs, nx, NULL, out);
}

/* The same, from float activations: quantized here into a scratch buffer, one call per matmul
 * (the Python side then needs no activation buffers of its own), each row's outliers taken
 * out and multiplied in float. nx <= MAX_BATCH, or any nx for a repacked weight. */
void cs_matmul_qx(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                  const float *x, int64_t nx, float *out) {
    enum { STACK = MAX_BATCH * 4096 }; /* values: on the stack up to this, else allocated */
    int8_t q_stack[STACK] __attribute__((aligned(64)));
    float d_stack[STACK / 32];
    int32_t s_stack[STACK / 16];
    const int64_t nv = nx * cols;
#ifdef HAVE_ZMM_VBMI
    if (nx > MAX_BATCH && IS_R16(fmt)) {
        matmul_r16_many(fmt, w, rows, row_bytes, cols, x, nx, out);
        return;
    }
#endif
    void *heap = nv > STACK ? malloc((size_t)nv + (sizeof(float) + 2 * sizeof(int32_t)) * (size_t)(nv / 32)) : NULL;
    int8_t *xq = heap ? (int8_t *)heap : q_stack;
    float *xd = heap ? (float *)(xq + nv) : d_stack; /* nv is a multiple of 32: aligned */
    int32_t *xs = heap ? (int32_t *)(xd + nv / 32) : s_stack;
    outliers ol[MAX_BATCH];
    cs_quantize_act(x, nx, cols, xq, xd, xs);
    for (int64_t k = 0; k < nx; k++)
        take_outliers(x + k * cols, cols, xq + k * cols, xd + k * (cols / 32),
                      xs + k * (cols / 16), &ol[k]);
    matmul_q(fmt, w, rows, row_bytes, cols, xq, xd, xs, nx, ol, out);
    free(heap);
}

/* ---- float weights (F16, BF16): widen 32 at a time, multiply in float ------------------- */

static inline void widen32(int fmt, const uint8_t *p, float *o) {
    for (int i = 0; i < 32; i++) {
        const uint16_t h = rd16(p + 2 * i);
        if (fmt == BF16) {
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(o + i, &bits, 4);
        } else {
            o[i] = fp16_to_f32(h);
        }
    }
}

void cs_matmul_f(int fmt, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                 int64_t nx, float *out) {
    const int64_t chunk = chunk_rows(rows, 2 * cols);
    const int par = rows * 2 * cols >= PAR_MIN_BYTES && rows > chunk;
#if defined(HAVE_SIMD_ROWS) && defined(__F16C__)
    if (cols % 32 == 0 && nx == 1) { /* four accumulators: one would wait on the FMA latency */
#pragma omp parallel for schedule(dynamic, chunk) if (par)
        for (int64_t r = 0; r < rows; r++) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            const uint8_t *row = w + r * cols * 2;
            for (int64_t c = 0; c < cols; c += 32) {
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * (c + 8 * j)));
                    const __m256 wf = fmt == BF16
                        ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                        : _mm256_cvtph_ps(h);
                    acc[j] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + c + 8 * j), acc[j]);
                }
            }
            out[r] = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        }
        return;
    }
    if (cols % 8 == 0) {
#pragma omp parallel for schedule(dynamic, chunk) if (par)
        for (int64_t r = 0; r < rows; r++) {
            __m256 acc[MAX_BATCH];
            for (int64_t k = 0; k < nx; k++) acc[k] = _mm256_setzero_ps();
            const uint8_t *row = w + r * cols * 2;
            for (int64_t c = 0; c < cols; c += 8) {
                const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * c));
                const __m256 wf = fmt == BF16
                    ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                    : _mm256_cvtph_ps(h);
                for (int64_t k = 0; k < nx; k++)
                    acc[k] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + k * cols + c), acc[k]);
            }
            for (int64_t k = 0; k < nx; k++) out[k * rows + r] = hsum(acc[k]);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(dynamic, chunk) if (par)
    for (int64_t r = 0; r < rows; r++) {
        float acc[MAX_BATCH] = {0}, wf[32];
        const uint8_t *row = w + r * cols * 2;
        int64_t c = 0;
        for (; c + 32 <= cols; c += 32) {
            widen32(fmt, row + 2 * c, wf);
            for (int64_t k = 0; k < nx; k++) {
                float s = 0.0f;
                for (int i = 0; i < 32; i++) s += wf[i] * x[k * cols + c + i];
                acc[k] += s;
            }
        }
        for (; c < cols; c++) { /* a tail shorter than 32 */
            const uint16_t h = rd16(row + 2 * c);
            float v;
            if (fmt == BF16) { const uint32_t bits = (uint32_t)h << 16; memcpy(&v, &bits, 4); }
            else v = fp16_to_f32(h);
            for (int64_t k = 0; k < nx; k++) acc[k] += v * x[k * cols + c];
        }
        for (int64_t k = 0; k < nx; k++) out[k * rows + r] = acc[k];
    }
}

/* ---- dequantize rows to float32 (prefill tiles for BLAS) ------------------------------ */

/* One row; always inlined into a switch on a constant format, so decode()'s switch folds
 * away and the float loop vectorizes (dequantizing is prefill's tile cost beside BLAS). */
static inline __attribute__((always_inline)) void dequant_row(int fmt, const uint8_t *row,
                                                              int64_t nblocks, int64_t bbytes,
                                                              float *y) {
    const int n = block_elems(fmt);
    decoded dw;
    for (int64_t b = 0; b < nblocks; b++, y += n) {
        decode(fmt, row + b * bbytes, &dw);
        for (int g = 0; g < n / 16; g++) {
            const float sc = dw.scale[g], mn = dw.min[g];
            for (int i = 0; i < 16; i++) y[16 * g + i] = sc * dw.q[16 * g + i] - mn;
        }
    }
}

/* Row r of a weight (rows, row_bytes) as floats: from its group's lanes when repacked */
static void dequant_one(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                        int64_t r, float *y) {
    const int nat = R16_NATURAL(fmt), n = block_elems(nat);
    const int64_t nb = cols / n, bb = row_bytes / nb;
#ifdef HAVE_ZMM_VBMI
    if (IS_R16(fmt) && r < rows / 16 * 16) { /* the row's blocks as in the file, then as dequant_row */
        const uint8_t *g = w + r / 16 * 16 * row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t one[210];
            r16_lane(nat, (uint8_t *)(g + R16_BLOCK(nat) * b), (int)(r % 16), one, 1);
            if (nat == Q8_0) dequant_row(Q8_0, one, 1, 34, y + n * b);
            else if (nat == Q4_0) dequant_row(Q4_0, one, 1, 18, y + n * b);
            else if (nat == Q4_K) dequant_row(Q4_K, one, 1, 144, y + n * b);
            else dequant_row(Q6_K, one, 1, 210, y + n * b);
        }
        return;
    }
#else
    (void)rows;
#endif
    const uint8_t *row = w + r * row_bytes;
    switch (nat) {
    case Q8_0: dequant_row(Q8_0, row, nb, bb, y); break;
    case Q4_0: dequant_row(Q4_0, row, nb, bb, y); break;
    case Q4_1: dequant_row(Q4_1, row, nb, bb, y); break;
    case Q4_K: dequant_row(Q4_K, row, nb, bb, y); break;
    case Q6_K: dequant_row(Q6_K, row, nb, bb, y); break;
    default: dequant_row(Q2_K, row, nb, bb, y); break;
    }
}

/* out (n, cols) = rows ids[0..n) of w as floats (an embedding lookup, the head's best rows) */
void cs_dequantize_rows(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                        const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) dequant_one(fmt, w, rows, row_bytes, cols, ids[i], out + i * cols);
}

void cs_dequantize(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                   float *out) {
    const int64_t chunk = IS_R16(fmt) ? 16 : chunk_rows(rows, row_bytes);
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t r = 0; r < rows; r++) dequant_one(fmt, w, rows, row_bytes, cols, r, out + r * cols);
}

/* exp(x) for x <= 0 as 2^(x log2 e): integer part into the exponent bits, fractional part by
 * its Taylor series to degree 7 (relative error < 2e-7). Unlike libm's expf, gcc vectorizes it:
 * fast-math here as in its callers (all fast-math), since gcc inlines a function only into
 * callers of the same math flags; without it each value was a call, and floorf and fmaxf
 * would not vectorize anyway (they need no-trapping and finite math). */
__attribute__((optimize("fast-math"))) static inline float exp_neg(float x) {
    const float t = fmaxf(x, -87.0f) * 1.44269504088896341f;
    const float fi = floorf(t), f = t - fi;
    float p = 1.5252734e-5f;
    p = p * f + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)fi + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* ---- a prefill's attention probabilities -------------------------------------------------
 * x (rows, s): the raw scores q.k of a block of t queries at positions s - t .. s - 1 (row r
 * is query r % t: rows are (heads, t) flattened) -> in place, softmax(scale * x) over the keys
 * each query sees (the first s - t + r % t + 1), zero beyond. Why: numpy's scale, mask, max,
 * subtract, exp, sum and divide were seven passes on one core. The arithmetic is attend1's
 * (fast-math: its exp, a reduction in any order); a row holding a NaN or an infinity comes
 * out all NaN, as numpy's does, so a corrupt weight's NaN still reaches the layer's check. */
static int all_finite(const float *p, int64_t n) { /* strict IEEE: NaN compares false */
    int bad = 0;
    for (int64_t j = 0; j < n; j++) bad |= !(fabsf(p[j]) <= FLT_MAX);
    return !bad;
}

__attribute__((optimize("fast-math"))) static void softmax_seen(float *restrict p, int64_t seen,
                                                                float scale) {
    float m = -FLT_MAX, sum = 0.0f;
    for (int64_t j = 0; j < seen; j++) { p[j] *= scale; m = fmaxf(m, p[j]); }
    for (int64_t j = 0; j < seen; j++) { p[j] = exp_neg(p[j] - m); sum += p[j]; }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < seen; j++) p[j] *= inv;
}

void cs_softmax_causal(float *x, int64_t rows, int64_t t, int64_t s, float scale) {
    const int use = gov_threads_for(rows * s);
#pragma omp parallel for num_threads(use) if (use > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *p = x + r * s;
        const int64_t seen = s - t + r % t + 1;
        if (all_finite(p, seen)) softmax_seen(p, seen, scale);
        else for (int64_t j = 0; j < seen; j++) p[j] = NAN;
        for (int64_t j = seen; j < s; j++) p[j] = 0.0f;
    }
}

/* ---- attention for one new token --------------------------------------------------------
 * q (H, D); k, v head-major (Hkv, cap, D) with S tokens filled; out (H, D). Decode needs no
 * mask: the new token sees every cached one. One call replaces a dozen small numpy ops. */
/* fast-math here only: softmax is insensitive to summation order, and it lets gcc vectorize
 * the max/sum reductions and the exp; every other kernel keeps strict IEEE semantics.
 * The g query heads that share a KV head are done together, so each cached K and V row is
 * read once per step rather than g times (the cache is what this loop streams). */
#define MAX_GROUP 16
static void attend1(const float *restrict q, const float *restrict k, const float *restrict v,
                    int64_t n_heads, int64_t n_kv, int64_t cap, int64_t s_len, int64_t d,
                    float scale, float *restrict out, float *restrict scratch);

void cs_attend1(const float *q, const float *k, const float *v, int64_t n_heads, int64_t n_kv,
                int64_t cap, int64_t s_len, int64_t d, float scale, float *out) {
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(s_len * n_heads));
    attend1(q, k, v, n_heads, n_kv, cap, s_len, d, scale, out, scratch);
    free(scratch);
}

/* scratch: n_heads * s_len floats (the probabilities), so the decode loop need not allocate */
__attribute__((optimize("fast-math"))) static void attend1(
    const float *restrict q, const float *restrict k, const float *restrict v, int64_t n_heads,
    int64_t n_kv, int64_t cap, int64_t s_len, int64_t d, float scale, float *restrict out,
    float *restrict scratch) {
    const int64_t g = n_heads / n_kv;
#pragma omp parallel for schedule(static) if (n_heads * s_len * d > 262144)
    for (int64_t kvh = 0; kvh < n_kv; kvh++) {
        const float *restrict kh = k + kvh * cap * d, *restrict vh = v + kvh * cap * d;
        float *restrict p = scratch + kvh * g * s_len;
        float acc_o[MAX_GROUP * 512] = {0}, mx[MAX_GROUP], sum[MAX_GROUP];
        for (int64_t t = 0; t < s_len; t++) {
            for (int64_t j = 0; j < g; j++) {
                const float *restrict qh = q + (kvh * g + j) * d;
                float acc = 0.0f;
                for (int64_t i = 0; i < d; i++) acc += qh[i] * kh[t * d + i];
                p[j * s_len + t] = acc * scale;
            }
        }
        for (int64_t j = 0; j < g; j++) {
            float m = -INFINITY, s = 0.0f;
            float *restrict pj = p + j * s_len;
            for (int64_t t = 0; t < s_len; t++) m = fmaxf(m, pj[t]);
            for (int64_t t = 0; t < s_len; t++) { pj[t] = exp_neg(pj[t] - m); s += pj[t]; }
            mx[j] = m;
            sum[j] = s;
        }
        for (int64_t t = 0; t < s_len; t++) {
            for (int64_t j = 0; j < g; j++) {
                const float w = p[j * s_len + t];
                float *restrict o = acc_o + j * d;
                for (int64_t i = 0; i < d; i++) o[i] += w * vh[t * d + i];
            }
        }
        for (int64_t j = 0; j < g; j++) {
            const float inv = 1.0f / sum[j];
            for (int64_t i = 0; i < d; i++) out[(kvh * g + j) * d + i] = acc_o[j * d + i] * inv;
        }
        (void)mx;
    }
}

/* ---- one llama-family layer for one token, allocation-free -------------------------------
 * The whole block — RMSNorm, Q/K/V (+bias), QK-norm, RoPE, KV-cache write, attention, output
 * projection, residual, RMSNorm, SwiGLU, residual — in one call, on buffers the caller
 * allocated once. Matrices are {kind, format, pointer, rows, row bytes}: kind 0 quantized
 * (int8 activations), kind 1 F16/BF16 (float activations). */
typedef struct { int64_t kind, fmt; const uint8_t *w; int64_t rows, row_bytes; } mat;

typedef struct {
    mat q, k, v, o, gate, up, down;
    const float *attn_norm, *ffn_norm, *q_bias, *k_bias, *v_bias, *q_norm, *k_norm;
    int64_t d, n_heads, n_kv, head_dim, ffn, rope_dim, rope_neox;
    float eps, scale;
} llama_layer;

static void rms(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

static void rope(float *v, int64_t heads, int64_t hd, int64_t dim, int neox, const float *cs,
                 const float *sn) {
    for (int64_t h = 0; h < heads; h++) {
        float *r = v + h * hd;
        for (int64_t i = 0; i < dim / 2; i++) {
            const int64_t ia = neox ? i : 2 * i, ib = neox ? i + dim / 2 : 2 * i + 1;
            const float a = r[ia], b = r[ib];
            r[ia] = a * cs[i] - b * sn[i];
            r[ib] = b * cs[i] + a * sn[i];
        }
    }
}

/* rope for t tokens (a prefill's q or k, (t, heads, hd) in place; cs/sn (t, dim/2)), tokens
 * over the threads: each token as a decode step rotates it (the same bits), and numpy's six
 * strided passes no longer run on one core */
void cs_rope_rows(float *v, int64_t t, int64_t heads, int64_t hd, int64_t dim, int neox,
                  const float *cs, const float *sn) {
    const int use = gov_threads_for(t * heads * dim);
#pragma omp parallel for num_threads(use) if (use > 1) schedule(static)
    for (int64_t i = 0; i < t; i++)
        rope(v + i * heads * hd, heads, hd, dim, neox, cs + i * (dim / 2), sn + i * (dim / 2));
}

/* Streaming-read bandwidth probe: sum n bytes as 64-bit words over all threads (bench only). */
uint64_t cs_stream_read(const uint64_t *p, int64_t n_words) {
    uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n_words; i++) total += p[i];
    return total;
}

void cs_set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

int cs_max_batch(void) { return MAX_BATCH; }

#include "deepseek.c"
#include "llama.c"
