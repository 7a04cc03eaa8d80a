/* mergekit's model_stock in bf16 (mlx_ssp/merge/interpolate.py: model_stock_parts), of the whole
 * tensor (one row) or of each row of ``width`` elements (filter_wise): the same values, operation
 * for operation, as the MLX kernels there (_ms_terms, _ms_combine), each bf16 rounding at the same
 * place (rb), the offsets' squares in torch's lane order per row (common.h) and the pairs' dots in
 * float64. k (the models besides the base) is at most MS_MAX_MODELS. */
#include "common.h"

#define MS_MAX_MODELS 8

int mlx_ssp_ms_max_models(void) { return MS_MAX_MODELS; }

/* One pass for both sums, per row: sq[r * k + i] the sum of the squares of the offset
 * o_i = rb(x_i - b) (torch's norm order, ``block``) and dots[r * npairs + p] the float64 sum of the
 * rounded products rb(o_i o_j) of pair p (i < j, in order). Returns -1 (nothing done) for too many
 * models. */
int mlx_ssp_ms_sums(const uint16_t *base, const uint16_t *const *xs, int k, int64_t rows, int64_t width, int block,
                    float *sq, double *dots) {
    if (k < 1 || k > MS_MAX_MODELS)
        return -1;
    int npairs = k * (k - 1) / 2;
    float o[MS_MAX_MODELS][BLK], t[BLK];
    for (int64_t r = 0; r < rows; r++) {
        lanes_t L[MS_MAX_MODELS];
        double acc[MS_MAX_MODELS * (MS_MAX_MODELS - 1) / 2][DLANES];
        const int64_t at = r * width;
        for (int i = 0; i < k; i++)
            lanes_init(&L[i], width, block);
        memset(acc, 0, sizeof acc);
        for (int64_t lo = 0; lo < width; lo += BLK) {
            int64_t len = width - lo < BLK ? width - lo : BLK;
            const uint16_t *b = base + at + lo;
            for (int i = 0; i < k; i++) {
                const uint16_t *x = xs[i] + at + lo;
                for (int64_t c = 0; c < len; c++) {
                    o[i][c] = rb(bf(x[c]) - bf(b[c]));
                    t[c] = o[i][c] * o[i][c];
                }
                lanes_add(&L[i], lo, t, len);
            }
            for (int i = 0, p = 0; i < k; i++)
                for (int j = i + 1; j < k; j++, p++) {
                    for (int64_t c = 0; c < len; c++)
                        t[c] = rb(o[i][c] * o[j][c]);
                    dsum_add(acc[p], t, len);
                }
        }
        for (int i = 0; i < k; i++)
            sq[r * k + i] = lanes_result(&L[i]);
        for (int p = 0; p < npairs; p++)
            dots[r * npairs + p] = dsum_result(acc[p]);
    }
    return 0;
}

/* Per row (ratio t[r]): rb(rb(t avg) + rb(rb(1 - t) b)), avg = rb(total / k) with total = x_0, then
 * total = rb(total + x_i); as bf16 bits (``out_f32`` 0) or float32. */
void mlx_ssp_ms_combine(const uint16_t *base, const uint16_t *const *xs, int k, int64_t rows, int64_t width,
                        const float *t, void *out, int out_f32) {
    float v[BLK];
    const float kf = (float)k;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * width;
        const float tr = t[r], omt = rb(1.0f - tr);
        for (int64_t lo = 0; lo < width; lo += BLK) {
            int64_t len = width - lo < BLK ? width - lo : BLK;
            for (int64_t c = 0; c < len; c++)
                v[c] = bf(xs[0][at + lo + c]);
            for (int i = 1; i < k; i++) {
                const uint16_t *x = xs[i] + at + lo;
                for (int64_t c = 0; c < len; c++)
                    v[c] = rb(v[c] + bf(x[c]));
            }
            const uint16_t *b = base + at + lo;
            for (int64_t c = 0; c < len; c++)
                v[c] = rb(rb(tr * rb(v[c] / kf)) + rb(omt * bf(b[c])));
            if (out_f32)
                memcpy((float *)out + at + lo, v, (size_t)len * 4);
            else
                for (int64_t c = 0; c < len; c++)
                    ((uint16_t *)out)[at + lo + c] = bf_bits(v[c]);
        }
    }
}
