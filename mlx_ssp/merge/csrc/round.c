/* rb() over an array: the tests check it against kernels.round_bf16 bit for bit. */
#include "common.h"

void mlx_ssp_round_bf16(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        out[i] = rb(x[i]);
}
