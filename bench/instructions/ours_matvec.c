/* cellswarm's matrix-vector product, measured under callgrind (bench/instructions.py):
 * ours_matvec FMT: kernels.c included whole (-DKERNELS="path"), a 2048 x 2048 matrix of
 * random blocks with sane f16 scales, one thread; cs_matmul_qx quantizes the activations and
 * multiplies, as a decode step does. ours_matvec FMT r16: the same matrix repacked in 16-row
 * groups as the engine repacks it at load (exit 3 where this CPU has no such layout). */
#include KERNELS
#include <stdio.h>
#include <valgrind/callgrind.h>

static uint32_t st = 12345;
static uint32_t rnd32(void) { st = st * 1664525u + 1013904223u; return st; }
static void le16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static int bbytes(int fmt) {
    switch (fmt) {
    case Q8_0: return 34; case Q4_0: return 18; case Q4_1: return 20; case Q4_K: return 144;
    case Q6_K: return 210; case Q2_K: return 84; default: return lowbit_bytes(fmt);
    }
}

int main(int argc, char **argv) {
    const int fmt = atoi(argv[1]);
    const int64_t rows = 2048, cols = 2048, n = block_elems(fmt), bb = bbytes(fmt);
    const int64_t nb = rows * (cols / n);
    uint8_t *w = malloc((size_t)(nb * bb));
    for (int64_t i = 0; i < nb * bb; i++) w[i] = (uint8_t)(rnd32() >> 24);
    for (int64_t b = 0; b < nb; b++) { /* scales of 1.0 (f16 0x3C00 / 0x1C00): no inf/NaN */
        uint8_t *blk = w + b * bb;
        if (fmt == IQ1_M) {
            const uint16_t d = 0x1C00;
            for (int k = 0; k < 4; k++)
                blk[49 + 2 * k] = (uint8_t)((blk[49 + 2 * k] & 0x0F) | ((d >> (4 * k)) & 0xF) << 4);
            continue;
        }
        if (fmt == MXFP4) { blk[0] = 121; continue; }
        if (fmt == NVFP4) continue;
        const int offs[2] = {
            fmt == Q6_K ? 208 : fmt == Q2_K ? 80 : fmt == Q3_K ? 108 : fmt == TQ1_0 ? 52 : fmt == TQ2_0 ? 64 : 0,
            fmt == Q4_1 || fmt == Q4_K || fmt == Q5_1 || fmt == Q5_K ? 2 : fmt == Q2_K ? 82 : -1};
        for (int k = 0; k < 2; k++)
            if (offs[k] >= 0) le16(blk + offs[k], 0x1C00);
    }
    float *x = malloc(sizeof(float) * cols), *out = malloc(sizeof(float) * rows);
    for (int i = 0; i < cols; i++) x[i] = (float)((int)(rnd32() >> 16) - 32768) / 32768.0f;
    int code = fmt;
    if (argc > 2) { /* the 16-row groups a loaded model reads on this CPU */
        code = cs_repacked(fmt);
        if (code < 0) return 3;
        uint8_t *r = malloc((size_t)(nb * bb));
        cs_repack(fmt, w, rows, (cols / n) * bb, r);
        free(w);
        w = r;
    }
    cs_set_threads(1);
    cs_matmul_qx(code, w, rows, (cols / n) * bb, cols, x, 1, out); /* warm: lazy tables */
    CALLGRIND_START_INSTRUMENTATION;
    cs_matmul_qx(code, w, rows, (cols / n) * bb, cols, x, 1, out);
    CALLGRIND_STOP_INSTRUMENTATION;
    printf("%d %f\n", fmt, out[0]);
    return 0;
}
