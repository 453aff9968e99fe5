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
 * decoded block). Rows of W are split over OpenMP threads. Q4_0, Q4_1, Q8_0, Q4_K and Q6_K
 * weights may also come repacked in groups of 16 rows (cs_repack, "in 16-row groups" below), read in
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
enum { Q4_0R = 102, Q4_1R = 103, Q8_0R = 108, Q2_KR = 110, Q3_KR = 111, Q4_KR = 112, Q5_KR = 113,
       Q6_KR = 114, IQ2_XXSR = 116, IQ2_XSR = 117, IQ3_XXSR = 118, IQ1_SR = 119, IQ4_NLR = 120,
       IQ3_SR = 121, IQ2_SR = 122, IQ4_XSR = 123, IQ1_MR = 129, TQ1_0R = 134, TQ2_0R = 135, MXFP4R = 139 };
#define IS_R16(f) ((f) == Q4_0R || (f) == Q4_1R || (f) == Q8_0R || ((f) >= Q2_KR && (f) <= Q6_KR) \
                   || (f) == IQ4_NLR || (f) == IQ4_XSR || (f) == TQ2_0R || (f) == IQ1_SR || (f) == IQ2_XXSR \
                   || (f) == IQ1_MR || ((f) >= IQ2_XSR && (f) <= IQ3_XXSR) || (f) == IQ3_SR || (f) == IQ2_SR \
                   || (f) == TQ1_0R || (f) == MXFP4R)
#define R16_NATURAL(f) (IS_R16(f) ? (f) - 100 : (f))
#define MAX_BATCH 16
/* Activation rows a repacked weight's tile takes at once (a prefill): each 16-row group's
 * blocks are unpacked once per tile, so a larger tile unpacks them fewer times (the codebook
 * formats' gathers, the K-quants' bit moving). Each row's sum is its own: no bit depends on it. */
#ifndef R16_TILE /* -DR16_TILE=16 (CELLSWARM_CFLAGS): another build to compare */
#define R16_TILE 64
#endif

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

/* The threads cs_set_threads asked for, for every thread of the process: OpenMP's own
 * setting (omp_set_num_threads) belongs to the thread that calls it, and a stage computes on
 * an executor's thread, not the one that loaded it, so its kernels ran on every core with
 * `--threads 1` (three stages on two cores: each loop's second thread waited for a core).
 * 0 until set: OpenMP's default (OMP_NUM_THREADS, else the cores). */
static int cs_threads_set;

static int max_threads(void) {
#ifdef _OPENMP
    return cs_threads_set > 0 ? cs_threads_set : omp_get_max_threads();
#else
    return 1;
#endif
}

static int gov_threads(void) { /* threads for the next parallel loop */
#ifdef _OPENMP
    const int nt = max_threads();
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

/* GGUF is little-endian: multi-byte fields are read byte by byte (one load where the CPU is
 * little-endian too; right on a big-endian PowerPC, the PS3's) */
static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (uint16_t)p[1] << 8); }
static inline float rdf32(const uint8_t *p) {
    const uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

/* a Q6_K block's 256 weights, q - 32 */
static inline void q6_k_values(const uint8_t *b, int8_t *q) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int n = 0; n < 2; n++) {
        const uint8_t *l8 = ql + 64 * n, *h8 = qh + 32 * n;
        int8_t *y = q + 128 * n;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)(((l8[l] & 0xF) | (((h8[l] >> 0) & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

static inline void decode_q6_k(const uint8_t *b, decoded *o) {
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = fp16_to_f32(rd16(b + 208));
    q6_k_values(b, o->q);
    for (int g = 0; g < 16; g++) {
        o->scale[g] = d * sc[g];
        o->min[g] = 0.0f;
    }
}

/* a Q2_K block's 256 weights (0..3) */
static inline void q2_k_values(const uint8_t *b, int8_t *y0) {
    const uint8_t *qs = b + 16;
    for (int n = 0; n < 2; n++) {
        const uint8_t *q = qs + 32 * n;
        for (int j = 0; j < 4; j++) {
            const int shift = 2 * j;
            int8_t *y = y0 + 128 * n + 32 * j;
            for (int l = 0; l < 32; l++) y[l] = (int8_t)((q[l] >> shift) & 3);
        }
    }
}

static inline void decode_q2_k(const uint8_t *b, decoded *o) {
    const uint8_t *scales = b;
    const float d = fp16_to_f32(rd16(b + 80)), dmin = fp16_to_f32(rd16(b + 82));
    q2_k_values(b, o->q);
    for (int g = 0; g < 16; g++) {
        o->scale[g] = d * (scales[g] & 0xF);
        o->min[g] = dmin * (scales[g] >> 4);
    }
}

#include "lowbit.c"

static inline int block_elems(int fmt) {
    return is_lowbit(fmt) ? lowbit_elems(fmt) : fmt == Q2_K || fmt == Q4_K || fmt == Q6_K ? 256 : 32;
}

static inline void decode(int fmt, const uint8_t *b, decoded *o) {
    if (is_lowbit(fmt)) {
        decode_lowbit(fmt, b, o);
        return;
    }
    switch (fmt) {
    case Q8_0: decode_q8_0(b, o); break;
    case Q4_0: decode_q4_0(b, o); break;
    case Q4_1: decode_q4_1(b, o); break;
    case Q4_K: decode_q4_k(b, o); break;
    case Q6_K: decode_q6_k(b, o); break;
    default: decode_q2_k(b, o); break;
    }
}


#include "exact.c"


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
            if (!(xd[b] > top)) continue; /* the passed list only for a block that beats it */
            int skip = 0;
            for (int i = 0; i < n_passed; i++) skip |= passed[i] == b;
            if (!skip) { top = xd[b]; best = b; }
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
    return fp16_to_f32(rd16(p));
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
#define PLAN_MAX (R16_TILE * OUTLIERS)
typedef struct {
    int nx, nu;
    int32_t col[PLAN_MAX], boff[PLAN_MAX], qoff[PLAN_MAX], sh[PLAN_MAX];
    int n[R16_TILE];
    uint8_t use[R16_TILE][OUTLIERS];
    float val[R16_TILE][OUTLIERS];
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
    case Q4_K: case Q6_K: case Q2_K: return k_weight_at(fmt, row, p->col[u]);
    default: return lowbit_weight_at(fmt, row, p->col[u]);
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

/* ---- Q4_0, Q4_1, Q8_0, Q2_K, Q4_K and Q6_K in 16-row groups (AVX-512 VNNI, AVX2) ---------------------
 * Why: a row at a time, a decode-shaped row (1024 columns: 32 blocks) pays a reduction across
 * lanes per 8 blocks, a gather of its scales and the fold of its 16 accumulators, and ran at
 * ~9 GB/s where one core streams ~34 (Q6_K, every llama-quantize file's output head: ~7 GB/s,
 * 38% of a Q4_0 file's decode). As llama.cpp repacks at load, whole groups of 16 rows are laid
 * out so that one register holds 4 bytes of each of the 16 rows ("chunk k lane r = row r's
 * bytes 4k..4k+3"), per block of the format:
 * - Q4_0, Q8_0 (288, 544 bytes): the 16 rows' f16 scales (32 bytes), then the weight bytes'
 *   chunks (Q4_0: 4 of nibbles, Q8_0: 8 of int8); Q4_1 (320): 16 d, 16 m, 4 chunks;
 * - Q4_K (2304): 16 d, 16 dmin (f16), 3 chunks of the 12 scale bytes, 32 of the 128 nibbles;
 * - Q6_K (3360): 16 d (f16), then 52 chunks: the 4 of int8 scales, then in the order the
 *   kernel reads them (read out of order, a 41 MB head went at 7 GB/s) for each half n and
 *   c = 0..7 the low nibbles' words 16n + c and 16n + 8 + c and the high bit pairs' 8n + c.
 * A block of 16 rows is then a few dpbusd against broadcast activations, with no reduction
 * across lanes, and the group's bytes are one stream. A group takes exactly the bytes its 16
 * rows did; rows after the last whole group stay as they were.
 *
 * The same bits as exact.c's row kernel, lane by lane (lanes are rows): per unit u (a 32-block,
 * Q4_K's sub-block of 32, Q6_K's group of 16) the exact integer n_u (dpbusd multiplies
 * unsigned by signed: Q4_0/Q8_0/Q6_K read as u = q + o, o = 8, 128, 32, and o times the
 * unit's activation sum taken off), t_u = (float)n_u * (ws_u * xd_u) - wm_u * xsum_u with
 * ws_u, wm_u computed as exact.c computes them (d * (float)sc), A[u % 16] += t_u in order of
 * u, each A a register; then exact.c's tree, register by register. Where wm = 0 (Q4_0, Q8_0,
 * Q6_K) the "- 0 * xsum" is left out: it changes at most a zero's sign, which an accumulator
 * that starts at +0 never keeps. The outliers as plan_row adds them, 16 rows at once.
 * tests/test_bits_everywhere.py holds this build against the portable one, which never
 * repacks; tests/test_repack.py every format, shape and batch against the file's layout.
 * On AVX2 the same code runs on pairs of registers (below): a row kernel had cost 1.0-1.8
 * instructions a weight where the groups take 0.24-0.55 (python -m bench.instructions). */
/* The kernels below are written once over 16 lanes (l16i: 16 int32 lanes, or 64 bytes; l16f:
 * 16 floats), lane r holding row r of a group. With AVX-512 VNNI a lane set is one register
 * and each l16_ name is the _mm512_ intrinsic of that name; with AVX2 it is two registers
 * (rows 0-7, rows 8-15) and each l16_ op is its two _mm256_ halves, dpbusd a maddubs and a
 * madd. Both compute the same integers and the same float operations in the same order, so
 * the same bits: only the instruction count differs. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_R16 1
#define R16_ZMM 1
#define R16_UNROLL2 _Pragma("GCC unroll 2")
#define R16_UNROLL4 _Pragma("GCC unroll 4")
#define R16_UNROLL8 _Pragma("GCC unroll 8")
#define R16_UNROLL16 _Pragma("GCC unroll 16")
typedef __m512i l16i;
typedef __m512 l16f;
#define l16_add_epi32 _mm512_add_epi32
#define l16_sub_epi32 _mm512_sub_epi32
#define l16_and_si512 _mm512_and_si512
#define l16_or_si512 _mm512_or_si512
#define l16_xor_si512 _mm512_xor_si512
#define l16_srli_epi16 _mm512_srli_epi16
#define l16_slli_epi16 _mm512_slli_epi16
#define l16_srli_epi32 _mm512_srli_epi32
#define l16_slli_epi32 _mm512_slli_epi32
#define l16_srai_epi32 _mm512_srai_epi32
#define l16_set1_epi8 _mm512_set1_epi8
#define l16_set1_epi32 _mm512_set1_epi32
#define l16_setzero_si512 _mm512_setzero_si512
#define l16_loadu_si512 _mm512_loadu_si512
#define l16_ternarylogic_epi32 _mm512_ternarylogic_epi32
#define l16_shuffle_epi8 _mm512_shuffle_epi8
#define l16_add_epi8 _mm512_add_epi8
#define l16_sub_epi8 _mm512_sub_epi8
/* 0xFF in each byte of a that has every bit of the same byte of bits, else 0 */
/* v with its bytes negated where a has any bit of bits (one bit a byte) */
static inline __m512i l16_negate_bytes(__m512i v, __m512i a, __m512i bits) {
    return _mm512_mask_sub_epi8(v, _mm512_test_epi8_mask(a, bits), _mm512_setzero_si512(), v);
}
/* 16 int32 from base[idx[lane]] */
#ifdef CELLSWARM_MEASURE_NO_GATHERS /* arithmetic in a gather's place (bench.kernel_parts) */
#define l16_i32gather_epi32(idx, base) _mm512_add_epi32(idx, _mm512_set1_epi32(*(const int32_t *)(base)))
#define l16_i32gather_epi64(idx, base) \
    _mm512_add_epi64(_mm512_cvtepi32_epi64(idx), _mm512_set1_epi64(*(const long long *)(base)))
#else
#define l16_i32gather_epi32(idx, base) _mm512_i32gather_epi32(idx, (const void *)(base), 4)
#define l16_i32gather_epi64(idx, base) _mm512_i32gather_epi64(idx, base, 8)
#endif
static inline __m512i l16_gather32(__m512i idx, const int32_t *base) { return l16_i32gather_epi32(idx, base); }
/* the 8-byte entries index (16 lanes) names: v[0] their bytes 0-3, v[1] bytes 4-7. Two 8-lane
 * gathers of 8 bytes and two permutes: Zen 4's gathers cost by the element, so half of two
 * 16-lane gathers of 4 bytes */
static inline void l16_gather64(__m512i index, const void *base, __m512i v[2]) {
    const __m512i g0 = l16_i32gather_epi64(_mm512_castsi512_si256(index), base);
    const __m512i g1 = l16_i32gather_epi64(_mm512_extracti64x4_epi64(index, 1), base);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    v[0] = _mm512_permutex2var_epi32(g0, even, g1);
    v[1] = _mm512_permutex2var_epi32(g0, _mm512_add_epi32(even, _mm512_set1_epi32(1)), g1);
}
#define l16_add_ps _mm512_add_ps
#define l16_sub_ps _mm512_sub_ps
#define l16_mul_ps _mm512_mul_ps
#define l16_cvtepi32_ps _mm512_cvtepi32_ps
#define l16_set1_ps _mm512_set1_ps
#define l16_setzero_ps _mm512_setzero_ps
#define l16_loadu_ps _mm512_loadu_ps
#define l16_storeu_ps _mm512_storeu_ps

/* s + u . (the 4 bytes at x, in every lane): the broadcast folded into the instruction's
 * memory operand ({1to16}), which GCC does not do for _mm512_set1_epi32 of a loaded int */
static inline __m512i dpbusd_bcst(__m512i s, __m512i u, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(u), "m"(*x));
    return s;
}

/* Q8_0's signed weights go to dpbusd as unsigned q + 128 (R16_Q8_OFF times the activations'
 * sum is taken off the unit) */
#define R16_Q8_OFF 128
static inline __m512i r16_q8(__m512i q, __m512i flip) { return _mm512_xor_si512(q, flip); }
#define dot_q8_bcst dpbusd_bcst

/* 16 f16 at p (16 rows' scales) as floats */
static inline __m512 r16_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* each lane's low 16 bits as an f16, as a float */
static inline __m512 l16_f16_bits(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
/* 16 little-endian u16 at p as int32 lanes */
static inline __m512i r16_u16(const uint8_t *p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)); }
/* a 16-byte table in every 128-bit lane */
static inline __m512i l16_table(const int8_t *t) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t)); }
/* all ones in each byte where a >= b, unsigned */
static inline __m512i l16_ge_epu8(__m512i a, __m512i b) { return _mm512_movm_epi8(_mm512_cmpge_epu8_mask(a, b)); }
/* the 16 bytes at p as 16 lanes */
static inline __m512i r16_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#define l16_castsi_ps _mm512_castsi512_ps

#elif defined(__AVX2__) && defined(__F16C__)
#define HAVE_R16 1
/* Not unrolled here: the accumulators are in memory either way (32 registers' worth), and
 * unrolled, the pairs of registers had made gcc's cc1 take 197 MB and 29 s for kernels.c,
 * over a 128 MiB node's memory (8 cold lab hosts timed out compiling); 147 MB and 21 s now,
 * for Q6_K's groups at 0.55 instructions a weight instead of 0.46 */
#define R16_UNROLL2
#define R16_UNROLL4
#define R16_UNROLL8
#define R16_UNROLL16 _Pragma("GCC unroll 1")
typedef struct { __m256i l, h; } l16i; /* rows 0-7, rows 8-15 */
typedef struct { __m256 l, h; } l16f;
#define L16_BOTH(T, op, ...) return (T){op(a.l, ##__VA_ARGS__), op(a.h, ##__VA_ARGS__)}
#define L16_PAIR(T, op) return (T){op(a.l, b.l), op(a.h, b.h)}
static inline l16i l16_add_epi32(l16i a, l16i b) { L16_PAIR(l16i, _mm256_add_epi32); }
static inline l16i l16_sub_epi32(l16i a, l16i b) { L16_PAIR(l16i, _mm256_sub_epi32); }
static inline l16i l16_and_si512(l16i a, l16i b) { L16_PAIR(l16i, _mm256_and_si256); }
static inline l16i l16_or_si512(l16i a, l16i b) { L16_PAIR(l16i, _mm256_or_si256); }
static inline l16i l16_xor_si512(l16i a, l16i b) { L16_PAIR(l16i, _mm256_xor_si256); }
static inline l16i l16_srli_epi16(l16i a, int n) { L16_BOTH(l16i, _mm256_srli_epi16, n); }
static inline l16i l16_slli_epi16(l16i a, int n) { L16_BOTH(l16i, _mm256_slli_epi16, n); }
static inline l16i l16_srli_epi32(l16i a, int n) { L16_BOTH(l16i, _mm256_srli_epi32, n); }
static inline l16i l16_slli_epi32(l16i a, int n) { L16_BOTH(l16i, _mm256_slli_epi32, n); }
static inline l16i l16_srai_epi32(l16i a, int n) { L16_BOTH(l16i, _mm256_srai_epi32, n); }
static inline l16i l16_set1_epi8(char c) { return (l16i){_mm256_set1_epi8(c), _mm256_set1_epi8(c)}; }
static inline l16i l16_set1_epi32(int c) { return (l16i){_mm256_set1_epi32(c), _mm256_set1_epi32(c)}; }
static inline l16i l16_setzero_si512(void) { return (l16i){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline l16i l16_loadu_si512(const void *p) {
    return (l16i){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)((const char *)p + 32))};
}
/* the two ternary logic functions the kernels use: 0xEC (a & c) | b, 0xF8 a | (b & c) */
static inline l16i l16_ternarylogic_epi32(l16i a, l16i b, l16i c, int imm) {
    return imm == 0xEC ? l16_or_si512(l16_and_si512(a, c), b) : l16_or_si512(a, l16_and_si512(b, c));
}
static inline l16f l16_add_ps(l16f a, l16f b) { L16_PAIR(l16f, _mm256_add_ps); }
static inline l16f l16_sub_ps(l16f a, l16f b) { L16_PAIR(l16f, _mm256_sub_ps); }
static inline l16f l16_mul_ps(l16f a, l16f b) { L16_PAIR(l16f, _mm256_mul_ps); }
static inline l16f l16_cvtepi32_ps(l16i a) { L16_BOTH(l16f, _mm256_cvtepi32_ps); }
static inline l16f l16_set1_ps(float f) { return (l16f){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline l16f l16_setzero_ps(void) { return (l16f){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline l16f l16_loadu_ps(const float *p) { return (l16f){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void l16_storeu_ps(float *p, l16f v) {
    _mm256_storeu_ps(p, v.l);
    _mm256_storeu_ps(p + 8, v.h);
}

/* s + u . (the 4 bytes at x, in every lane), u unsigned: maddubs pairs stay below 2^15 for
 * every u the kernels pass (nibbles, Q6_K's q + 32 < 64) against |x| <= 127 */
static inline l16i dpbusd_bcst(l16i s, l16i u, const int32_t *x) {
    const __m256i xb = _mm256_set1_epi32(*x), one = _mm256_set1_epi16(1);
    return (l16i){_mm256_add_epi32(s.l, _mm256_madd_epi16(_mm256_maddubs_epi16(u.l, xb), one)),
                  _mm256_add_epi32(s.h, _mm256_madd_epi16(_mm256_maddubs_epi16(u.h, xb), one))};
}

/* Q8_0's q + 128 would saturate maddubs: its weights stay signed, |q| times x with q's sign */
#define R16_Q8_OFF 0
static inline l16i r16_q8(l16i q, l16i flip) { (void)flip; return q; }
static inline __m256i dot_q8_half(__m256i s, __m256i q, __m256i xb) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xb, q));
    return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline l16i dot_q8_bcst(l16i s, l16i q, const int32_t *x) {
    const __m256i xb = _mm256_set1_epi32(*x);
    return (l16i){dot_q8_half(s.l, q.l, xb), dot_q8_half(s.h, q.h, xb)};
}

static inline l16f r16_f16(const uint8_t *p) {
    return (l16f){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline l16i r16_u16(const uint8_t *p) {
    return (l16i){_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline __m256 f16_bits_half(__m256i v) {
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
static inline l16f l16_f16_bits(l16i v) { return (l16f){f16_bits_half(v.l), f16_bits_half(v.h)}; }
static inline l16i l16_shuffle_epi8(l16i a, l16i b) { L16_PAIR(l16i, _mm256_shuffle_epi8); }
static inline l16i l16_add_epi8(l16i a, l16i b) { L16_PAIR(l16i, _mm256_add_epi8); }
static inline l16i l16_sub_epi8(l16i a, l16i b) { L16_PAIR(l16i, _mm256_sub_epi8); }
static inline __m256i negate_bytes_half(__m256i v, __m256i a, __m256i bits) {
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(a, bits), bits);
    return _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
}
static inline l16i l16_negate_bytes(l16i v, l16i a, l16i bits) {
    return (l16i){negate_bytes_half(v.l, a.l, bits.l), negate_bytes_half(v.h, a.h, bits.h)};
}
static inline l16i l16_gather32(l16i idx, const int32_t *base) {
    return (l16i){_mm256_i32gather_epi32((const int *)base, idx.l, 4), _mm256_i32gather_epi32((const int *)base, idx.h, 4)};
}
static inline void l16_gather64(l16i index, const void *base, l16i v[2]) {
    const l16i i2 = l16_slli_epi32(index, 1);
    v[0] = l16_gather32(i2, (const int32_t *)base);
    v[1] = l16_gather32(l16_add_epi32(i2, l16_set1_epi32(1)), (const int32_t *)base);
}
static inline l16i l16_table(const int8_t *t) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
    return (l16i){v, v};
}
static inline __m256i ge_epu8_half(__m256i a, __m256i b) { return _mm256_cmpeq_epi8(_mm256_max_epu8(a, b), a); }
static inline l16i l16_ge_epu8(l16i a, l16i b) { L16_PAIR(l16i, ge_epu8_half); }
static inline l16i r16_u8(const uint8_t *p) {
    return (l16i){_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                  _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline l16f l16_castsi_ps(l16i a) { return (l16f){_mm256_castsi256_ps(a.l), _mm256_castsi256_ps(a.h)}; }
#endif

#ifdef HAVE_R16
/* one row's block in the file; a group's block (16 rows') */
#define R16_BYTES(f) ((f) == Q8_0 ? 34 : (f) == Q4_K ? 144 : (f) == Q6_K ? 210 : (f) == Q2_K ? 84 \
                      : (f) == Q3_K ? 110 : (f) == Q5_K ? 176 : (f) == Q4_1 ? 20 : (f) == TQ2_0 ? 66 \
                      : (f) == IQ4_XS ? 136 : (f) == IQ1_S ? 50 : (f) == IQ2_XXS ? 66 : (f) == IQ1_M ? 56 \
                      : (f) == IQ2_XS ? 74 : (f) == IQ3_XXS ? 98 : (f) == IQ3_S ? 110 : (f) == IQ2_S ? 82 \
                      : (f) == TQ1_0 ? 54 : (f) == MXFP4 ? 17 : 18)
/* a group's block: each f16 field 32 bytes, each word of a row's block a 64-byte chunk */
#define R16_BLOCK(f) (16 * R16_BYTES(f))
#define R16_ELEMS(f) ((f) == Q8_0 || (f) == Q4_0 || (f) == Q4_1 || (f) == IQ4_NL || (f) == MXFP4 ? 32 : 256) /* a block's */

/* fold16 of 16 rows at once (A[j]: accumulator j of every row, lanes: rows) -> out[0..16) */
static inline void fold16_rows(l16f *A, float *out) {
    for (int j = 0; j < 8; j++) A[j] = l16_add_ps(A[j], A[j + 8]);
    for (int j = 0; j < 4; j++) A[j] = l16_add_ps(A[j], A[j + 4]);
    for (int j = 0; j < 2; j++) A[j] = l16_add_ps(A[j], A[j + 2]);
    l16_storeu_ps(out, l16_add_ps(A[0], A[1]));
}

/* CELLSWARM_MEASURE_CHEAP_TERMS and CELLSWARM_MEASURE_NO_GATHERS (-D in CELLSWARM_CFLAGS)
 * build kernels that give WRONG answers, for bench.kernel_parts only: what the same-bits
 * order's float term per unit and the codebooks' gathers cost, measured by taking them out */
#ifdef CELLSWARM_MEASURE_CHEAP_TERMS /* a convert and an add: about what an integer sub-scale costs */
#define R16_CHEAP_TERM(A, n) return l16_add_ps(A, l16_cvtepi32_ps(n))
#else
#define R16_CHEAP_TERM(A, n) (void)0
#endif

/* A + ((float)n * (ws * xd)): a unit's term where wm = 0 */
static inline l16f r16_add(l16f A, l16i n, l16f ws, float xd) {
    R16_CHEAP_TERM(A, n);
    return l16_add_ps(A, l16_mul_ps(l16_cvtepi32_ps(n), l16_mul_ps(ws, l16_set1_ps(xd))));
}

/* A + ((float)n * (ws * xd) - wm * xsum): a unit's term with a min (Q4_1, Q4_K) */
static inline l16f r16_add_min(l16f A, l16i n, l16f ws, float xd, l16f wm, float xsum) {
    R16_CHEAP_TERM(A, n);
    const l16f p = l16_mul_ps(l16_cvtepi32_ps(n), l16_mul_ps(ws, l16_set1_ps(xd)));
    return l16_add_ps(A, l16_sub_ps(p, l16_mul_ps(wm, l16_set1_ps(xsum))));
}

/* 2^(e - 128) of the 16 rows' E8M0 bytes at p (e8m0_half, lowbit.c), exactly: two powers of two
 * with normal exponents, multiplied (the product, down to 2^-128, is a float as it is) */
static inline l16f r16_e8m0(const uint8_t *p) {
    const l16i e = r16_u8(p), h = l16_srli_epi32(e, 1), c = l16_set1_epi32(63);
    const l16f a = l16_castsi_ps(l16_slli_epi32(l16_add_epi32(h, c), 23));
    return l16_mul_ps(a, l16_castsi_ps(l16_slli_epi32(l16_add_epi32(l16_sub_epi32(e, h), c), 23)));
}

/* a block-of-32 group block's scales (MXFP4: 16 E8M0 bytes, else f16s), where its value words
 * start, and the value table of the nibble formats */
static inline l16f r16_scale32(int fmt, const uint8_t *blk) { return fmt == MXFP4 ? r16_e8m0(blk) : r16_f16(blk); }
static inline int r16_at32(int fmt) { return fmt == Q4_1 ? 64 : fmt == MXFP4 ? 16 : 32; }
static inline const int8_t *r16_table32(int fmt) { return fmt == MXFP4 ? kvalues_mxfp4 : kvalues_iq4nl; }

/* 16 repacked Q4_0, Q4_1 or Q8_0 rows (group g, nb blocks) times one activation row:
 * out[0..16). Q4_1's w = d q + m: its wm is -m (exact.c), its nibbles unsigned as they are. */
static inline __attribute__((always_inline)) void r16_group1(const int fmt, const uint8_t *g,
                                                             int64_t nb, const int8_t *xq,
                                                             const float *xd, const int32_t *xs,
                                                             const float *xsum, float *out) {
    const int gb = R16_BLOCK(fmt), chunks = fmt == Q8_0 ? 8 : 4, nl = fmt == IQ4_NL || fmt == MXFP4;
    const int off = fmt == Q8_0 || nl ? R16_Q8_OFF : fmt == Q4_0 ? 8 : 0, at = r16_at32(fmt);
    const l16i m4 = l16_set1_epi8(0x0F), flip = l16_set1_epi8(-128), tbl = l16_table(r16_table32(fmt));
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
R16_UNROLL16
        for (int j = 0; j < 16; j++) {
            const int64_t b = b0 + j;
            if (b >= nb) break;
            const uint8_t *blk = g + gb * b;
            const int32_t *x4 = (const int32_t *)(const void *)(xq + 32 * b);
            l16i s0 = l16_set1_epi32(-off * (xs[2 * b] + xs[2 * b + 1])), s1 = l16_setzero_si512();
R16_UNROLL8
            for (int k = 0; k < chunks; k++) {
                const l16i q = l16_loadu_si512((const void *)(blk + at + 64 * k));
                if (fmt == Q8_0) {
                    const l16i u = r16_q8(q, flip);
                    if (k & 1) s1 = dot_q8_bcst(s1, u, x4 + k);
                    else s0 = dot_q8_bcst(s0, u, x4 + k);
                } else if (nl) { /* the table's signed values, as Q8_0's */
                    s0 = dot_q8_bcst(s0, r16_q8(l16_shuffle_epi8(tbl, l16_and_si512(q, m4)), flip), x4 + k);
                    s1 = dot_q8_bcst(s1, r16_q8(l16_shuffle_epi8(tbl, l16_and_si512(l16_srli_epi16(q, 4), m4)), flip),
                                     x4 + 4 + k);
                } else {
                    s0 = dpbusd_bcst(s0, l16_and_si512(q, m4), x4 + k);
                    s1 = dpbusd_bcst(s1, l16_and_si512(l16_srli_epi16(q, 4), m4), x4 + 4 + k);
                }
            }
            if (fmt == Q4_1) {
                const l16f wm = l16_sub_ps(l16_setzero_ps(), r16_f16(blk + 32)); /* -m: exact */
                A[j] = r16_add_min(A[j], l16_add_epi32(s0, s1), r16_f16(blk), xd[b], wm, xsum[b]);
            } else {
                A[j] = r16_add(A[j], l16_add_epi32(s0, s1), r16_scale32(fmt, blk), xd[b]);
            }
        }
    }
    fold16_rows(A, out);
}

/* The 16 lanes' 6-bit scales (m = 0) or mins (m = 1) of Q4_K sub-block j, from the 3 chunks
 * of a group block's scale bytes: k4_scale_min, lanes are rows */
static inline l16i k4_lanes(const l16i *S, int j, int m) {
    const l16i b63 = l16_set1_epi32(63), b15 = l16_set1_epi32(15), b3 = l16_set1_epi32(3);
    if (j < 4) return l16_and_si512(l16_srli_epi32(S[m], 8 * j), b63);
    const l16i hi = l16_srli_epi32(S[2], 8 * (j - 4));
    const l16i top = l16_and_si512(l16_srli_epi32(S[m], 8 * (j - 4) + 6), b3);
    const l16i low = m ? l16_and_si512(l16_srli_epi32(hi, 4), b15) : l16_and_si512(hi, b15);
    return l16_or_si512(low, l16_slli_epi32(top, 4));
}

/* 16 repacked Q4_K rows (nb blocks of 256) times one activation row: out[0..16). Unit u =
 * 8 b + j (block b, sub-block j) goes to A[u % 16] = A[8 (b % 2) + j]. */
static void r16_group1_q4k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                           const float *xsum, float *out) {
    const l16i m4 = l16_set1_epi8(0x0F);
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 2) {
R16_UNROLL2
        for (int h = 0; h < 2; h++) {
            const int64_t b = b0 + h;
            if (b >= nb) break;
            const uint8_t *blk = g + 2304 * b;
            const l16f d = r16_f16(blk), dmin = r16_f16(blk + 32);
            const l16i S[3] = {l16_loadu_si512((const void *)(blk + 64)), l16_loadu_si512((const void *)(blk + 128)),
                                  l16_loadu_si512((const void *)(blk + 192))};
R16_UNROLL4
            for (int c = 0; c < 4; c++) { /* nibble bytes 32c..32c+31: sub-blocks 2c (low), 2c + 1 (high) */
                const int32_t *x0 = (const int32_t *)(const void *)(xq + 256 * b + 64 * c), *x1 = x0 + 8;
                l16i n0 = l16_setzero_si512(), n1 = l16_setzero_si512();
                l16i n0b = l16_setzero_si512(), n1b = l16_setzero_si512();
R16_UNROLL8
                for (int k = 0; k < 8; k += 2) {
                    const l16i q = l16_loadu_si512((const void *)(blk + 256 + 64 * (8 * c + k)));
                    const l16i r = l16_loadu_si512((const void *)(blk + 256 + 64 * (8 * c + k + 1)));
                    n0 = dpbusd_bcst(n0, l16_and_si512(q, m4), x0 + k);
                    n1 = dpbusd_bcst(n1, l16_and_si512(l16_srli_epi16(q, 4), m4), x1 + k);
                    n0b = dpbusd_bcst(n0b, l16_and_si512(r, m4), x0 + k + 1);
                    n1b = dpbusd_bcst(n1b, l16_and_si512(l16_srli_epi16(r, 4), m4), x1 + k + 1);
                }
                const l16i n[2] = {l16_add_epi32(n0, n0b), l16_add_epi32(n1, n1b)};
R16_UNROLL2
                for (int e = 0; e < 2; e++) {
                    const int j = 2 * c + e, t = 8 * h + j;
                    const int64_t u = 8 * b + j;
                    const l16f ws = l16_mul_ps(d, l16_cvtepi32_ps(k4_lanes(S, j, 0)));
                    const l16f wm = l16_mul_ps(dmin, l16_cvtepi32_ps(k4_lanes(S, j, 1)));
                    A[t] = r16_add_min(A[t], n[e], ws, xd[u], wm, xsum[u]);
                }
            }
        }
    }
    fold16_rows(A, out);
}

/* Moving bits within each byte: with GFNI one affine op (a bit matrix per byte) where a shift
 * and a mask take two; 16-bit shifts also carry bits across bytes, which the mask must clear.
 * Row i of the matrix (byte 7 - i of the qword) picks the input bits of output bit i. The
 * weights come out the same integers either way: only the instruction count changes. */
#define BITS_HI_NIBBLE 0x1020408000000000LL /* in 4..7 -> out 0..3, the rest 0 */
#define BITS_01_TO_45 0x0000000001020000LL  /* in 0,1 -> out 4,5 */
#define BITS_23_TO_45 0x0000000004080000LL  /* in 2,3 -> out 4,5 */
#define BITS_67_TO_45 0x0000000040800000LL  /* in 6,7 -> out 4,5 */
#if defined(__GFNI__) && defined(R16_ZMM)
#define BYTE_BITS(v, matrix, shift_left, shift_right, mask) \
    _mm512_gf2p8affine_epi64_epi8((v), _mm512_set1_epi64(matrix), 0)
#else
#define BYTE_BITS(v, matrix, shift_left, shift_right, mask) \
    l16_and_si512(l16_srli_epi16(l16_slli_epi16((v), (shift_left)), (shift_right)), \
                     l16_set1_epi8(mask))
#endif

/* where word k (bytes 4k..4k+3) of a Q6_K block sits in its group's block: chunk q6_chunk(k) */
static inline int q6_chunk(int k) {
    if (k >= 48) return k - 48;                            /* scales */
    if (k >= 32) return 4 + 3 * (k - 32) + 2;              /* qh: half (k - 32) / 8, c = (k - 32) % 8 */
    return 4 + 3 * (8 * (k / 16) + k % 8) + (k % 16) / 8; /* ql */
}
#define Q6_AT(blk, chunk) ((const void *)((blk) + 32 + 64 * (chunk)))

/* chunk `at` of a Q6_K group block and the two after it (low nibbles, low nibbles, high bit
 * pairs) -> the unsigned 6-bit weights (q + 32) of 4 groups, w[m] for group 2m + cq of the half */
static inline __attribute__((always_inline)) void q6_unpack(const uint8_t *blk, int at, l16i m4,
                                                            l16i m30, l16i w[4]) {
    const l16i l0 = l16_loadu_si512(Q6_AT(blk, at));
    const l16i l1 = l16_loadu_si512(Q6_AT(blk, at + 1));
    const l16i h = l16_loadu_si512(Q6_AT(blk, at + 2));
    /* ternlog 0xEC: (a & c) | b; 0xF8: a | (b & c) */
    w[0] = l16_ternarylogic_epi32(l0, BYTE_BITS(h, BITS_01_TO_45, 4, 0, 0x30), m4, 0xEC);
    w[1] = l16_ternarylogic_epi32(l1, BYTE_BITS(h, BITS_23_TO_45, 2, 0, 0x30), m4, 0xEC);
    w[2] = l16_ternarylogic_epi32(BYTE_BITS(l0, BITS_HI_NIBBLE, 0, 4, 0x0F), h, m30, 0xF8);
    w[3] = l16_or_si512(BYTE_BITS(l1, BITS_HI_NIBBLE, 0, 4, 0x0F), BYTE_BITS(h, BITS_67_TO_45, 0, 2, 0x30));
}

/* d * (float)sc_g of the 16 rows (lanes) for group gi of a Q6_K group block: each row's
 * scale of that group, from the 4 chunks of int8 scales, as units_16 computes ws */
static inline l16f q6_scale_lanes(const uint8_t *blk, l16f d, int gi) {
    const l16i S = l16_loadu_si512(Q6_AT(blk, gi / 4));
    return l16_mul_ps(d, l16_cvtepi32_ps(l16_srai_epi32(l16_slli_epi32(S, 24 - 8 * (gi % 4)), 24)));
}

/* 16 repacked Q6_K rows (nb blocks of 256) times one activation row: out[0..16). A block has
 * 16 groups, so unit u = 16 b + g goes to A[g]: each block adds to every A once. */
static void r16_group1_q6k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                           const int32_t *xs, float *out) {
    const l16i m4 = l16_set1_epi8(0x0F), m30 = l16_set1_epi8(0x30);
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 3360 * b;
        const l16f d = r16_f16(blk);
R16_UNROLL2
        for (int n = 0; n < 2; n++) {
R16_UNROLL2
            for (int cq = 0; cq < 2; cq++) { /* c = 4cq..4cq+3: weights 4c.. of each 32: group 2m + cq */
                const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b + 128 * n + 16 * cq);
                l16i s[4];
R16_UNROLL4
                for (int m = 0; m < 4; m++) s[m] = l16_set1_epi32(-32 * xs[16 * b + 8 * n + 2 * m + cq]);
R16_UNROLL4
                for (int i = 0; i < 4; i++) {
                    l16i w[4];
                    q6_unpack(blk, 4 + 3 * (8 * n + 4 * cq + i), m4, m30, w);
R16_UNROLL4
                    for (int m = 0; m < 4; m++) s[m] = dpbusd_bcst(s[m], w[m], x4 + 8 * m + i);
                }
R16_UNROLL4
                for (int m = 0; m < 4; m++) {
                    const int gi = 8 * n + 2 * m + cq; /* the group: A's index */
                    A[gi] = r16_add(A[gi], s[m], q6_scale_lanes(blk, d, gi), xd[8 * b + gi / 2]);
                }
            }
        }
    }
    fold16_rows(A, out);
}

/* Byte k (0..3) of each of the 16 lanes' words in a 64-byte chunk (lane r's word at 4r) */
static inline l16i r16_bytes(const uint8_t *chunk, int k) {
    return l16_and_si512(l16_srli_epi32(l16_loadu_si512((const void *)chunk), 8 * k),
                            l16_set1_epi32(0xFF));
}
/* byte i of each lane's block (after its f16 fields at `body`), whose word i / 4 is in chunk */
#define R16_BYTE(body, chunk, i) r16_bytes((body) + 64 * (chunk), (i) & 3)

/* A Q2_K group block: the 16 rows' d (f16 x 16), their dmin, then the rows' 20 words (4 of
 * scales, 16 of 2-bit values) a chunk of 64 bytes each: chunk k holds word k of every row.
 * Weight 128 n + 32 j + l (l < 32) of a row is bits 2j of its value byte 32 n + l: value word
 * 8 n + 4 h + i holds l = 16 h + 4 i .. + 3, of group 8 n + 2 j + h for each shift j. */
#define Q2_AT(blk, word) ((const void *)((blk) + 64 + 64 * (word)))

/* d sc_g and dmin m_g of the 16 rows (lanes) for group gi of a Q2_K group block, as units_16
 * computes its ws and wm: the scale byte's low and high nibble */
static inline void q2_scale_lanes(const uint8_t *blk, l16f d, l16f dmin, int gi, l16f *ws, l16f *wm) {
    const l16i S = r16_bytes((const uint8_t *)Q2_AT(blk, gi / 4), gi % 4);
    *ws = l16_mul_ps(d, l16_cvtepi32_ps(l16_and_si512(S, l16_set1_epi32(0xF))));
    *wm = l16_mul_ps(dmin, l16_cvtepi32_ps(l16_srli_epi32(S, 4)));
}

/* The 4 value words of half h of part n of a Q2_K group block, each word's 4 shifts j:
 * W[j][i], the 2-bit values of word 8 n + 4 h + i at bits 2j (dpbusd's unsigned bytes) */
static inline __attribute__((always_inline)) void q2_unpack(const uint8_t *blk, int n, int h, l16i W[4][4]) {
    const l16i m3 = l16_set1_epi8(3);
R16_UNROLL4
    for (int i = 0; i < 4; i++) {
        const l16i q = l16_loadu_si512(Q2_AT(blk, 4 + 8 * n + 4 * h + i));
        W[0][i] = l16_and_si512(q, m3);
R16_UNROLL4
        for (int j = 1; j < 4; j++) W[j][i] = l16_and_si512(l16_srli_epi16(q, 2 * j), m3);
    }
}

/* 16 repacked Q2_K rows (nb blocks of 256) times one activation row: out[0..16). As Q6_K's,
 * unit u = 16 b + g goes to A[g]; each term with its min, in units_16's and row_q's order. */
static void r16_group1_q2k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                           const int32_t *xs, float *out) {
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 1344 * b;
        const l16f d = r16_f16(blk), dmin = r16_f16(blk + 32);
R16_UNROLL2
        for (int n = 0; n < 2; n++) {
R16_UNROLL2
            for (int h = 0; h < 2; h++) {
                const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b + 128 * n + 16 * h);
                l16i W[4][4];
                q2_unpack(blk, n, h, W);
R16_UNROLL4
                for (int j = 0; j < 4; j++) {
                    l16i s = l16_setzero_si512();
R16_UNROLL4
                    for (int i = 0; i < 4; i++) s = dpbusd_bcst(s, W[j][i], x4 + 8 * j + i);
                    const int gi = 8 * n + 2 * j + h;
                    const float x = xd[8 * b + gi / 2];
                    l16f ws, wm;
                    q2_scale_lanes(blk, d, dmin, gi, &ws, &wm);
                    A[gi] = r16_add_min(A[gi], s, ws, x, wm, x * (float)xs[16 * b + gi]);
                }
            }
        }
    }
    fold16_rows(A, out);
}

/* A TQ2_0 group block: the 16 rows' d, then their 16 words of 2-bit digits (Q2_K's planes):
 * weight 128 n + 32 j + l is bits 2j of byte 32 n + l, w = d (digit - 1); a unit is 32. */
#define TQ2_AT(blk, word) ((const void *)((blk) + 32 + 64 * (word)))

/* s[j] for unit 4 n + j of a TQ2_0 group block (x4: the block's activations as int32):
 * the digits' dot products, less the activations' sum (the -1) */
static inline __attribute__((always_inline)) void tq2_dots(const uint8_t *blk, int n, const int32_t *x4,
                                                           const int32_t *xs, l16i s[4]) {
    const l16i m3 = l16_set1_epi8(3);
R16_UNROLL4
    for (int j = 0; j < 4; j++) s[j] = l16_set1_epi32(-(xs[2 * (4 * n + j)] + xs[2 * (4 * n + j) + 1]));
R16_UNROLL8
    for (int k = 0; k < 8; k++) {
        const l16i q = l16_loadu_si512(TQ2_AT(blk, 8 * n + k));
R16_UNROLL4
        for (int j = 0; j < 4; j++)
            s[j] = dpbusd_bcst(s[j], l16_and_si512(l16_srli_epi16(q, 2 * j), m3), x4 + 32 * n + 8 * j + k);
    }
}

/* 16 repacked TQ2_0 rows times one activation row: units of 32, as row_q in Q4_1's loop */
static void r16_group1_tq2(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                           const int32_t *xs, float *out) {
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 1056 * b;
        const l16f d = r16_f16(blk);
        const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b);
R16_UNROLL2
        for (int n = 0; n < 2; n++) {
            l16i s[4];
            tq2_dots(blk, n, x4, xs + 16 * b, s);
R16_UNROLL4
            for (int j = 0; j < 4; j++) {
                const int t = 8 * (int)(b % 2) + 4 * n + j;
                A[t] = r16_add(A[t], s[j], d, xd[8 * b + 4 * n + j]);
            }
        }
    }
    fold16_rows(A, out);
}

/* An IQ4_XS group block: d, the rows' 16-bit high scale bits, then 33 words: the low scale
 * nibbles, and 32 of value nibbles (16 bytes a sub-block of 32: low nibbles its first 16) */
#define IQ4_AT(blk, word) ((const void *)((blk) + 64 + 64 * (word)))

/* d (ls - 32) of the 16 rows for sub-block s: dec_iq4_xs's scale */
static inline l16f iq4xs_scale_lanes(l16f d, l16i SL, l16i SH, int s) {
    const l16i lo = l16_and_si512(l16_srli_epi32(SL, 4 * s), l16_set1_epi32(0xF));
    const l16i hi = l16_and_si512(l16_srli_epi32(SH, 2 * s), l16_set1_epi32(3));
    const l16i ls = l16_sub_epi32(l16_or_si512(lo, l16_slli_epi32(hi, 4)), l16_set1_epi32(32));
    return l16_mul_ps(d, l16_cvtepi32_ps(ls));
}

/* the table's values (as Q8_0's weights go to dot_q8) of IQ4_XS value word 4 s + i: lo, hi */
static inline __attribute__((always_inline)) void iq4xs_unpack(const uint8_t *blk, int s, int i, l16i tbl,
                                                               l16i *lo, l16i *hi) {
    const l16i m4 = l16_set1_epi8(0x0F), flip = l16_set1_epi8(-128);
    const l16i q = l16_loadu_si512(IQ4_AT(blk, 1 + 4 * s + i));
    *lo = r16_q8(l16_shuffle_epi8(tbl, l16_and_si512(q, m4)), flip);
    *hi = r16_q8(l16_shuffle_epi8(tbl, l16_and_si512(l16_srli_epi16(q, 4), m4)), flip);
}

static void r16_group1_iq4xs(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                             const int32_t *xs, float *out) {
    const l16i tbl = l16_table(kvalues_iq4nl);
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 2176 * b;
        const l16f d = r16_f16(blk);
        const l16i SH = r16_u16(blk + 32), SL = l16_loadu_si512(IQ4_AT(blk, 0));
        const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b);
R16_UNROLL8
        for (int s = 0; s < 8; s++) {
            const int64_t u = 8 * b + s;
            l16i s0 = l16_set1_epi32(-R16_Q8_OFF * (xs[2 * u] + xs[2 * u + 1])), s1 = l16_setzero_si512();
R16_UNROLL4
            for (int i = 0; i < 4; i++) {
                l16i lo, hi;
                iq4xs_unpack(blk, s, i, tbl, &lo, &hi);
                s0 = dot_q8_bcst(s0, lo, x4 + 8 * s + i);
                s1 = dot_q8_bcst(s1, hi, x4 + 8 * s + 4 + i);
            }
            const int t = 8 * (int)(b % 2) + s;
            A[t] = r16_add(A[t], l16_add_epi32(s0, s1), iq4xs_scale_lanes(d, SL, SH, s), xd[u]);
        }
    }
    fold16_rows(A, out);
}

/* An IQ1_S group block: the 16 rows' d, then 12 words a chunk each: 8 of index bytes (word s:
 * sub-block s's 4 entries), 4 of 16-bit fields (sub-block s's at word 8 + s / 2, half s % 2:
 * each entry's 3 top index bits, a 3-bit scale, the delta's sign). */
#define IQ1_AT(blk, word) ((const void *)((blk) + 32 + 64 * (word)))

/* sub-block s's 16-bit field of the 16 rows */
static inline l16i iq1s_field(const uint8_t *blk, int s) {
    const l16i H = l16_loadu_si512(IQ1_AT(blk, 8 + s / 2));
    return s % 2 ? l16_srli_epi32(H, 16) : l16_and_si512(H, l16_set1_epi32(0xFFFF));
}

/* d (2 s + 1) / 8 of the 16 rows: dec_iq1_s's scale (values are stored as 8 (value + delta)) */
static inline l16f iq1s_scale_lanes(l16f d, l16i w) {
    const l16i s = l16_and_si512(l16_srli_epi32(w, 12), l16_set1_epi32(7));
    const l16i odd = l16_add_epi32(l16_slli_epi32(s, 1), l16_set1_epi32(1));
    return l16_mul_ps(l16_mul_ps(d, l16_cvtepi32_ps(odd)), l16_set1_ps(0.125f));
}

/* the 11-bit grid index of entry e (0..3) of sub-block s: its index byte and 3 bits of w */
static inline l16i iq1s_index(l16i L, l16i w, int e) {
    const l16i low = l16_and_si512(l16_srli_epi32(L, 8 * e), l16_set1_epi32(0xFF));
    const l16i top = l16_and_si512(l16_srli_epi32(w, 3 * e), l16_set1_epi32(7));
    return l16_or_si512(low, l16_slli_epi32(top, 8));
}

/* W[0], W[1]: an IQ1 grid entry's 8 values as 8 (value + delta) + 9 (0..18, dpbusd's
 * unsigned bytes): its 4-byte halves gathered by the 16 rows' indices, (v + 1) 8, and 0 or 2
 * for the delta (neg: all ones where it is -1/8) */
static inline __attribute__((always_inline)) void iq1_entry(l16i index, l16i neg, l16i W[2]) {
    const void *grid = iq1s_grid;
    const l16i one = l16_set1_epi8(1), two = l16_set1_epi32(0x02020202);
    const l16i delta = l16_xor_si512(l16_and_si512(neg, two), two);
    l16i v[2];
    l16_gather64(index, grid, v);
R16_UNROLL2
    for (int k = 0; k < 2; k++) W[k] = l16_add_epi8(l16_slli_epi16(l16_add_epi8(v[k], one), 3), delta);
}

/* W[2e], W[2e + 1]: entry e of an IQ1_S sub-block (its delta's sign: bit 15 of w) */
static inline __attribute__((always_inline)) void iq1s_unpack(l16i L, l16i w, l16i W[8]) {
    const l16i neg = l16_srai_epi32(l16_slli_epi32(w, 16), 31);
R16_UNROLL4
    for (int e = 0; e < 4; e++) iq1_entry(iq1s_index(L, w, e), neg, W + 2 * e);
}

/* 16 repacked IQ1_S rows times one activation row: units of 32, as row_q in Q4_1's loop
 * (each value 8 (v + delta), the scale divided by 8: lowbit.c) */
static void r16_group1_iq1s(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                            const int32_t *xs, float *out) {
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 800 * b;
        const l16f d = r16_f16(blk);
        const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b);
R16_UNROLL2
        for (int s = 0; s < 8; s++) {
            const int64_t u = 8 * b + s;
            const l16i w = iq1s_field(blk, s);
            l16i W[8];
            iq1s_unpack(l16_loadu_si512(IQ1_AT(blk, s)), w, W);
            l16i n = l16_set1_epi32(-9 * (xs[2 * u] + xs[2 * u + 1]));
R16_UNROLL8
            for (int k = 0; k < 8; k++) n = dpbusd_bcst(n, W[k], x4 + 8 * s + k);
            const int t = 8 * (int)(b % 2) + s;
            A[t] = r16_add(A[t], n, iq1s_scale_lanes(d, w), xd[u]);
        }
    }
    fold16_rows(A, out);
}

/* An IQ1_M group block: no f16 field of its own (d is in the scales' top nibbles), its 14
 * words a chunk each: 8 of index bytes (entry k: byte k), 4 of nibbles (entry k's 3 top index
 * bits and its delta's sign: byte k / 2, nibble k % 2), 2 of scales (4 u16: 3 bits a group of
 * 16, and d's 4 bits on top). Units of 16, as row_q runs it in Q2_K's loop. */
#define IQ1M_AT(blk, word) ((const void *)((blk) + 64 * (word)))

/* the 16 rows' u16 scale word k (0..3) */
static inline l16i iq1m_scale_word(const uint8_t *blk, int k) {
    const l16i S = l16_loadu_si512(IQ1M_AT(blk, 12 + k / 2));
    return k % 2 ? l16_srli_epi32(S, 16) : l16_and_si512(S, l16_set1_epi32(0xFFFF));
}

/* d of the 16 rows: an f16 from the top nibbles of the 4 scale words (dec_iq1_m) */
static inline l16f iq1m_d(const uint8_t *blk) {
    const l16i f = l16_set1_epi32(0xF000);
    l16i bits = l16_srli_epi32(iq1m_scale_word(blk, 0), 12);
    bits = l16_or_si512(bits, l16_srli_epi32(l16_and_si512(iq1m_scale_word(blk, 1), f), 8));
    bits = l16_or_si512(bits, l16_srli_epi32(l16_and_si512(iq1m_scale_word(blk, 2), f), 4));
    bits = l16_or_si512(bits, l16_and_si512(iq1m_scale_word(blk, 3), f));
    return l16_f16_bits(bits);
}

/* d (2 s + 1) / 8 of group gi (16 weights) of the 16 rows */
static inline l16f iq1m_scale_lanes(const uint8_t *blk, l16f d, int gi) {
    const l16i s = l16_and_si512(l16_srli_epi32(iq1m_scale_word(blk, gi / 4), 3 * (gi % 4)), l16_set1_epi32(7));
    const l16i odd = l16_add_epi32(l16_slli_epi32(s, 1), l16_set1_epi32(1));
    return l16_mul_ps(l16_mul_ps(d, l16_cvtepi32_ps(odd)), l16_set1_ps(0.125f));
}

/* entry k's 11-bit index and its delta's sign (all ones: -1/8) in the 16 rows */
static inline void iq1m_entry(const uint8_t *blk, int k, l16i *index, l16i *neg) {
    const l16i low = r16_bytes((const uint8_t *)IQ1M_AT(blk, k / 4), k % 4);
    const l16i nib = l16_srli_epi32(r16_bytes((const uint8_t *)IQ1M_AT(blk, 8 + k / 8), (k / 2) % 4), 4 * (k % 2));
    *index = l16_or_si512(low, l16_slli_epi32(l16_and_si512(nib, l16_set1_epi32(7)), 8));
    *neg = l16_srai_epi32(l16_slli_epi32(nib, 28), 31);
}

/* W[4]: group gi's 16 values as 8 (value + delta) + 9 (entries 2 gi, 2 gi + 1; halves) */
static inline __attribute__((always_inline)) void iq1m_unpack(const uint8_t *blk, int gi, l16i W[4]) {
R16_UNROLL2
    for (int e = 0; e < 2; e++) {
        l16i index, neg;
        iq1m_entry(blk, 2 * gi + e, &index, &neg);
        iq1_entry(index, neg, W + 2 * e);
    }
}

static void r16_group1_iq1m(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                            const int32_t *xs, float *out) {
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 896 * b;
        const l16f d = iq1m_d(blk);
        const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b);
R16_UNROLL2
        for (int gi = 0; gi < 16; gi++) {
            l16i W[4];
            iq1m_unpack(blk, gi, W);
            l16i n = l16_set1_epi32(-9 * xs[16 * b + gi]);
R16_UNROLL4
            for (int k = 0; k < 4; k++) n = dpbusd_bcst(n, W[k], x4 + 4 * gi + k);
            A[gi] = r16_add(A[gi], n, iq1m_scale_lanes(blk, d, gi), xd[8 * b + gi / 2]);
        }
    }
    fold16_rows(A, out);
}

/* ---- the codebook formats with signs apart: IQ2_XXS, IQ3_XXS, IQ3_S (units of 32), IQ2_XS,
 * IQ2_S (units of 16). A group block is the 16 rows' d, then each word of a row's block (after
 * its d) a chunk: IQ_AT(blk, word). An entry's grid index is gathered from the grid, 4 bytes
 * at a time, by the 16 rows' indices; its signs negate bytes (as Q8_0's weights go to dot_q8).
 *   IQ2_XXS  sub-block s: its 8 index bytes (words 2 s, 2 s + 1: 4 entries of 8, a word of
 *            the pair each), aux (word 2 s + 1: 4 x 7 sign bits, the scale on top)
 *   IQ3_XXS  words 2 s, 2 s + 1: 8 index bytes (entries of 4); word 16 + s: aux
 *   IQ3_S    words 2 s, 2 s + 1: index bytes; 16, 17: ninth bits; 18 + s: 4 sign bytes; 26:
 *            the scale nibbles
 *   IQ2_XS   word g: group g's 2 entries of 8 (u16: a 9-bit index, 7 sign bits); 16, 17: scales
 *   IQ2_S    word m: 4 index bytes; 8 + m: their 4 sign bytes; 16, 17: 2 top index bits each;
 *            18, 19: scales */
#define IQ_AT(blk, word) ((const void *)((blk) + 32 + 64 * (word)))

/* d (0.5 + s) step of the 16 rows: iq_scale (lowbit.c), in its order */
static inline l16f iq_scale_lanes(l16f d, l16i s, float step) {
    return l16_mul_ps(l16_mul_ps(d, l16_add_ps(l16_set1_ps(0.5f), l16_cvtepi32_ps(s))), l16_set1_ps(step));
}

/* ksigns_iq2xs[i] of the 16 rows (i: 7 bits in each lane): the 7 bits, and an 8th for even parity */
static inline l16i iq2_ksigns(l16i i) {
#if defined(R16_ZMM) && defined(__AVX512VPOPCNTDQ__)
    const l16i p = _mm512_popcnt_epi32(i);
#else
    l16i p = l16_xor_si512(i, l16_srli_epi32(i, 4));
    p = l16_xor_si512(p, l16_srli_epi32(p, 2));
    p = l16_xor_si512(p, l16_srli_epi32(p, 1));
#endif
    return l16_or_si512(i, l16_slli_epi32(l16_and_si512(p, l16_set1_epi32(1)), 7));
}

/* sign byte k of each lane spread over the lane's 4 bytes */
static inline l16i iq_spread(l16i signs, int k) {
    static const int8_t at[4][16] = {
        {0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12}, {1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9, 9, 13, 13, 13, 13},
        {2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10, 14, 14, 14, 14}, {3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 15, 15, 15, 15},
    };  /* fmt: skip */
    return l16_shuffle_epi8(signs, l16_table(at[k]));
}

/* 4 grid bytes of each lane (v) with bits 4 h .. 4 h + 3 of its spread sign byte applied: bytes
 * negated where set, then as Q8_0's weights go to dot_q8 */
static inline l16i iq_signed4(l16i v, l16i spread, int h) {
    const l16i bits = l16_set1_epi32(h ? (int)0x80402010 : 0x08040201);
    return r16_q8(l16_negate_bytes(v, spread, bits), l16_set1_epi8(-128));
}

/* an entry of 8 (grid of 8-byte entries, index: the 16 rows'), signs: sign byte k of each lane */
static inline __attribute__((always_inline)) void iq_entry8(const int8_t (*grid)[8], l16i index, l16i signs,
                                                            int k, l16i W[2]) {
    const l16i spread = iq_spread(signs, k);
    l16i v[2];
    l16_gather64(index, grid, v);
    W[0] = iq_signed4(v[0], spread, 0);
    W[1] = iq_signed4(v[1], spread, 1);
}

/* an entry of 4 (IQ3): sign bits 4 h .. of sign byte k of each lane */
static inline l16i iq_entry4(const int8_t (*grid)[4], l16i index, l16i signs, int k, int h) {
    return iq_signed4(l16_gather32(index, (const int32_t *)(const void *)grid), iq_spread(signs, k), h);
}

#if defined(R16_ZMM) && defined(__AVX512VBMI__)
/* The 4-byte grids as byte planes: plane j, byte i = byte j of entry i. Byte lookups in
 * them (vpermi2b: 128 bytes by an index's low 7 bits; bits 7 and 8 choose which 128) take 64
 * entries at once, where a gather fetches 16 and on Zen 4 costs about its 16 loads
 * (bench.kernel_parts: gathers were two thirds of IQ3_XXS's one-token time). The same
 * bytes, so the same bits. */
#define IQ_PLANES 1
static int8_t iq3xxs_planes[4 * 256] __attribute__((aligned(64)));
static int8_t iq3s_planes[4 * 512] __attribute__((aligned(64)));
static int8_t iq2xxs_planes[8 * 256] __attribute__((aligned(64))); /* entries of 8: planes 0-3, then 4-7 */

__attribute__((constructor)) static void iq_planes_init(void) {
    for (int j = 0; j < 4; j++) {
        for (int i = 0; i < 256; i++) iq3xxs_planes[256 * j + i] = iq3xxs_grid[i][j];
        for (int i = 0; i < 512; i++) iq3s_planes[512 * j + i] = iq3s_grid[i][j];
    }
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 256; i++) iq2xxs_planes[256 * j + i] = iq2xxs_grid[i][j];
}

/* the grid entries (n: 256 or 512 of them) the 64 index bytes of L name, byte 4 r + k entry k
 * of row r, with bit 8 where nine's byte is not 0: v[k] lane r = entry k of row r. Index and
 * nine are first transposed in each 16 bytes (4 rows x 4 entries), so that after the lookups
 * the unpacks' interleaving lands each entry whole in its row's lane */
static inline __attribute__((always_inline)) void iq_lookup4(const int8_t *planes, const int n, __m512i L,
                                                             __m512i nine, __m512i v[4]) {
    const __m512i t = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i idx = _mm512_shuffle_epi8(L, t);
    const __mmask64 b7 = _mm512_movepi8_mask(idx);
    const __mmask64 b8 = n > 256 ? _mm512_test_epi8_mask(_mm512_shuffle_epi8(nine, t), _mm512_set1_epi8(-1)) : 0;
    __m512i B[4];
    for (int j = 0; j < 4; j++) {
        const __m512i *p = (const __m512i *)(const void *)(planes + n * j);
        __m512i part[4];
        for (int h = 0; h < n / 128; h++)
            part[h] = _mm512_permutex2var_epi8(_mm512_load_si512(p + 2 * h), idx, _mm512_load_si512(p + 2 * h + 1));
        B[j] = _mm512_mask_blend_epi8(b7, part[0], part[1]);
        if (n > 256) B[j] = _mm512_mask_blend_epi8(b8, B[j], _mm512_mask_blend_epi8(b7, part[2], part[3]));
    }
    const __m512i a = _mm512_unpacklo_epi8(B[0], B[1]), b = _mm512_unpackhi_epi8(B[0], B[1]);
    const __m512i c = _mm512_unpacklo_epi8(B[2], B[3]), d = _mm512_unpackhi_epi8(B[2], B[3]);
    v[0] = _mm512_unpacklo_epi16(a, c);
    v[1] = _mm512_unpackhi_epi16(a, c);
    v[2] = _mm512_unpacklo_epi16(b, d);
    v[3] = _mm512_unpackhi_epi16(b, d);
}
#endif

/* unit s (32 values) of an IQ2_XXS, IQ3_XXS or IQ3_S group block: W[j], values 4 j .. 4 j + 3
 * of the 16 rows; its scale */
static inline __attribute__((always_inline)) l16f iq32_unpack(const int fmt, const uint8_t *blk, l16f d, int s,
                                                              l16i W[8]) {
    const l16i m7 = l16_set1_epi32(127);
    if (fmt == IQ2_XXS) {
        const l16i L = l16_loadu_si512(IQ_AT(blk, 2 * s)), aux = l16_loadu_si512(IQ_AT(blk, 2 * s + 1));
#ifdef IQ_PLANES
        l16i v[8];
        iq_lookup4(iq2xxs_planes, 256, L, m7, v);
        iq_lookup4(iq2xxs_planes + 4 * 256, 256, L, m7, v + 4);
R16_UNROLL4
        for (int k = 0; k < 4; k++) {
            const l16i spread = iq_spread(iq2_ksigns(l16_and_si512(l16_srli_epi32(aux, 7 * k), m7)), 0);
            W[2 * k] = iq_signed4(v[k], spread, 0);
            W[2 * k + 1] = iq_signed4(v[4 + k], spread, 1);
        }
        return iq_scale_lanes(d, l16_srli_epi32(aux, 28), 0.25f);
#endif
R16_UNROLL4
        for (int k = 0; k < 4; k++)
            iq_entry8(iq2xxs_grid, l16_and_si512(l16_srli_epi32(L, 8 * k), l16_set1_epi32(0xFF)),
                      iq2_ksigns(l16_and_si512(l16_srli_epi32(aux, 7 * k), m7)), 0, W + 2 * k);
        return iq_scale_lanes(d, l16_srli_epi32(aux, 28), 0.25f);
    }
    if (fmt == IQ3_XXS) {
        const l16i aux = l16_loadu_si512(IQ_AT(blk, 16 + s));
#ifdef IQ_PLANES
        l16i v[8];
        for (int w = 0; w < 2; w++)
            iq_lookup4(iq3xxs_planes, 256, l16_loadu_si512(IQ_AT(blk, 2 * s + w)), m7, v + 4 * w);
R16_UNROLL8
        for (int e = 0; e < 8; e++)
            W[e] = iq_signed4(v[e], iq_spread(iq2_ksigns(l16_and_si512(l16_srli_epi32(aux, 7 * (e / 2)), m7)), 0),
                              e % 2);
        return iq_scale_lanes(d, l16_srli_epi32(aux, 28), 0.5f);
#endif
R16_UNROLL8
        for (int e = 0; e < 8; e++) {
            const l16i i = r16_bytes((const uint8_t *)IQ_AT(blk, 2 * s + e / 4), e % 4);
            W[e] = iq_entry4(iq3xxs_grid, i, iq2_ksigns(l16_and_si512(l16_srli_epi32(aux, 7 * (e / 2)), m7)), 0,
                             e % 2);
        }
        return iq_scale_lanes(d, l16_srli_epi32(aux, 28), 0.5f);
    }
    /* IQ3_S: index e = its byte and bit e of the ninth bits' byte s */
    const l16i ninth = r16_bytes((const uint8_t *)IQ_AT(blk, 16 + s / 4), s % 4);
    const l16i S = l16_loadu_si512(IQ_AT(blk, 18 + s));
#ifdef IQ_PLANES
    l16i v[8];
    const l16i spread = iq_spread(ninth, 0);
    for (int w = 0; w < 2; w++)
        iq_lookup4(iq3s_planes, 512, l16_loadu_si512(IQ_AT(blk, 2 * s + w)),
                   l16_and_si512(spread, l16_set1_epi32(w ? (int)0x80402010 : 0x08040201)), v + 4 * w);
R16_UNROLL8
    for (int e = 0; e < 8; e++) W[e] = iq_signed4(v[e], iq_spread(S, e / 2), e % 2);
#else
R16_UNROLL8
    for (int e = 0; e < 8; e++) {
        const l16i low = r16_bytes((const uint8_t *)IQ_AT(blk, 2 * s + e / 4), e % 4);
        const l16i top = l16_and_si512(l16_slli_epi32(ninth, 8 - e), l16_set1_epi32(0x100));
        W[e] = iq_entry4(iq3s_grid, l16_or_si512(low, top), S, e / 2, e % 2);
    }
#endif
    const l16i ls = l16_and_si512(l16_srli_epi32(l16_loadu_si512(IQ_AT(blk, 26)), 4 * s), l16_set1_epi32(0xF));
    return l16_mul_ps(d, l16_cvtepi32_ps(l16_add_epi32(l16_slli_epi32(ls, 1), l16_set1_epi32(1))));
}

/* group gi (16 values) of an IQ2_XS or IQ2_S group block: W[j], values 4 j .. of the 16 rows;
 * its scale */
static inline __attribute__((always_inline)) l16f iq16_unpack(const int fmt, const uint8_t *blk, l16f d, int gi,
                                                              l16i W[4]) {
    if (fmt == IQ2_XS) {
        const l16i Q = l16_loadu_si512(IQ_AT(blk, gi));
R16_UNROLL2
        for (int e = 0; e < 2; e++) {
            const l16i w = e ? l16_srli_epi32(Q, 16) : l16_and_si512(Q, l16_set1_epi32(0xFFFF));
            iq_entry8(iq2xs_grid, l16_and_si512(w, l16_set1_epi32(511)), iq2_ksigns(l16_srli_epi32(w, 9)), 0,
                      W + 2 * e);
        }
    } else { /* IQ2_S: entries 2 gi, 2 gi + 1, bytes 2 (gi % 2) + e of word gi / 2 */
        const int m = gi / 2;
        const l16i L = l16_loadu_si512(IQ_AT(blk, m)), S = l16_loadu_si512(IQ_AT(blk, 8 + m));
        const l16i top = r16_bytes((const uint8_t *)IQ_AT(blk, 16 + m / 4), m % 4);
R16_UNROLL2
        for (int e = 0; e < 2; e++) {
            const int k = 2 * (gi % 2) + e;
            const l16i low = l16_and_si512(l16_srli_epi32(L, 8 * k), l16_set1_epi32(0xFF));
            const l16i hi = l16_and_si512(l16_slli_epi32(top, 8 - 2 * k), l16_set1_epi32(0x300));
            iq_entry8(iq2s_grid, l16_or_si512(low, hi), S, k, W + 2 * e);
        }
    }
    const l16i sc = r16_bytes((const uint8_t *)IQ_AT(blk, (fmt == IQ2_XS ? 16 : 18) + gi / 8), (gi / 2) % 4);
    return iq_scale_lanes(d, l16_and_si512(l16_srli_epi32(sc, 4 * (gi % 2)), l16_set1_epi32(0xF)), 0.25f);
}

/* the exact sum over a unit of n words W[k] (as Q8_0's go to dot_q8) times x4[k]: xsum is
 * the unit's activation sum (the offset's), two accumulators as the tiles run them */
static inline __attribute__((always_inline)) l16i r16_dots_q8(const l16i *W, int n, const int32_t *x4,
                                                              int32_t xsum) {
    l16i n0 = l16_set1_epi32(-R16_Q8_OFF * xsum), n1 = l16_setzero_si512();
R16_UNROLL4
    for (int k = 0; k < n / 2; k++) {
        n0 = dot_q8_bcst(n0, W[k], x4 + k);
        n1 = dot_q8_bcst(n1, W[n / 2 + k], x4 + n / 2 + k);
    }
    return l16_add_epi32(n0, n1);
}

/* a codebook format's unit: 16 values (IQ2_XS, IQ2_S: Q2_K's loop) or 32 (Q4_1's) */
static inline int iq_unit(int fmt) { return fmt == IQ2_XS || fmt == IQ2_S ? 16 : 32; }

/* unit s of block blk (iq16_unpack or iq32_unpack): its words W (len / 4) and its scale */
static inline __attribute__((always_inline)) l16f iq_unpack(const int fmt, const uint8_t *blk, l16f d, int s,
                                                            l16i W[8]) {
    return iq_unit(fmt) == 16 ? iq16_unpack(fmt, blk, d, s, W) : iq32_unpack(fmt, blk, d, s, W);
}

/* 16 repacked rows of a codebook format with signs (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S)
 * times one activation row: unit u = per b + s goes to A[u % 16], as row_q runs it */
static inline __attribute__((always_inline)) void r16_group1_iq(const int fmt, const uint8_t *g, int64_t nb,
                                                                const int8_t *xq, const float *xd,
                                                                const int32_t *xs, float *out) {
    const int len = iq_unit(fmt), per = 256 / len;
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + R16_BLOCK(fmt) * b;
        const l16f d = r16_f16(blk);
        const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b);
R16_UNROLL2
        for (int s = 0; s < per; s++) {
            const int64_t u = per * b + s;
            l16i W[8];
            const l16f ws = iq_unpack(fmt, blk, d, s, W);
            const int32_t sum = len == 16 ? xs[u] : xs[2 * u] + xs[2 * u + 1];
            const l16i n = r16_dots_q8(W, len / 4, x4 + len / 4 * s, sum);
            A[u % 16] = r16_add(A[u % 16], n, ws, xd[u * len / 32]);
        }
    }
    fold16_rows(A, out);
}

/* ---- TQ1_0: a group block is the 16 rows' d, then 13 words a chunk each (12 of 5 base-3
 * digits a byte, 1 of 4): weight 32 k + j is digit k of byte j (j < 32), 160 + 16 k + j digit k
 * of byte 32 + j (j < 16), 240 + 4 k + j digit k of byte 48 + j. A unit is 32. */
#define TQ1_AT(blk, word) ((const void *)((blk) + 32 + 64 * (word)))

/* the top base-3 digit of each byte f, (3 f) >> 8 (tq1_digits): (f >= 86) + (f >= 171) */
static inline l16i tq1_top(l16i f) {
    const l16i zero = l16_setzero_si512();
    return l16_sub_epi8(l16_sub_epi8(zero, l16_ge_epu8(f, l16_set1_epi8(86))), l16_ge_epu8(f, l16_set1_epi8((char)171)));
}

/* 3 f mod 256 in each byte: the next digit to the top */
static inline l16i tq1_next(l16i f) { return l16_add_epi8(f, l16_add_epi8(f, f)); }

/* where digit k of word w goes: the activation word (of the block's 64) it multiplies */
static inline int tq1_at(int w, int k) { return w < 8 ? 8 * k + w : w < 12 ? 40 + 4 * k + (w - 8) : 60 + k; }

/* 16 repacked TQ1_0 rows times one activation row: units of 32 (digit - 1: the unit's
 * activation sum taken off), as row_q in Q4_1's loop */
static void r16_group1_tq1(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                           const int32_t *xs, float *out) {
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 864 * b;
        const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b);
        l16i n[8];
R16_UNROLL8
        for (int u = 0; u < 8; u++) n[u] = l16_set1_epi32(-(xs[16 * b + 2 * u] + xs[16 * b + 2 * u + 1]));
R16_UNROLL2
        for (int w = 0; w < 13; w++) {
            l16i f = l16_loadu_si512(TQ1_AT(blk, w));
R16_UNROLL4
            for (int k = 0; k < (w < 12 ? 5 : 4); k++) {
                const int at = tq1_at(w, k);
                n[at / 8] = dpbusd_bcst(n[at / 8], tq1_top(f), x4 + at);
                f = tq1_next(f);
            }
        }
        const l16f d = r16_f16(blk);
R16_UNROLL8
        for (int u = 0; u < 8; u++) {
            const int t = 8 * (int)(b % 2) + u;
            A[t] = r16_add(A[t], n[u], d, xd[8 * b + u]);
        }
    }
    fold16_rows(A, out);
}

/* A Q3_K group block: the 16 rows' d, then their 27 words a chunk each: 8 of high bits
 * (hmask), 16 of 2-bit values (as Q2_K's), 3 of scales. */
#define Q3_AT(blk, word) ((const void *)((blk) + 32 + 64 * (word)))

/* d (sc_g - 32) of the 16 rows for group gi of a Q3_K group block, as dec_q3_k's scale: a
 * low nibble from scale bytes 0-7, the top 2 bits from bytes 8-11 */
static inline l16f q3_scale_lanes(const uint8_t *blk, l16f d, int gi) {
    const int k = gi % 8, kh = 8 + gi % 4;
    const l16i lb = r16_bytes((const uint8_t *)Q3_AT(blk, 24 + k / 4), k % 4);
    const l16i lo = gi < 8 ? l16_and_si512(lb, l16_set1_epi32(0xF)) : l16_srli_epi32(lb, 4);
    const l16i hi = l16_and_si512(l16_srli_epi32(r16_bytes((const uint8_t *)Q3_AT(blk, 24 + kh / 4), kh % 4),
                                                 2 * (gi / 4)), l16_set1_epi32(3));
    const l16i sc = l16_sub_epi32(l16_or_si512(lo, l16_slli_epi32(hi, 4)), l16_set1_epi32(32));
    return l16_mul_ps(d, l16_cvtepi32_ps(sc));
}

/* W[j][i]: Q3_K's values + 4 (0..7, dpbusd's unsigned bytes) of value word 8 n + 4 h + i at
 * shift j, the high bit 4 n + j of hmask word 4 h + i above them */
static inline __attribute__((always_inline)) void q3_unpack(const uint8_t *blk, int n, int h, l16i W[4][4]) {
    const l16i m3 = l16_set1_epi8(3), m1 = l16_set1_epi8(1);
R16_UNROLL4
    for (int i = 0; i < 4; i++) {
        const l16i q = l16_loadu_si512(Q3_AT(blk, 8 + 8 * n + 4 * h + i));
        const l16i hm = l16_loadu_si512(Q3_AT(blk, 4 * h + i));
R16_UNROLL4
        for (int j = 0; j < 4; j++)
            W[j][i] = l16_or_si512(l16_and_si512(l16_srli_epi16(q, 2 * j), m3),
                                   l16_slli_epi16(l16_and_si512(l16_srli_epi16(hm, 4 * n + j), m1), 2));
    }
}

/* 16 repacked Q3_K rows times one activation row: Q2_K's order, its values signed (-4 times
 * each group's activation sum, as Q6_K's -32) and no min */
static void r16_group1_q3k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                           const int32_t *xs, float *out) {
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 1760 * b;
        const l16f d = r16_f16(blk);
R16_UNROLL2
        for (int n = 0; n < 2; n++) {
R16_UNROLL2
            for (int h = 0; h < 2; h++) {
                const int32_t *x4 = (const int32_t *)(const void *)(xq + 256 * b + 128 * n + 16 * h);
                l16i W[4][4];
                q3_unpack(blk, n, h, W);
R16_UNROLL4
                for (int j = 0; j < 4; j++) {
                    const int gi = 8 * n + 2 * j + h;
                    l16i s = l16_set1_epi32(-4 * xs[16 * b + gi]);
R16_UNROLL4
                    for (int i = 0; i < 4; i++) s = dpbusd_bcst(s, W[j][i], x4 + 8 * j + i);
                    A[gi] = r16_add(A[gi], s, q3_scale_lanes(blk, d, gi), xd[8 * b + gi / 2]);
                }
            }
        }
    }
    fold16_rows(A, out);
}

/* A Q5_K group block: d, dmin, then the rows' 43 words a chunk each: 3 of scales (Q4_K's), 8
 * of fifth bits (qh), 32 of nibbles (Q4_K's values) */
#define Q5_AT(blk, word) ((const void *)((blk) + 64 + 64 * (word)))

/* the 16 rows' values of Q5_K nibble word 8 c + k, low (lo) and high (hi) nibbles with their
 * fifth bits 2c and 2c + 1 of qh word k */
static inline __attribute__((always_inline)) void q5_unpack(const uint8_t *blk, int c, int k, l16i *lo, l16i *hi) {
    const l16i m4 = l16_set1_epi8(0x0F), m1 = l16_set1_epi8(1);
    const l16i q = l16_loadu_si512(Q5_AT(blk, 11 + 8 * c + k)), qh = l16_loadu_si512(Q5_AT(blk, 3 + k));
    *lo = l16_or_si512(l16_and_si512(q, m4), l16_slli_epi16(l16_and_si512(l16_srli_epi16(qh, 2 * c), m1), 4));
    *hi = l16_or_si512(l16_and_si512(l16_srli_epi16(q, 4), m4),
                       l16_slli_epi16(l16_and_si512(l16_srli_epi16(qh, 2 * c + 1), m1), 4));
}

/* 16 repacked Q5_K rows times one activation row: Q4_K's order (units of 32, with mins) */
static void r16_group1_q5k(const uint8_t *g, int64_t nb, const int8_t *xq, const float *xd,
                           const float *xsum, float *out) {
    l16f A[16];
    for (int j = 0; j < 16; j++) A[j] = l16_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 2816 * b;
        const l16f d = r16_f16(blk), dmin = r16_f16(blk + 32);
        const l16i S[3] = {l16_loadu_si512(Q5_AT(blk, 0)), l16_loadu_si512(Q5_AT(blk, 1)),
                           l16_loadu_si512(Q5_AT(blk, 2))};
        const int h = (int)(b % 2);
R16_UNROLL4
        for (int c = 0; c < 4; c++) {
            const int32_t *x0 = (const int32_t *)(const void *)(xq + 256 * b + 64 * c), *x1 = x0 + 8;
            l16i n0 = l16_setzero_si512(), n1 = l16_setzero_si512();
R16_UNROLL8
            for (int k = 0; k < 8; k++) {
                l16i lo, hi;
                q5_unpack(blk, c, k, &lo, &hi);
                n0 = dpbusd_bcst(n0, lo, x0 + k);
                n1 = dpbusd_bcst(n1, hi, x1 + k);
            }
            const l16i n[2] = {n0, n1};
R16_UNROLL2
            for (int e = 0; e < 2; e++) {
                const int j = 2 * c + e;
                const int64_t u = 8 * b + j;
                const l16f ws = l16_mul_ps(d, l16_cvtepi32_ps(k4_lanes(S, j, 0)));
                const l16f wm = l16_mul_ps(dmin, l16_cvtepi32_ps(k4_lanes(S, j, 1)));
                A[8 * h + j] = r16_add_min(A[8 * h + j], n[e], ws, xd[u], wm, xsum[u]);
            }
        }
    }
    fold16_rows(A, out);
}

/* The 16 rows' weights at column col of a group (lane r: row r), as plan_weight decodes each
 * (k_weight_at for the K formats): the same operations in the same order, 16 lanes at once */
/* each lane's byte 0 as the signed value table[it] (a nibble in, zeros above it) */
static inline l16i r16_lookup(l16i tbl, l16i nibble) {
    return l16_srai_epi32(l16_slli_epi32(l16_shuffle_epi8(tbl, nibble), 24), 24);
}

static inline l16f r16_weights(int fmt, const uint8_t *g, int32_t col) {
    if (fmt == IQ1_S) { /* d (2 s + 1) / 8 times 8 (v + delta) */
        const uint8_t *blk = g + 800 * (col >> 8);
        const int e = col & 255, sb = e >> 5, at = e & 31; /* value at of sub-block sb */
        const l16i w = iq1s_field(blk, sb);
        const l16i idx = iq1s_index(l16_loadu_si512(IQ1_AT(blk, sb)), w, at / 8);
        const l16i word = l16_gather32(l16_add_epi32(l16_slli_epi32(idx, 1), l16_set1_epi32((at % 8) / 4)),
                                       (const int32_t *)(const void *)iq1s_grid);
        const l16i v = l16_srai_epi32(l16_slli_epi32(word, 24 - 8 * (at % 4)), 24);
        const l16i neg = l16_srai_epi32(l16_slli_epi32(w, 16), 31); /* -1 or 0 */
        const l16i q = l16_add_epi32(l16_slli_epi32(v, 3), l16_add_epi32(l16_add_epi32(neg, neg), l16_set1_epi32(1)));
        return l16_mul_ps(iq1s_scale_lanes(r16_f16(blk), w), l16_cvtepi32_ps(q));
    }
    if (fmt == IQ2_XXS || fmt == IQ3_XXS || fmt == IQ3_S || fmt == IQ2_XS || fmt == IQ2_S) {
        /* the unit's scale times the value: its entries unpacked as the kernels unpack them */
        const uint8_t *blk = g + R16_BLOCK(fmt) * (col >> 8);
        const int e = col & 255, len = fmt == IQ2_XS || fmt == IQ2_S ? 16 : 32, at = e % len;
        l16i W[8];
        const l16f ws = len == 16 ? iq16_unpack(fmt, blk, r16_f16(blk), e / 16, W)
                                  : iq32_unpack(fmt, blk, r16_f16(blk), e / 32, W);
        const l16i q = r16_q8(W[at / 4], l16_set1_epi8(-128)); /* the signed bytes again */
        return l16_mul_ps(ws, l16_cvtepi32_ps(l16_srai_epi32(l16_slli_epi32(q, 24 - 8 * (at % 4)), 24)));
    }
    if (fmt == TQ1_0) { /* d (digit - 1): digit k of a byte is the top one of b 3^k mod 256 */
        const uint8_t *blk = g + 864 * (col >> 8);
        const int p = col & 255, k = p < 160 ? p / 32 : p < 240 ? (p - 160) / 16 : (p - 240) / 4;
        const int j = p < 160 ? p % 32 : p < 240 ? 32 + (p - 160) % 16 : 48 + (p - 240) % 4;
        l16i f = r16_bytes((const uint8_t *)TQ1_AT(blk, j / 4), j % 4);
        for (int i = 0; i < k; i++) f = l16_and_si512(l16_add_epi32(f, l16_add_epi32(f, f)), l16_set1_epi32(0xFF));
        const l16i digit = l16_srli_epi32(l16_add_epi32(f, l16_add_epi32(f, f)), 8);
        return l16_mul_ps(r16_f16(blk), l16_cvtepi32_ps(l16_sub_epi32(digit, l16_set1_epi32(1))));
    }
    if (fmt == IQ1_M) { /* d (2 s + 1) / 8 times 8 (v + delta) */
        const uint8_t *blk = g + 896 * (col >> 8);
        const int e = col & 255, j = e % 8;
        l16i index, neg;
        iq1m_entry(blk, e / 8, &index, &neg);
        const l16i word = l16_gather32(l16_add_epi32(l16_slli_epi32(index, 1), l16_set1_epi32(j / 4)),
                                       (const int32_t *)(const void *)iq1s_grid);
        const l16i v = l16_srai_epi32(l16_slli_epi32(word, 24 - 8 * (j % 4)), 24);
        const l16i q = l16_add_epi32(l16_slli_epi32(v, 3), l16_add_epi32(l16_add_epi32(neg, neg), l16_set1_epi32(1)));
        return l16_mul_ps(iq1m_scale_lanes(blk, iq1m_d(blk), e / 16), l16_cvtepi32_ps(q));
    }
    if (fmt == TQ2_0) { /* d (digit - 1) */
        const uint8_t *blk = g + 1056 * (col >> 8), *body = blk + 32;
        const int e = col & 255, at = 32 * (e >> 7) + (e & 31);
        const l16i q = l16_and_si512(l16_srli_epi32(R16_BYTE(body, at >> 2, at), 2 * ((e >> 5) & 3)),
                                     l16_set1_epi32(3));
        return l16_mul_ps(r16_f16(blk), l16_cvtepi32_ps(l16_sub_epi32(q, l16_set1_epi32(1))));
    }
    if (fmt == IQ4_XS) { /* d (ls - 32) table[nibble] */
        const uint8_t *blk = g + 2176 * (col >> 8), *body = blk + 64;
        const int e = col & 255, sb = e >> 5, t = e & 31, at = 4 + 16 * sb + (t & 15);
        const l16i byte = R16_BYTE(body, at >> 2, at);
        const l16i nib = t < 16 ? l16_and_si512(byte, l16_set1_epi32(0xF)) : l16_srli_epi32(byte, 4);
        const l16i v = r16_lookup(l16_table(kvalues_iq4nl), nib);
        const l16f ws = iq4xs_scale_lanes(r16_f16(blk), l16_loadu_si512(IQ4_AT(blk, 0)), r16_u16(blk + 32), sb);
        return l16_mul_ps(ws, l16_cvtepi32_ps(v));
    }
    if (fmt == Q3_K) { /* lowbit_weight_at's: d (sc - 32) q - 0 */
        const uint8_t *blk = g + 1760 * (col >> 8), *body = blk + 32;
        const int e = col & 255, j = (e >> 5) & 3, l = e & 31, at = 32 + 32 * (e >> 7) + l;
        const l16i low = l16_and_si512(l16_srli_epi32(R16_BYTE(body, at >> 2, at), 2 * j), l16_set1_epi32(3));
        const l16i hb = l16_and_si512(l16_srli_epi32(R16_BYTE(body, l >> 2, l), 4 * (e >> 7) + j),
                                      l16_set1_epi32(1));
        const l16i q = l16_sub_epi32(l16_or_si512(low, l16_slli_epi32(hb, 2)), l16_set1_epi32(4));
        const l16f w = l16_mul_ps(q3_scale_lanes(blk, r16_f16(blk), e >> 4), l16_cvtepi32_ps(q));
        return l16_sub_ps(w, l16_setzero_ps());
    }
    if (fmt == Q2_K) { /* k_weight_at's: d sc q - dmin m, the block's words from chunk 0 */
        const uint8_t *blk = g + 1344 * (col >> 8), *body = blk + 64;
        const int e = col & 255, gi = e >> 4, at = 16 + 32 * (e >> 7) + (e & 31);
        const l16i q = l16_and_si512(l16_srli_epi32(R16_BYTE(body, at >> 2, at), 2 * ((e >> 5) & 3)),
                                     l16_set1_epi32(3));
        const l16i S = R16_BYTE(body, gi >> 2, gi);
        const l16i sc = l16_and_si512(S, l16_set1_epi32(0xF)), m = l16_srli_epi32(S, 4);
        const l16f w = l16_mul_ps(l16_mul_ps(r16_f16(blk), l16_cvtepi32_ps(sc)), l16_cvtepi32_ps(q));
        return l16_sub_ps(w, l16_mul_ps(r16_f16(blk + 32), l16_cvtepi32_ps(m)));
    }
    if (fmt == Q6_K) {
        const uint8_t *blk = g + 3360 * (col >> 8), *body = blk + 32;
        const int e = col & 255, gi = e >> 4, n = e >> 7, part = (e >> 5) & 3, l = e & 31;
        const int lo = 64 * n + 32 * (part & 1) + l, hi = 128 + 32 * n + l, sb = 192 + gi;
        const l16i qlb = R16_BYTE(body, q6_chunk(lo >> 2), lo);
        const l16i h = l16_and_si512(l16_srli_epi32(R16_BYTE(body, q6_chunk(hi >> 2), hi), 2 * part),
                                           l16_set1_epi32(3));
        const l16i low = part < 2 ? l16_and_si512(qlb, l16_set1_epi32(0xF)) : l16_srli_epi32(qlb, 4);
        const l16i q = l16_sub_epi32(l16_or_si512(low, l16_slli_epi32(h, 4)), l16_set1_epi32(32));
        const l16i sc = l16_srai_epi32(l16_slli_epi32(R16_BYTE(body, q6_chunk(sb >> 2), sb), 24), 24);
        const l16f w = l16_mul_ps(l16_mul_ps(r16_f16(blk), l16_cvtepi32_ps(sc)), l16_cvtepi32_ps(q));
        return l16_sub_ps(w, l16_setzero_ps());
    }
    if (fmt == Q4_K || fmt == Q5_K) { /* the scales' 12 bytes are 3 words: chunks 0..2 */
        const uint8_t *blk = g + R16_BLOCK(fmt) * (col >> 8), *sc12 = blk + 64;
        const int e = col & 255, at = 32 * (e >> 6) + (e & 31), j = e >> 5;
        const l16i m63 = l16_set1_epi32(63), m15 = l16_set1_epi32(0xF);
        l16i sc, m;
        if (j < 4) {
            sc = l16_and_si512(R16_BYTE(sc12, j >> 2, j), m63);
            m = l16_and_si512(R16_BYTE(sc12, (j + 4) >> 2, j + 4), m63);
        } else {
            const l16i s4 = R16_BYTE(sc12, (j + 4) >> 2, j + 4);
            const l16i hi_sc = l16_slli_epi32(l16_srli_epi32(R16_BYTE(sc12, (j - 4) >> 2, j - 4), 6), 4);
            const l16i hi_m = l16_slli_epi32(l16_srli_epi32(R16_BYTE(sc12, j >> 2, j), 6), 4);
            sc = l16_or_si512(l16_and_si512(s4, m15), hi_sc);
            m = l16_or_si512(l16_srli_epi32(s4, 4), hi_m);
        }
        const l16i byte = R16_BYTE(fmt == Q5_K ? (const uint8_t *)Q5_AT(blk, 11) : blk + 256, at >> 2, at);
        l16i q = (e & 32) ? l16_srli_epi32(byte, 4) : l16_and_si512(byte, m15);
        if (fmt == Q5_K) { /* the fifth bit: bit j of qh byte e % 32 */
            const int l = e & 31;
            const l16i hb = l16_and_si512(l16_srli_epi32(R16_BYTE((const uint8_t *)Q5_AT(blk, 3), l >> 2, l), j),
                                          l16_set1_epi32(1));
            q = l16_or_si512(q, l16_slli_epi32(hb, 4));
        }
        const l16f w = l16_mul_ps(l16_mul_ps(r16_f16(blk), l16_cvtepi32_ps(sc)), l16_cvtepi32_ps(q));
        return l16_sub_ps(w, l16_mul_ps(r16_f16(blk + 32), l16_cvtepi32_ps(m)));
    }
    const uint8_t *blk = g + R16_BLOCK(fmt) * (col >> 5);
    const int e = col & 31, i = fmt == Q8_0 ? e : e & 15, at = r16_at32(fmt);
    const l16f d = r16_scale32(fmt, blk);
    const l16i word = l16_srli_epi32(l16_loadu_si512((const void *)(blk + at + 64 * (i >> 2))), 8 * (i & 3));
    if (fmt == Q8_0) /* the byte, sign-extended */
        return l16_mul_ps(d, l16_cvtepi32_ps(l16_srai_epi32(l16_slli_epi32(word, 24), 24)));
    const l16i v = l16_and_si512(e >= 16 ? l16_srli_epi32(word, 4) : word, l16_set1_epi32(0xF));
    if (fmt == Q4_1) return l16_add_ps(l16_mul_ps(d, l16_cvtepi32_ps(v)), r16_f16(blk + 32));
    if (fmt == IQ4_NL || fmt == MXFP4) return l16_mul_ps(d, l16_cvtepi32_ps(r16_lookup(l16_table(r16_table32(fmt)), v)));
    return l16_mul_ps(d, l16_cvtepi32_ps(l16_sub_epi32(v, l16_set1_epi32(8))));
}

/* ---- 16 repacked rows times 2..16 activation rows (a prefill's tile) ----
 * Each chunk of weights is unpacked once for all the rows, then each row takes the operations
 * r16_group1 / _q4k / _q6k give it, in their order, its accumulators in memory (acc[t]): the
 * same bits for a token alone or in any tile. Why: a prefill through the one-row kernels
 * unpacked every chunk once per token (Q6_K: ~30 vector ops of bit moving per 4 dpbusd). */
typedef struct { l16f a[16]; } r16_acc;

static inline __attribute__((always_inline)) void r16_tile32(const int fmt, const uint8_t *g,
                                                             int64_t nb, const acts *a,
                                                             r16_acc *acc) {
    const int nl = fmt == IQ4_NL || fmt == MXFP4, gb = R16_BLOCK(fmt);
    const int off = fmt == Q8_0 || nl ? R16_Q8_OFF : fmt == Q4_0 ? 8 : 0, at = r16_at32(fmt);
    const int64_t cols = a->cols, nbx = cols / 32, nx = a->nx;
    const l16i m4 = l16_set1_epi8(0x0F), flip = l16_set1_epi8(-128), tbl = l16_table(r16_table32(fmt));
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + gb * b;
        l16i W[8];
        for (int k = 0; k < (fmt == Q8_0 ? 8 : 4); k++) {
            const l16i q = l16_loadu_si512((const void *)(blk + at + 64 * k));
            if (fmt == Q8_0) {
                W[k] = r16_q8(q, flip);
            } else if (nl) {
                W[k] = r16_q8(l16_shuffle_epi8(tbl, l16_and_si512(q, m4)), flip);
                W[4 + k] = r16_q8(l16_shuffle_epi8(tbl, l16_and_si512(l16_srli_epi16(q, 4), m4)), flip);
            } else {
                W[k] = l16_and_si512(q, m4);
                W[4 + k] = l16_and_si512(l16_srli_epi16(q, 4), m4);
            }
        }
        const l16f d = r16_scale32(fmt, blk);
        const l16f wm = fmt == Q4_1 ? l16_sub_ps(l16_setzero_ps(), r16_f16(blk + 32)) : l16_setzero_ps();
        const int j = (int)(b % 16);
        for (int64_t t = 0; t < nx; t++) {
            const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 32 * b);
            const int32_t *xs = a->xs + 2 * t * nbx;
            l16i s0 = l16_set1_epi32(-off * (xs[2 * b] + xs[2 * b + 1])), s1 = l16_setzero_si512();
            for (int k = 0; k < 8; k += 2) {
                if (fmt == Q8_0 || nl) {
                    s0 = dot_q8_bcst(s0, W[k], x4 + k);
                    s1 = dot_q8_bcst(s1, W[k + 1], x4 + k + 1);
                } else {
                    s0 = dpbusd_bcst(s0, W[k], x4 + k);
                    s1 = dpbusd_bcst(s1, W[k + 1], x4 + k + 1);
                }
            }
            const l16i n = l16_add_epi32(s0, s1);
            const float xd = a->xd[t * nbx + b];
            if (fmt == Q4_1) acc[t].a[j] = r16_add_min(acc[t].a[j], n, d, xd, wm, a->xsum[t * nbx + b]);
            else acc[t].a[j] = r16_add(acc[t].a[j], n, d, xd);
        }
    }
}

static void r16_tile_q4k(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32, nx = a->nx;
    const l16i m4 = l16_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 2304 * b;
        const l16f d = r16_f16(blk), dmin = r16_f16(blk + 32);
        const l16i S[3] = {l16_loadu_si512((const void *)(blk + 64)), l16_loadu_si512((const void *)(blk + 128)),
                              l16_loadu_si512((const void *)(blk + 192))};
        const int h = (int)(b % 2);
        for (int c = 0; c < 4; c++) {
            l16i W[16];
            for (int k = 0; k < 8; k++) {
                const l16i q = l16_loadu_si512((const void *)(blk + 256 + 64 * (8 * c + k)));
                W[k] = l16_and_si512(q, m4);
                W[8 + k] = l16_and_si512(l16_srli_epi16(q, 4), m4);
            }
            l16f ws[2], wm[2];
            for (int e = 0; e < 2; e++) {
                ws[e] = l16_mul_ps(d, l16_cvtepi32_ps(k4_lanes(S, 2 * c + e, 0)));
                wm[e] = l16_mul_ps(dmin, l16_cvtepi32_ps(k4_lanes(S, 2 * c + e, 1)));
            }
            for (int64_t t = 0; t < nx; t++) {
                const int32_t *x0 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b + 64 * c), *x1 = x0 + 8;
                l16i n0 = l16_setzero_si512(), n1 = l16_setzero_si512();
                l16i n0b = l16_setzero_si512(), n1b = l16_setzero_si512();
                for (int k = 0; k < 8; k += 2) {
                    n0 = dpbusd_bcst(n0, W[k], x0 + k);
                    n1 = dpbusd_bcst(n1, W[8 + k], x1 + k);
                    n0b = dpbusd_bcst(n0b, W[k + 1], x0 + k + 1);
                    n1b = dpbusd_bcst(n1b, W[8 + k + 1], x1 + k + 1);
                }
                const l16i n[2] = {l16_add_epi32(n0, n0b), l16_add_epi32(n1, n1b)};
                for (int e = 0; e < 2; e++) {
                    const int64_t u = 8 * b + 2 * c + e;
                    const int tt = 8 * h + 2 * c + e;
                    acc[t].a[tt] = r16_add_min(acc[t].a[tt], n[e], ws[e], a->xd[t * nbx + u], wm[e],
                                               a->xsum[t * nbx + u]);
                }
            }
        }
    }
}

/* Groups 8 n + 2 j + h (j = 0..3) of block b, for each activation row: weights W[j][i] (value
 * + off, off times the group's activation sum taken off), scale ws[j], no min: Q6_K's and
 * Q3_K's units of 16, as their one-row kernels add them */
static inline void r16_tile16_terms(const acts *a, int64_t b, int n, int h, l16i W[4][4], const l16f ws[4],
                                    int off, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32;
    for (int64_t t = 0; t < a->nx; t++) {
        const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b + 128 * n + 16 * h);
        const int32_t *xs = a->xs + 2 * t * nbx;
        for (int j = 0; j < 4; j++) {
            const int gi = 8 * n + 2 * j + h;
            l16i s = l16_set1_epi32(-off * xs[16 * b + gi]);
            for (int i = 0; i < 4; i++) s = dpbusd_bcst(s, W[j][i], x4 + 8 * j + i);
            acc[t].a[gi] = r16_add(acc[t].a[gi], s, ws[j], a->xd[t * nbx + 8 * b + gi / 2]);
        }
    }
}

static void r16_tile_q6k(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const l16i m4 = l16_set1_epi8(0x0F), m30 = l16_set1_epi8(0x30);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 3360 * b;
        const l16f d = r16_f16(blk);
        for (int n = 0; n < 2; n++) {
            for (int cq = 0; cq < 2; cq++) {
                l16i u[4][4];
                for (int i = 0; i < 4; i++) {
                    l16i w[4];
                    q6_unpack(blk, 4 + 3 * (8 * n + 4 * cq + i), m4, m30, w);
                    for (int m = 0; m < 4; m++) u[m][i] = w[m];
                }
                l16f sg[4];
                for (int m = 0; m < 4; m++) {
                    const int gi = 8 * n + 2 * m + cq;
                    sg[m] = q6_scale_lanes(blk, d, gi);
                }
                r16_tile16_terms(a, b, n, cq, u, sg, 32, acc);
            }
        }
    }
}

static void r16_tile_q2k(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32, nx = a->nx;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 1344 * b;
        const l16f d = r16_f16(blk), dmin = r16_f16(blk + 32);
        for (int n = 0; n < 2; n++) {
            for (int h = 0; h < 2; h++) {
                l16i W[4][4];
                q2_unpack(blk, n, h, W);
                l16f ws[4], wm[4];
                for (int j = 0; j < 4; j++) q2_scale_lanes(blk, d, dmin, 8 * n + 2 * j + h, &ws[j], &wm[j]);
                for (int64_t t = 0; t < nx; t++) {
                    const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b + 128 * n + 16 * h);
                    const int32_t *xs = a->xs + 2 * t * nbx;
                    for (int j = 0; j < 4; j++) {
                        const int gi = 8 * n + 2 * j + h;
                        l16i s = l16_setzero_si512();
                        for (int i = 0; i < 4; i++) s = dpbusd_bcst(s, W[j][i], x4 + 8 * j + i);
                        const float x = a->xd[t * nbx + 8 * b + gi / 2];
                        acc[t].a[gi] = r16_add_min(acc[t].a[gi], s, ws[j], x, wm[j], x * (float)xs[16 * b + gi]);
                    }
                }
            }
        }
    }
}

/* Unit s (32 weights) of block b, for each activation row: its 8 words of weights W[k] as
 * Q8_0's go to dot_q8 (the offset times the unit's activation sum taken off), scale ws:
 * IQ2_XXS's and IQ4_XS's, in their one-row kernels' order (two sums, then one term) */
static inline void r16_tile32_q8terms(const acts *a, int64_t b, int s, const l16i W[8], l16f ws,
                                      r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32, u = 8 * b + s;
    const int tt = 8 * (int)(b % 2) + s;
    for (int64_t t = 0; t < a->nx; t++) {
        const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b);
        const int32_t *xs = a->xs + 2 * t * nbx;
        const l16i n = r16_dots_q8(W, 8, x4 + 8 * s, xs[2 * u] + xs[2 * u + 1]);
        acc[t].a[tt] = r16_add(acc[t].a[tt], n, ws, a->xd[t * nbx + u]);
    }
}

/* the codebook formats with signs: each unit unpacked once for all the activation rows */
static inline __attribute__((always_inline)) void r16_tile_iq(const int fmt, const uint8_t *g, int64_t nb,
                                                              const acts *a, r16_acc *acc) {
    const int len = iq_unit(fmt), per = 256 / len;
    const int64_t cols = a->cols, nbx = cols / 32;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + R16_BLOCK(fmt) * b;
        const l16f d = r16_f16(blk);
        for (int s = 0; s < per; s++) {
            const int64_t u = per * b + s;
            l16i W[8];
            const l16f ws = iq_unpack(fmt, blk, d, s, W);
            for (int64_t t = 0; t < a->nx; t++) {
                const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b);
                const int32_t *xs = a->xs + 2 * t * nbx;
                const int32_t sum = len == 16 ? xs[u] : xs[2 * u] + xs[2 * u + 1];
                const l16i n = r16_dots_q8(W, len / 4, x4 + len / 4 * s, sum);
                acc[t].a[u % 16] = r16_add(acc[t].a[u % 16], n, ws, a->xd[t * nbx + u * len / 32]);
            }
        }
    }
}

/* TQ1_0: a block's 64 words of digits made once for all the activation rows */
static void r16_tile_tq1(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 864 * b;
        l16i W[64];
        for (int w = 0; w < 13; w++) {
            l16i f = l16_loadu_si512(TQ1_AT(blk, w));
            for (int k = 0; k < (w < 12 ? 5 : 4); k++) {
                W[tq1_at(w, k)] = tq1_top(f);
                f = tq1_next(f);
            }
        }
        const l16f d = r16_f16(blk);
        for (int64_t t = 0; t < a->nx; t++) {
            const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b);
            const int32_t *xs = a->xs + 2 * t * nbx + 16 * b;
            for (int u = 0; u < 8; u++) {
                l16i n = l16_set1_epi32(-(xs[2 * u] + xs[2 * u + 1]));
                for (int k = 0; k < 8; k++) n = dpbusd_bcst(n, W[8 * u + k], x4 + 8 * u + k);
                const int tt = 8 * (int)(b % 2) + u;
                acc[t].a[tt] = r16_add(acc[t].a[tt], n, d, a->xd[t * nbx + 8 * b + u]);
            }
        }
    }
}

static void r16_tile_iq1s(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32, nx = a->nx;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 800 * b;
        const l16f d = r16_f16(blk);
        for (int s = 0; s < 8; s++) {
            const int64_t u = 8 * b + s;
            const l16i w = iq1s_field(blk, s);
            l16i W[8];
            iq1s_unpack(l16_loadu_si512(IQ1_AT(blk, s)), w, W);
            const l16f ws = iq1s_scale_lanes(d, w);
            const int tt = 8 * (int)(b % 2) + s;
            for (int64_t t = 0; t < nx; t++) {
                const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b);
                const int32_t *xs = a->xs + 2 * t * nbx;
                l16i n = l16_set1_epi32(-9 * (xs[2 * u] + xs[2 * u + 1]));
                for (int k = 0; k < 8; k++) n = dpbusd_bcst(n, W[k], x4 + 8 * s + k);
                acc[t].a[tt] = r16_add(acc[t].a[tt], n, ws, a->xd[t * nbx + u]);
            }
        }
    }
}

static void r16_tile_iq1m(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32, nx = a->nx;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 896 * b;
        const l16f d = iq1m_d(blk);
        for (int gi = 0; gi < 16; gi++) {
            l16i W[4];
            iq1m_unpack(blk, gi, W);
            const l16f ws = iq1m_scale_lanes(blk, d, gi);
            for (int64_t t = 0; t < nx; t++) {
                const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b);
                l16i n = l16_set1_epi32(-9 * a->xs[2 * t * nbx + 16 * b + gi]);
                for (int k = 0; k < 4; k++) n = dpbusd_bcst(n, W[k], x4 + 4 * gi + k);
                acc[t].a[gi] = r16_add(acc[t].a[gi], n, ws, a->xd[t * nbx + 8 * b + gi / 2]);
            }
        }
    }
}

static void r16_tile_tq2(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32, nx = a->nx;
    const l16i m3 = l16_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 1056 * b;
        const l16f d = r16_f16(blk);
        for (int n = 0; n < 2; n++) {
            l16i W[4][8];
            for (int k = 0; k < 8; k++) {
                const l16i q = l16_loadu_si512(TQ2_AT(blk, 8 * n + k));
                for (int j = 0; j < 4; j++) W[j][k] = l16_and_si512(l16_srli_epi16(q, 2 * j), m3);
            }
            for (int64_t t = 0; t < nx; t++) {
                const int32_t *x4 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b);
                const int32_t *xs = a->xs + 2 * t * nbx + 16 * b;
                for (int j = 0; j < 4; j++) {
                    const int u = 4 * n + j;
                    l16i s = l16_set1_epi32(-(xs[2 * u] + xs[2 * u + 1]));
                    for (int k = 0; k < 8; k++) s = dpbusd_bcst(s, W[j][k], x4 + 32 * n + 8 * j + k);
                    const int tt = 8 * (int)(b % 2) + u;
                    acc[t].a[tt] = r16_add(acc[t].a[tt], s, d, a->xd[t * nbx + 8 * b + u]);
                }
            }
        }
    }
}

static void r16_tile_iq4xs(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const l16i tbl = l16_table(kvalues_iq4nl);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 2176 * b;
        const l16f d = r16_f16(blk);
        const l16i SH = r16_u16(blk + 32), SL = l16_loadu_si512(IQ4_AT(blk, 0));
        for (int s = 0; s < 8; s++) {
            l16i W[8]; /* low nibbles' values 0-15 of the unit, then the high nibbles' */
            for (int i = 0; i < 4; i++) iq4xs_unpack(blk, s, i, tbl, &W[i], &W[4 + i]);
            r16_tile32_q8terms(a, b, s, W, iq4xs_scale_lanes(d, SL, SH, s), acc);
        }
    }
}

static void r16_tile_q3k(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 1760 * b;
        const l16f d = r16_f16(blk);
        for (int n = 0; n < 2; n++) {
            for (int h = 0; h < 2; h++) {
                l16i W[4][4];
                q3_unpack(blk, n, h, W);
                l16f ws[4];
                for (int j = 0; j < 4; j++) ws[j] = q3_scale_lanes(blk, d, 8 * n + 2 * j + h);
                r16_tile16_terms(a, b, n, h, W, ws, 4, acc);
            }
        }
    }
}

static void r16_tile_q5k(const uint8_t *g, int64_t nb, const acts *a, r16_acc *acc) {
    const int64_t cols = a->cols, nbx = cols / 32, nx = a->nx;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = g + 2816 * b;
        const l16f d = r16_f16(blk), dmin = r16_f16(blk + 32);
        const l16i S[3] = {l16_loadu_si512(Q5_AT(blk, 0)), l16_loadu_si512(Q5_AT(blk, 1)),
                           l16_loadu_si512(Q5_AT(blk, 2))};
        const int h = (int)(b % 2);
        for (int c = 0; c < 4; c++) {
            l16i W[16];
            for (int k = 0; k < 8; k++) q5_unpack(blk, c, k, &W[k], &W[8 + k]);
            l16f ws[2], wm[2];
            for (int e = 0; e < 2; e++) {
                ws[e] = l16_mul_ps(d, l16_cvtepi32_ps(k4_lanes(S, 2 * c + e, 0)));
                wm[e] = l16_mul_ps(dmin, l16_cvtepi32_ps(k4_lanes(S, 2 * c + e, 1)));
            }
            for (int64_t t = 0; t < nx; t++) {
                const int32_t *x0 = (const int32_t *)(const void *)(a->xq + t * cols + 256 * b + 64 * c), *x1 = x0 + 8;
                l16i n0 = l16_setzero_si512(), n1 = l16_setzero_si512();
                for (int k = 0; k < 8; k++) {
                    n0 = dpbusd_bcst(n0, W[k], x0 + k);
                    n1 = dpbusd_bcst(n1, W[8 + k], x1 + k);
                }
                const l16i n[2] = {n0, n1};
                for (int e = 0; e < 2; e++) {
                    const int64_t u = 8 * b + 2 * c + e;
                    const int tt = 8 * h + 2 * c + e;
                    acc[t].a[tt] = r16_add_min(acc[t].a[tt], n[e], ws[e], a->xd[t * nbx + u], wm[e],
                                               a->xsum[t * nbx + u]);
                }
            }
        }
    }
}

/* 16 rows of group g (format fmt as in the file) times a's nx >= 2 rows: out[t * ld + lane] */
static void r16_tile(int fmt, const uint8_t *g, const acts *a, float *out, int64_t ld) {
    r16_acc acc[R16_TILE];
    for (int64_t t = 0; t < a->nx; t++)
        for (int j = 0; j < 16; j++) acc[t].a[j] = l16_setzero_ps();
    const int64_t nb = a->cols / R16_ELEMS(fmt);
    switch (fmt) {
    case Q8_0: r16_tile32(Q8_0, g, nb, a, acc); break;
    case Q4_0: r16_tile32(Q4_0, g, nb, a, acc); break;
    case Q4_1: r16_tile32(Q4_1, g, nb, a, acc); break;
    case Q4_K: r16_tile_q4k(g, nb, a, acc); break;
    case Q2_K: r16_tile_q2k(g, nb, a, acc); break;
    case Q3_K: r16_tile_q3k(g, nb, a, acc); break;
    case Q5_K: r16_tile_q5k(g, nb, a, acc); break;
    case TQ2_0: r16_tile_tq2(g, nb, a, acc); break;
    case IQ4_XS: r16_tile_iq4xs(g, nb, a, acc); break;
    case IQ4_NL: r16_tile32(IQ4_NL, g, nb, a, acc); break;
    case IQ1_S: r16_tile_iq1s(g, nb, a, acc); break;
    case IQ2_XXS: r16_tile_iq(IQ2_XXS, g, nb, a, acc); break;
    case IQ3_XXS: r16_tile_iq(IQ3_XXS, g, nb, a, acc); break;
    case IQ3_S: r16_tile_iq(IQ3_S, g, nb, a, acc); break;
    case IQ2_XS: r16_tile_iq(IQ2_XS, g, nb, a, acc); break;
    case IQ2_S: r16_tile_iq(IQ2_S, g, nb, a, acc); break;
    case TQ1_0: r16_tile_tq1(g, nb, a, acc); break;
    case MXFP4: r16_tile32(MXFP4, g, nb, a, acc); break;
    case IQ1_M: r16_tile_iq1m(g, nb, a, acc); break;
    default: r16_tile_q6k(g, nb, a, acc); break;
    }
    for (int64_t t = 0; t < a->nx; t++) fold16_rows(acc[t].a, out + t * ld);
}

/* The 16 rows of group g of a repacked weight (format rfmt) times a's rows: out[k * ld + lane],
 * the outliers added as one_row adds them */
static void r16_group(int rfmt, const uint8_t *g, const acts *a, const ol_plan *pl, float *out,
                      int64_t ld) {
    const int fmt = R16_NATURAL(rfmt);
    const int64_t cols = a->cols, nbx = cols / 32;
    if (a->nx > 1) {
        r16_tile(fmt, g, a, out, ld);
    } else switch (fmt) { /* one row: its accumulators in registers */
    case Q8_0: r16_group1(Q8_0, g, nbx, a->xq, a->xd, a->xs, NULL, out); break;
    case Q4_0: r16_group1(Q4_0, g, nbx, a->xq, a->xd, a->xs, NULL, out); break;
    case Q4_1: r16_group1(Q4_1, g, nbx, a->xq, a->xd, a->xs, a->xsum, out); break;
    case Q4_K: r16_group1_q4k(g, cols / 256, a->xq, a->xd, a->xsum, out); break;
    case Q2_K: r16_group1_q2k(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case Q3_K: r16_group1_q3k(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case Q5_K: r16_group1_q5k(g, cols / 256, a->xq, a->xd, a->xsum, out); break;
    case TQ2_0: r16_group1_tq2(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case IQ4_XS: r16_group1_iq4xs(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case IQ4_NL: r16_group1(IQ4_NL, g, nbx, a->xq, a->xd, a->xs, NULL, out); break;
    case IQ1_S: r16_group1_iq1s(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case IQ2_XXS: r16_group1_iq(IQ2_XXS, g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case IQ3_XXS: r16_group1_iq(IQ3_XXS, g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case IQ3_S: r16_group1_iq(IQ3_S, g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case IQ2_XS: r16_group1_iq(IQ2_XS, g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case IQ2_S: r16_group1_iq(IQ2_S, g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case TQ1_0: r16_group1_tq1(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    case MXFP4: r16_group1(MXFP4, g, nbx, a->xq, a->xd, a->xs, NULL, out); break;
    case IQ1_M: r16_group1_iq1m(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    default: r16_group1_q6k(g, cols / 256, a->xq, a->xd, a->xs, out); break;
    }
    if (!pl->nu) return;
    l16f w[PLAN_MAX];
    for (int u = 0; u < pl->nu; u++) w[u] = r16_weights(fmt, g, pl->col[u]);
    for (int64_t k = 0; k < a->nx; k++) {
        l16f t = l16_setzero_ps();
        for (int i = 0; i < pl->n[k]; i++)
            t = l16_add_ps(t, l16_mul_ps(l16_set1_ps(pl->val[k][i]), w[pl->use[k][i]]));
        l16_storeu_ps(out + k * ld, l16_add_ps(l16_loadu_ps(out + k * ld), t));
    }
}

int cs_repacked(int fmt) {
    return fmt == Q4_0 ? Q4_0R : fmt == Q4_1 ? Q4_1R : fmt == Q8_0 ? Q8_0R : fmt == Q4_K ? Q4_KR
         : fmt == Q6_K ? Q6_KR : fmt == Q2_K ? Q2_KR : fmt == Q3_K ? Q3_KR : fmt == Q5_K ? Q5_KR
         : fmt == TQ2_0 ? TQ2_0R : fmt == IQ4_XS ? IQ4_XSR : fmt == IQ4_NL ? IQ4_NLR
         : fmt == IQ1_S ? IQ1_SR : fmt == IQ2_XXS ? IQ2_XXSR : fmt == IQ1_M ? IQ1_MR
         : fmt == IQ2_XS ? IQ2_XSR : fmt == IQ3_XXS ? IQ3_XXSR : fmt == IQ3_S ? IQ3_SR : fmt == IQ2_S ? IQ2_SR
         : fmt == TQ1_0 ? TQ1_0R : fmt == MXFP4 ? MXFP4R : -1;
}

/* one block of row r of a group, from the file's layout (src) into the group's (o), or back */
static inline void r16_lane(int fmt, uint8_t *o, int r, uint8_t *src, int back) {
    /* two 16-bit fields: d and dmin (m); IQ4_XS's d and its high scale bits */
    const int two = fmt == Q4_K || fmt == Q5_K || fmt == Q4_1 || fmt == Q2_K || fmt == IQ4_XS;
    const int none = fmt == IQ1_M; /* its d is in its scale words */
    const int one = fmt == MXFP4;  /* one byte: its E8M0 scale */
    const int head = none ? 0 : one ? 1 : two ? 4 : 2, bb = R16_BYTES(fmt);
    const int words = (bb - head) / 4, body = none ? 0 : one ? 16 : two ? 64 : 32;
    const int tail = fmt == Q6_K || fmt == Q2_K || fmt == Q3_K || fmt == TQ2_0 || fmt == TQ1_0; /* f16s after words */
    const int first = tail ? 0 : head, at = tail ? bb - head : 0;
    uint8_t *f[2] = {o + (one ? 1 : 2) * r, src + at};
    if (!none) memcpy(f[back], f[!back], one ? 1 : 2);
    if (two) {
        uint8_t *m[2] = {o + 32 + 2 * r, src + at + 2};
        memcpy(m[back], m[!back], 2);
    }
    for (int k = 0; k < words; k++) {
        uint8_t *p[2] = {o + body + 64 * (fmt == Q6_K ? q6_chunk(k) : k) + 4 * r, src + first + 4 * k};
        memcpy(p[back], p[!back], 4);
    }
}

/* out = w (rows of a format cs_repacked names) with its whole 16-row groups repacked; the same size */
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

/* Row r of a repacked weight in the file's layout (into one, row_bytes long), or 0 when r is
 * after the last whole group (then it is as in the file) */
static int r16_row_bytes(int rfmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t r,
                         uint8_t *one) {
    if (!IS_R16(rfmt) || r >= rows / 16 * 16) return 0;
    const int fmt = R16_NATURAL(rfmt), bb = R16_BYTES(fmt);
    const uint8_t *g = w + r / 16 * 16 * row_bytes;
    for (int64_t b = 0; b < row_bytes / bb; b++)
        r16_lane(fmt, (uint8_t *)(g + R16_BLOCK(fmt) * b), (int)(r % 16), one + bb * b, 1);
    return 1;
}
#else
/* No repacked layout on this CPU: a weight stays as the file has it. */
int cs_repacked(int fmt) { (void)fmt; return -1; }
void cs_repack(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, uint8_t *out) {
    (void)fmt; (void)w; (void)rows; (void)row_bytes; (void)out;
}
#endif

/* ---- fused matmul ----------------------------------------------------------------------- */

/* How a matmul's rows are dealt to threads. Dynamically, in chunks: a thread whose core is
 * shared with another busy process (or that was woken late) takes fewer chunks instead of
 * holding every other thread at the end of a static split for its fixed share. A chunk is
 * 16..256 KB of weights (the shared counter is touched once per chunk, prefetch streams stay
 * long), about 8 per thread when the matrix allows. Below PAR_MIN_BYTES one thread does it
 * all: a fork/join costs more than the split saves. Each row is computed whole by one thread,
 * so how the rows are dealt changes no bit. */
#define PAR_MIN_BYTES (96 * 1024)
static inline int64_t chunk_rows(int64_t rows, int64_t row_bytes) {
    const int threads = max_threads();
    const int64_t lo = (16384 + row_bytes - 1) / row_bytes, hi = (262144 + row_bytes - 1) / row_bytes;
    const int64_t c = rows / (8 * (int64_t)threads);
    return c < lo ? lo : c > hi ? hi : c;
}

/* one row of W times a's rows, the outliers added: out[k * ld] */
static inline void one_row(int fmt, const uint8_t *row, const acts *a, const ol_plan *pl,
                           float *out, int64_t ld) {
    float o[R16_TILE];
    const int64_t nbx = a->cols / 32;
    for (int64_t k0 = 0; k0 < a->nx; k0 += MAX_BATCH) { /* the row kernel takes MAX_BATCH at most */
        acts sub = *a;
        sub.nx = a->nx - k0 < MAX_BATCH ? a->nx - k0 : MAX_BATCH;
        sub.xq += k0 * a->cols;
        sub.xd += k0 * nbx;
        sub.xs += 2 * k0 * nbx;
        sub.xsum += k0 * nbx;
        if (a->xd16) {
            sub.xd16 += 2 * k0 * nbx;
            sub.xsum16 += 2 * k0 * nbx;
        }
        exact_row_q(fmt, row, &sub, o + k0);
    }
    if (pl->nu) {
        float t[R16_TILE];
        plan_row(fmt, row, pl, t);
        for (int64_t k = 0; k < a->nx; k++) o[k] += t[k];
    }
    for (int64_t k = 0; k < a->nx; k++) out[k * ld] = o[k];
}

/* out (nx, rows) = x @ W.T for a quantized W (rows, row_bytes); x given as cs_quantize_act
 * (any nx: tiles of MAX_BATCH rows share each read of a weight row), and, unless ol is NULL,
 * each row of x's outliers (take_outliers) */
static void matmul_q(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                     const int8_t *xq, const float *xd, const int32_t *xs, int64_t nx,
                     const outliers *ol, float *out) {
    const int64_t chunk = chunk_rows(rows, row_bytes), nbx = cols / 32;
    const int64_t tile = IS_R16(fmt) ? R16_TILE : MAX_BATCH, tiles = (nx + tile - 1) / tile;
    const int par = rows * row_bytes * (tiles < 1 ? 1 : tiles) >= PAR_MIN_BYTES && rows > chunk;
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(nx * nbx + 1));
    acts *a = (acts *)malloc(sizeof(acts) * (size_t)(tiles + 1));
    ol_plan *pl = (ol_plan *)malloc(sizeof(ol_plan) * (size_t)(tiles + 1));
    for (int64_t i = 0; i < nx * nbx; i++) xsum[i] = xd[i] * (float)(xs[2 * i] + xs[2 * i + 1]);
    /* units of 16: each 16 values' scale and sum, as row_q would make them for every row */
    float *x16 = unit_len(R16_NATURAL(fmt)) == 16 ? (float *)malloc(sizeof(float) * (size_t)(4 * nx * nbx + 1)) : NULL;
    for (int64_t i = 0; x16 && i < 2 * nx * nbx; i++) {
        x16[i] = xd[i / 2];
        x16[2 * nx * nbx + i] = xd[i / 2] * (float)xs[i];
    }
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t r0 = tile * i, n = nx - r0 < tile ? nx - r0 : tile;
        a[i] = (acts){xq + r0 * cols, xd + r0 * nbx, xs + 2 * r0 * nbx, cols, n, xsum + r0 * nbx,
                      x16 ? x16 + 2 * r0 * nbx : NULL, x16 ? x16 + 2 * nx * nbx + 2 * r0 * nbx : NULL};
        pl[i].nu = 0;
        for (int k = 0; k < (int)n; k++) plan_add(&pl[i], fmt, k, ol ? &ol[r0 + k] : NULL, 0, cols);
    }
    /* a repacked weight: its whole groups of 16 rows, then the rows after them; else rows */
    const int nat = R16_NATURAL(fmt);
    const int64_t ng = IS_R16(fmt) ? rows / 16 : 0, units = ng + rows - 16 * ng;
    const int64_t uchunk = ng ? (chunk + 15) / 16 : chunk;
    const int use = par ? gov_threads() : 1;
    double done[GOV_MAX_THREADS], t0 = now_s();
#pragma omp parallel num_threads(use) if (use > 1)
    {
#pragma omp for schedule(dynamic, uchunk) nowait
        for (int64_t u = 0; u < units; u++) /* a group of 16 repacked rows, or one row */
            for (int64_t i = 0; i < tiles; i++) {
                float *oi = out + tile * i * rows;
#ifdef HAVE_R16
                if (u < ng) {
                    r16_group(fmt, w + 16 * u * row_bytes, &a[i], &pl[i], oi + 16 * u, rows);
                    continue;
                }
#endif
                const int64_t r = 16 * ng + (u - ng);
                one_row(nat, w + r * row_bytes, &a[i], &pl[i], oi + r, rows);
            }
#ifdef _OPENMP
        done[omp_get_thread_num()] = now_s();
#endif
    }
    if (use > 1) gov_note(t0, done, use);
    free(x16);
    free(xsum);
    free(a);
    free(pl);
}

void cs_matmul_q(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                 const int8_t *xq, const float *xd, const int32_t *xs, int64_t nx, float *out) {
    matmul_q(fmt, w, rows, row_bytes, cols, xq, xd, xs, nx, NULL, out);
}

/* The same, from float activations (any nx): quantized here, each row's outliers taken out
 * and multiplied in float, each row on its own (the same bits however rows are batched). */
void cs_matmul_qx_shared(int m, const int *fmt, const uint8_t *const *w, const int64_t *rows,
                         const int64_t *row_bytes, int64_t cols, const float *x, int64_t nx,
                         float *const *out);
void cs_matmul_qx(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                  const float *x, int64_t nx, float *out) {
    cs_matmul_qx_shared(1, &fmt, &w, &rows, &row_bytes, cols, x, nx, &out);
}

/* out[i] (nx, rows[i]) = x @ W_i.T for m quantized matrices that read the same x (Q, K and V;
 * gate and up): x quantized once for all, each product the bits of its own cs_matmul_qx. A
 * prefill quantized each row of its inputs 7 times a layer; 4 now. */
void cs_matmul_qx_shared(int m, const int *fmt, const uint8_t *const *w, const int64_t *rows,
                         const int64_t *row_bytes, int64_t cols, const float *x, int64_t nx,
                         float *const *out) {
    const int64_t nv = nx * cols, nbx = cols / 32;
    int8_t *xq = (int8_t *)malloc((size_t)nv + 1);
    float *xd = (float *)malloc(sizeof(float) * (size_t)(nv / 32 + 1));
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(nv / 16 + 1));
    outliers *ol = (outliers *)malloc(sizeof(outliers) * (size_t)(nx + 1));
    const int use = gov_threads_for(nv);
#pragma omp parallel for num_threads(use) if (use > 1) schedule(static)
    for (int64_t k = 0; k < nx; k++) {
        cs_quantize_act(x + k * cols, 1, cols, xq + k * cols, xd + k * nbx, xs + 2 * k * nbx);
        take_outliers(x + k * cols, cols, xq + k * cols, xd + k * nbx, xs + 2 * k * nbx, &ol[k]);
    }
    for (int i = 0; i < m; i++)
        matmul_q(fmt[i], w[i], rows[i], row_bytes[i], cols, xq, xd, xs, nx, ol, out[i]);
    free(xq);
    free(xd);
    free(xs);
    free(ol);
}

/* ---- float weights (F32, F16, BF16): the same reduction over columns -------------------- */

/* out (nx, rows) = x @ W.T, W rows of cols floats in fmt (F32 = 0, F16, BF16), any nx */
void cs_matmul_f(int fmt, const uint8_t *w, int64_t rows, int64_t cols, const float *x,
                 int64_t nx, float *out) {
    const int64_t rb = cols * (fmt == F32 ? 4 : 2), chunk = chunk_rows(rows, rb);
    const int par = rows * rb * ((nx + MAX_BATCH - 1) / MAX_BATCH) >= PAR_MIN_BYTES && rows > chunk;
    const int use = par ? gov_threads() : 1;
#pragma omp parallel for num_threads(use) if (use > 1) schedule(dynamic, chunk)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k0 = 0; k0 < nx; k0 += MAX_BATCH) {
            const int64_t n = nx - k0 < MAX_BATCH ? nx - k0 : MAX_BATCH;
            float o[MAX_BATCH];
            exact_row_f(fmt, w + r * rb, cols, x + k0 * cols, n, cols, o);
            for (int64_t k = 0; k < n; k++) out[(k0 + k) * rows + r] = o[k];
        }
    }
}

/* out[i] = rows[i] . x for n float rows of cols (the head's best rows, refined) */
void cs_dot_rows(const float *rows, int64_t n, int64_t cols, const float *x, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = dot_exact(rows + i * cols, x, cols);
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

/* the low-bit formats' rows: one copy for all of them, the decoder chosen per block */
static __attribute__((noinline)) void dequant_lowbit(int fmt, const uint8_t *row, int64_t nblocks, int64_t bbytes,
                                                     float *y) {
    dequant_row(fmt, row, nblocks, bbytes, y);
}

/* Row r of a weight (rows, row_bytes) as floats: from its group's lanes when repacked */
static void dequant_one(int fmt, const uint8_t *w, int64_t rows, int64_t row_bytes, int64_t cols,
                        int64_t r, float *y) {
    const int nat = R16_NATURAL(fmt), n = block_elems(nat);
    const int64_t nb = cols / n, bb = row_bytes / nb;
    const uint8_t *row = w + r * row_bytes;
#ifdef HAVE_R16
    uint8_t one[8192]; /* a repacked row back in the file's layout (rows up to 8 KB) */
    if (row_bytes <= (int64_t)sizeof one && r16_row_bytes(fmt, w, rows, row_bytes, r, one)) row = one;
    else if (IS_R16(fmt) && r < rows / 16 * 16) {
        uint8_t *big = (uint8_t *)malloc((size_t)row_bytes);
        r16_row_bytes(fmt, w, rows, row_bytes, r, big);
        dequant_one(nat, big, 1, row_bytes, cols, 0, y);
        free(big);
        return;
    }
#else
    (void)rows;
#endif
    switch (nat) {
    case Q8_0: dequant_row(Q8_0, row, nb, bb, y); break;
    case Q4_0: dequant_row(Q4_0, row, nb, bb, y); break;
    case Q4_1: dequant_row(Q4_1, row, nb, bb, y); break;
    case Q4_K: dequant_row(Q4_K, row, nb, bb, y); break;
    case Q6_K: dequant_row(Q6_K, row, nb, bb, y); break;
    case Q2_K: dequant_row(Q2_K, row, nb, bb, y); break;
    default: dequant_lowbit(nat, row, nb, bb, y); break;
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

/* exp(x) in IEEE arithmetic, 16 at a time, the same bits on every CPU (libm's expf differs
 * by library and by vector path, and does not vectorize); a tail goes through the same lanes
 * (xload16, store16_n), so every value has the same bits wherever it sits. x = n ln2
 * + r with n = round(x / ln2) (truncating x / ln2 + 128.5), r to within an ulp by ln2 in two
 * parts (n ln2_hi is exact), exp(r) for |r| <= ln2 / 2 by its Taylor series to degree 7
 * (error < 6e-9): ~1 ulp. x is clamped to [-88, 100] on its bits (a float clamp stops gcc
 * vectorizing), and 2^n's exponent to 2^-126 .. infinity: silu is x or 0 beyond, as with
 * expf. A NaN stays NaN. Written on vectors, not as a scalar loop gcc was trusted to
 * vectorize: it did not (silu_mul was a scalar loop, 6% of a prefill). The same bits as that
 * scalar function for all 2^32 inputs on the AVX-512, AVX2 and SSE2 builds. */
typedef uint32_t v16u __attribute__((vector_size(64)));
static inline v16f exp16(v16f x) {
    v16u u = (v16u)x; /* x to [-88, 100], infinities too */
    const v16u mag = u & 0x7FFFFFFFu, sign = u & 0x80000000u;
    const v16u neg = (v16u)(sign != 0);
    const v16u lim = (neg & 0x42B00000u) | (~neg & 0x42C80000u); /* 88.0f, 100.0f */
    const v16u clamp = (v16u)(mag > lim) & (v16u)(mag <= 0x7F800000u);
    x = (v16f)((clamp & (sign | lim)) | (~clamp & u));
    const v16i k = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, v16i); /* n + 128 */
    const v16f n = __builtin_convertvector(k, v16f) - 128.0f;
    const v16f r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
    v16f p = r * 1.9841270e-4f + 1.3888889e-3f; /* 1/7!, 1/6! */
    p = p * r + 8.3333333e-3f;
    p = p * r + 4.1666667e-2f;
    p = p * r + 1.6666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v16i lo = k < 2, hi = k > 255; /* 2^n's biased exponent, 1 .. 255 (infinity) */
    const v16i e = (lo & 1) | (hi & 255) | (~(lo | hi) & (k - 1));
    /* below e^-87 (~1.6e-38) exactly 0, never a subnormal: CPUs that flush subnormals to zero
     * (AltiVec, 32-bit NEON) and those that keep them would differ there */
    return (v16f)((v16i)(p * (v16f)(e << 23)) & ~(v16i)(x < -87.0f));
}

/* the first min(n, 16) lanes of v to p (a whole vector is one store, not a call to memcpy:
 * the call kept an exp's loop from overlapping one vector's arithmetic with the next's) */
static inline void store16_n(float *p, v16f v, int64_t n) {
    if (n >= 16)
        memcpy(p, &v, sizeof v);
    else
        memcpy(p, &v, sizeof(float) * (size_t)n);
}

/* the largest of p[0..n), NaNs skipped: 16 lanes' maxima, then theirs. Any order gives the
 * same value (a max is exact; only which zero wins between -0 and +0 may differ, and x - m and
 * exp(x - m) are the same bits for either), and one running max was a chain of n dependent
 * compares: as long as the scores' dot products at a prefill's 200 keys. */
static inline float max_of(const float *p, int64_t n) {
    v16f m16 = (v16f){0} - INFINITY;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const v16f x = load16(p + t);
        const v16i up = x > m16;
        m16 = (v16f)((up & (v16i)x) | (~up & (v16i)m16));
    }
    float lanes[16], m = -INFINITY;
    memcpy(lanes, &m16, sizeof lanes);
    for (int l = 0; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; t < n; t++) m = p[t] > m ? p[t] : m;
    return m;
}

/* In place: p[0..n) = exp(p - max p), returning their sum (sum_exact): a softmax's numerator
 * and denominator. A NaN anywhere makes the sum NaN (the max skips it, exp keeps it). */
static float softmax_parts(float *restrict p, int64_t n) {
    const float m = max_of(p, n);
    const v16f mv = (v16f){0} + m;
    for (int64_t t = 0; t < n; t += 16) store16_n(p + t, exp16(xload16(p, t, n) - mv), n - t);
    return sum_exact(p, n);
}

/* ---- attention ------------------------------------------------------------------------------
 * One query head against keys [0, seen) of its KV head: s_t = (sum_i q_i k_ti, i in order) *
 * scale, p = exp(s - max), out = (sum_t p_t v_t, t in order) * (1 / sum p). The score's sum
 * goes over i one term at a time, 16 keys side by side in a v16f's lanes: the keys come
 * transposed (kt: row i holds component i of every key, `ld` apart), made once per call for
 * all the heads and queries that share them. The same function for a decode step and for
 * every query of a prefill, so a position's bits are the same however it was computed (a
 * request recovered by prefilling what it had decoded gives the same text).
 *
 * NQ (1..4) query heads of one KV head at one position go together (q's d apart, outs dv
 * apart, scores lp apart in p: scratch of keys_ld(seen) floats each): each head's arithmetic
 * is the one above, in the same order, and each key and value is read once for all of them.
 * Why: at a prefill's few hundred keys a head's keys and values (~240 KB at d = 128) no
 * longer fit L1, and reading them from L2 once per query head was what attention waited on. */
/* 64 keys (values) at a time where the registers hold them: NQ x 4 sums of 16 lanes are 16
 * of AVX-512's 32 registers, but 32 of AVX2's 16 (spilled and reloaded every step: a 512-token
 * prefill spent 40% of its time in attention); elsewhere 16 at a time. Each key's (value's)
 * sum runs over i (t) in order either way: the blocking changes no bit. */
#if defined(__AVX512F__)
#define ATT_WIDE 1
typedef v16f att16; /* 16 running sums: one register */
static inline att16 att16_zero(void) { return (v16f){0}; }
static inline att16 att16_load(const float *p) { return load16(p); }
static inline att16 att16_add(att16 a, att16 x, float w) { return a + x * w; }
static inline att16 att16_addmul(att16 a, att16 x, att16 y) { return a + x * y; }
static inline void att16_store(float *p, att16 a) { memcpy(p, &a, sizeof a); }
static inline att16 att16_scale(att16 a, float s) { return a * s; }
#else
#define ATT_WIDE 0
/* two halves of 8: gcc keeps a 64-byte vector on the stack where the ISA's are narrower */
typedef struct { v8f l, h; } att16;
static inline att16 att16_zero(void) { return (att16){{0}, {0}}; }
static inline att16 att16_load(const float *p) {
    att16 a;
    memcpy(&a.l, p, sizeof a.l);
    memcpy(&a.h, p + 8, sizeof a.h);
    return a;
}
static inline att16 att16_add(att16 a, att16 x, float w) { return (att16){a.l + x.l * w, a.h + x.h * w}; }
static inline att16 att16_addmul(att16 a, att16 x, att16 y) { return (att16){a.l + x.l * y.l, a.h + x.h * y.h}; }
static inline void att16_store(float *p, att16 a) {
    memcpy(p, &a.l, sizeof a.l);
    memcpy(p + 8, &a.h, sizeof a.h);
}
static inline att16 att16_scale(att16 a, float s) { return (att16){a.l * s, a.h * s}; }
#endif
/* out[j] (dv, ldo apart) = (sum_t p[j][t] v[t], t in order) * inv[j] for NQ (1..4) rows of
 * probabilities (lp apart), the values from column c0 on (those before it already summed)
 * 16 at a time, then one by one: attention's and MLA's end, each v row read once for all */
static inline __attribute__((always_inline)) void att_values(
    const int NQ, const float *restrict v, int64_t dv, int64_t c0, const float *restrict p,
    int64_t lp, int64_t seen, const float *inv, float *restrict out, int64_t ldo) {
    int64_t c = c0;
    for (; c + 16 <= dv; c += 16) {
        att16 a[4];
        for (int j = 0; j < NQ; j++) a[j] = att16_zero();
        for (int64_t t = 0; t < seen; t++) {
            const att16 vt = att16_load(v + t * dv + c);
            for (int j = 0; j < NQ; j++) a[j] = att16_add(a[j], vt, p[j * lp + t]);
        }
        for (int j = 0; j < NQ; j++) att16_store(out + j * ldo + c, a[j]);
    }
    for (; c < dv; c++)
        for (int j = 0; j < NQ; j++) {
            float a = 0.0f;
            for (int64_t t = 0; t < seen; t++) a = a + p[j * lp + t] * v[t * dv + c];
            out[j * ldo + c] = a;
        }
    for (int j = 0; j < NQ; j++)
        for (c = 0; c < dv; c++) out[j * ldo + c] = out[j * ldo + c] * inv[j];
}

/* 64 floats from p as four vectors (an initializer: they stay in registers) */
#define LOAD64(p) {load16(p), load16((p) + 16), load16((p) + 32), load16((p) + 48)}

/* a[b] = a[b] + x[b] * w, b < 4: four running sums side by side, one step each */
static inline __attribute__((always_inline)) void add64(v16f *a, const v16f *x, float w) {
    for (int b = 0; b < 4; b++) a[b] = a[b] + x[b] * w;
}

static inline __attribute__((always_inline)) void attend_nq(
    const int NQ, const float *restrict q, const float *restrict kt, int64_t ld,
    const float *restrict vh, int64_t seen, int64_t d, int64_t dv, float scale,
    float *restrict p, int64_t lp, float *restrict out) {
    int64_t t0 = 0;
    /* 64 keys at a time where 4 blocks of 16 start before `seen` (rows are ld >= seen
     * rounded up to 16 long): four sums side by side, each key's still over i in order.
     * Why: one block's sum is a chain of d dependent adds (~3 cycles each) */
    for (; ATT_WIDE && t0 + 48 < seen; t0 += 64) {
        v16f a[4][4];
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < 4; b++) a[j][b] = (v16f){0};
        for (int64_t i = 0; i < d; i++) {
            const v16f k[4] = LOAD64(kt + i * ld + t0);
            for (int j = 0; j < NQ; j++) add64(a[j], k, q[j * d + i]);
        }
        /* whole vectors into p, past `seen` too: p holds keys_ld(seen) >= t0 + 64 floats */
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < 4; b++) {
                const v16f sc = a[j][b] * scale;
                memcpy(p + j * lp + t0 + 16 * b, &sc, sizeof sc);
            }
    }
    for (; t0 < seen; t0 += 16) {
        att16 a[4];
        for (int j = 0; j < NQ; j++) a[j] = att16_zero();
        for (int64_t i = 0; i < d; i++) {
            const att16 k = att16_load(kt + i * ld + t0);
            for (int j = 0; j < NQ; j++) a[j] = att16_add(a[j], k, q[j * d + i]);
        }
        for (int j = 0; j < NQ; j++) att16_store(p + j * lp + t0, att16_scale(a[j], scale));
    }
    float inv[4];
    for (int j = 0; j < NQ; j++) inv[j] = 1.0f / softmax_parts(p + j * lp, seen);
    /* the values: 64 at a time in four registers a head, each summed over t in order (the
     * bits of one running sum per value; a sum kept in `out` went through memory every t) */
    int64_t c = 0;
    for (; ATT_WIDE && c + 64 <= dv; c += 64) {
        v16f a[4][4];
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < 4; b++) a[j][b] = (v16f){0};
        for (int64_t t = 0; t < seen; t++) {
            const v16f v[4] = LOAD64(vh + t * dv + c);
            for (int j = 0; j < NQ; j++) add64(a[j], v, p[j * lp + t]);
        }
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < 4; b++) memcpy(out + j * dv + c + 16 * b, &a[j][b], sizeof(v16f));
    }
    att_values(NQ, vh, dv, c, p, lp, seen, inv, out, dv);
}

/* nq query heads of one KV head at one position, four at a time (attend_nq) */
static void attend_heads(const float *q, int64_t nq, const float *kt, int64_t ld, const float *vh,
                         int64_t seen, int64_t d, int64_t dv, float scale, float *p, int64_t lp,
                         float *out) {
    for (int64_t j = 0; j < nq; j += 4) {
        const float *qj = q + j * d;
        float *oj = out + j * dv;
        switch (nq - j < 4 ? nq - j : 4) {
        case 1: attend_nq(1, qj, kt, ld, vh, seen, d, dv, scale, p, lp, oj); break;
        case 2: attend_nq(2, qj, kt, ld, vh, seen, d, dv, scale, p, lp, oj); break;
        case 3: attend_nq(3, qj, kt, ld, vh, seen, d, dv, scale, p, lp, oj); break;
        default: attend_nq(4, qj, kt, ld, vh, seen, d, dv, scale, p, lp, oj); break;
        }
    }
}

/* The keys' cache layout (kv_cache.py: "kt"): per KV head, component-major, (d, ld) with ld
 * the cache's capacity rounded up to 16 (attention reads 16 keys a vector), and to an odd
 * number of 16s: attention reads a block of keys from d rows ld apart, and at a power-of-two
 * capacity those rows all fell in the same few sets of the L1 cache and evicted each other
 * (a prefill's attention at a 512-token capacity took 23% longer, at 2048 61%). */
static inline int64_t keys_ld(int64_t cap) { return ((cap + 15) / 16 | 1) * 16; }

/* q (t, n_heads, d); keys kt (n_kv, d, ldk) and values v (n_kv, cap, dv) with s_len tokens
 * filled, the t new ones last; out (t, n_heads, dv). Query i sees the first s_len - t + i + 1
 * keys. Query heads n_heads / n_kv at a time share a KV head (grouped-query attention). */
void cs_attend(const float *q, int64_t t, const float *kt, int64_t ldk, const float *v,
               int64_t cap, int64_t n_heads, int64_t n_kv, int64_t s_len, int64_t d, int64_t dv,
               float scale, float *out) {
    const int64_t g = n_heads / n_kv, jobs = t * n_kv, lp = keys_ld(s_len);
    const int use = gov_threads_for(t * n_heads * s_len * d);
#pragma omp parallel num_threads(use) if (use > 1)
    {
        float *p = (float *)malloc(sizeof(float) * (size_t)(4 * lp));
        /* (query, KV head) pairs: the query heads that share a KV head together on one
         * thread (attend_heads), its keys and values read once for them */
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < jobs; j++) {
            const int64_t i = j / n_kv, kvh = j % n_kv, h = kvh * g;
            attend_heads(q + (i * n_heads + h) * d, g, kt + kvh * d * ldk, ldk, v + kvh * cap * dv,
                         s_len - t + i + 1, d, dv, scale, p, lp, out + (i * n_heads + h) * dv);
        }
        free(p);
    }
}

/* One new token: q (H, D) against the s_len cached ones (kt as the cache keeps it) */
static void attend1(const float *restrict q, const float *restrict kt, const float *restrict v,
                    int64_t n_heads, int64_t n_kv, int64_t cap, int64_t s_len, int64_t d,
                    float scale, float *restrict out) {
    cs_attend(q, 1, kt, keys_ld(cap), v, cap, n_heads, n_kv, s_len, d, d, scale, out);
}


/* softmax over each of `rows` rows of n, in place (a router's, the sampler's) */
void cs_softmax_rows(float *x, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        float *p = x + r * n;
        const float inv = 1.0f / softmax_parts(p, n);
        for (int64_t i = 0; i < n; i++) p[i] = p[i] * inv;
    }
}

/* out = 1 / (1 + exp(-x)), elementwise (a router's sigmoid) */
void cs_sigmoid(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i += 16)
        store16_n(out + i, 1.0f / (1.0f + exp16(-xload16(x, i, n))), n - i);
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

/* RMSNorm: the sum of squares as dot_exact sums, sqrt and division correctly rounded */
static void rms(const float *x, const float *w, int64_t n, float eps, float *out) {
    const float inv = 1.0f / sqrtf(dot_exact(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

/* rms for `rows` rows of n (a prefill's, or per head: QK-norm), rows over the threads */
void cs_rms_rows(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out) {
    const int use = gov_threads_for(rows * n);
#pragma omp parallel for num_threads(use) if (use > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) rms(x + r * n, w, n, eps, out + r * n);
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
    cs_threads_set = n;
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

int cs_max_batch(void) { return MAX_BATCH; }

#include "kv.c"
#include "deepseek.c"
#include "llama.c"
