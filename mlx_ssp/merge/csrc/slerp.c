/* mergekit's nuslerp in bf16 (mlx_ssp/merge/slerp.py: nuslerp_parts), of the whole tensor (one
 * row of ``n`` elements) or of each row of ``width`` elements: the same values, operation for
 * operation, as the MLX kernels there (_slerp_sq, _nus_cos, _nus_mix), each bf16 rounding at the
 * same place (rb), the norms' squares in torch's lane order per row (common.h) and the cosines'
 * sums in float64. */
#include "common.h"

/* Per row: the float64 sum of the rounded products of the unit vectors,
 * rb(rb(a / na) rb(b / nb)). */
void mlx_ssp_nus_cos(const uint16_t *a, const uint16_t *b, int64_t rows, int64_t width, const float *na,
                     const float *nb, double *sums) {
    float t[BLK];
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *ar = a + r * width, *br = b + r * width;
        float p = na[r], q = nb[r];
        double acc[DLANES] = {0};
        for (int64_t lo = 0; lo < width; lo += BLK) {
            int64_t len = width - lo < BLK ? width - lo : BLK;
            for (int64_t c = 0; c < len; c++)
                t[c] = rb(rb(bf(ar[lo + c]) / p) * rb(bf(br[lo + c]) / q));
            dsum_add(acc, t, len);
        }
        sums[r] = dsum_result(acc);
    }
}

/* Per row: where ``lin``, rb(rb(u a) + rb(t b)), else rb(rb(rb(ca a) + rb(cb b)) / s); as bf16
 * bits (``out_f32`` 0) or float32. */
void mlx_ssp_nus_mix(const uint16_t *a, const uint16_t *b, int64_t rows, int64_t width, const float *ca,
                     const float *cb, const float *s, const uint8_t *lin, float u, float t, void *out,
                     int out_f32) {
    float v[BLK];
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *ar = a + r * width, *br = b + r * width;
        float p = ca[r], q = cb[r], d = s[r];
        for (int64_t lo = 0; lo < width; lo += BLK) {
            int64_t len = width - lo < BLK ? width - lo : BLK;
            if (lin[r]) {
                for (int64_t c = 0; c < len; c++)
                    v[c] = rb(rb(u * bf(ar[lo + c])) + rb(t * bf(br[lo + c])));
            } else {
                for (int64_t c = 0; c < len; c++)
                    v[c] = rb(rb(rb(p * bf(ar[lo + c])) + rb(q * bf(br[lo + c]))) / d);
            }
            int64_t at = r * width + lo;
            if (out_f32)
                memcpy((float *)out + at, v, (size_t)len * 4);
            else
                for (int64_t c = 0; c < len; c++)
                    ((uint16_t *)out)[at + c] = bf_bits(v[c]);
        }
    }
}
