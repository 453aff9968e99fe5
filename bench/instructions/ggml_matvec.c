/* llama.cpp's CPU matrix-vector product, measured under callgrind (bench/instructions.py):
 * ggml_matvec GGML_TYPE [gemv]: a 2048 x 2048 matrix quantized by ggml itself (an imatrix of
 * ones where the type needs one), one thread; the activation row quantized to the type's
 * vec_dot_type inside the measured part, as ggml's mul_mat does once per matmul. With
 * `gemv`: the AVX2 repacked 8-row kernel llama.cpp uses for Q4_0, Q4_K and IQ4_NL (its
 * instruction count does not depend on the bytes, so the row-major bytes stand in). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"
#include <valgrind/callgrind.h>
void ggml_gemv_q4_0_8x8_q8_0(int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K(int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc);
void ggml_gemv_iq4_nl_8x8_q8_0(int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc);
#define N 2048
int main(int argc, char **argv) {
    enum ggml_type t = (enum ggml_type)atoi(argv[1]);
    int gemv = argc > 2;
    ggml_cpu_init();
    float *w = malloc(sizeof(float) * N * N), *x = malloc(sizeof(float) * N), out[N];
    srand(1);
    for (long i = 0; i < (long)N * N; i++) w[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int i = 0; i < N; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    size_t rs = ggml_row_size(t, N);
    void *q = malloc(rs * N);
    float *imat = malloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) imat[i] = 1.0f;
    ggml_quantize_init(t);
    ggml_quantize_chunk(t, w, q, 0, N, N, ggml_quantize_requires_imatrix(t) ? imat : NULL);
    const struct ggml_type_traits_cpu *tr = ggml_get_type_traits_cpu(t);
    enum ggml_type vt = tr->vec_dot_type;
    void *xq = malloc(ggml_row_size(vt, N) + 64);
    CALLGRIND_START_INSTRUMENTATION;
    ggml_get_type_traits_cpu(vt)->from_float(x, xq, N);
    if (!gemv) {
        for (int r = 0; r < N; r++) tr->vec_dot(N, &out[r], 0, (char *)q + r * rs, 0, xq, 0, 1);
    } else if (t == GGML_TYPE_Q4_0) {
        ggml_gemv_q4_0_8x8_q8_0(N, out, 0, q, xq, 1, N);
    } else if (t == GGML_TYPE_Q4_K) {
        ggml_gemv_q4_K_8x8_q8_K(N, out, 0, q, xq, 1, N);
    } else {
        ggml_gemv_iq4_nl_8x8_q8_0(N, out, 0, q, xq, 1, N);
    }
    CALLGRIND_STOP_INSTRUMENTATION;
    printf("%s %g\n", ggml_type_name(t), out[7]);
    return 0;
}
