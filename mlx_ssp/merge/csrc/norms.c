/* Norms' squares of bf16 tensors in torch's norm order (common.h's lanes), shared by the methods'
 * passes (kernels.sums with a block: karcher, multislerp, nuslerp, model_stock). */
#include "common.h"

/* the sum of squares of a bf16 tensor in torch's norm order (a norm's square) */
float mlx_ssp_sumsq_bf16(const uint16_t *x, int64_t n, int block) {
    lanes_t L;
    float t[BLK];
    lanes_init(&L, n, block);
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int64_t c = 0; c < len; c++) {
            float v = bf(x[lo + c]);
            t[c] = v * v;
        }
        lanes_add(&L, lo, t, len);
    }
    return lanes_result(&L);
}

/* Per row of ``width`` elements: the sum of its squares in torch's norm order (``block``). */
void mlx_ssp_sumsq_rows_bf16(const uint16_t *x, int64_t rows, int64_t width, int block, float *out) {
    for (int64_t r = 0; r < rows; r++)
        out[r] = mlx_ssp_sumsq_bf16(x + r * width, width, block);
}
