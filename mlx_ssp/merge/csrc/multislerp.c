/* mergekit's multislerp in bf16 (mlx_ssp/merge/sphere_means.py: multislerp_parts), one pass per
 * function over whole flat tensors: the same values, operation for operation, as the MLX kernels
 * there (_msl_first, _msl_dots, _msl_tan, _msl_out), each bf16 rounding at the same place (rb),
 * the norms' squares in torch's lane order (common.h) and the dots in float64. Held values (unit
 * vectors, mean, tangent) are bf16 bits. */
#include "common.h"

/* The first pass: the weighted mean of the unit vectors u_i = rb(x_i / dn_i),
 * rb(sum_i rb(u_i w_i)), the sum in float32 in order without rounding between adds (torch's
 * ``sum(0)`` of the rounded products), written; returns the sum of the held mean's squares
 * (torch's order, ``block``). The unit vectors are not held: the later passes make them again
 * from the inputs (the same bits; a division costs less than writing and reading them back). */
float mlx_ssp_msl_first(const uint16_t *const *xs, int k, int64_t n, const float *dn, const float *w,
                        uint16_t *mean, int block) {
    lanes_t L;
    float m[BLK];
    lanes_init(&L, n, block);
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int i = 0; i < k; i++) {
            const uint16_t *x = xs[i] + lo;
            float d = dn[i], wi = w[i];
            if (i == 0) {
                for (int64_t c = 0; c < len; c++)
                    m[c] = rb(rb(bf(x[c]) / d) * wi);
            } else {
                for (int64_t c = 0; c < len; c++)
                    m[c] = m[c] + rb(rb(bf(x[c]) / d) * wi);
            }
        }
        hold_squares(mean + lo, m, len, 1);
        lanes_add(&L, lo, m, len);
    }
    return lanes_result(&L);
}

/* The dots' pass: the held mean divided by its norm, m = rb(m / mn), written back, then
 * sums[i] = the float64 sum of the rounded products rb(u_i m), u_i = rb(x_i / dn_i). Returns 0, or
 * -1 (nothing done) where memory for the sums' lanes could not be had. */
int mlx_ssp_msl_dots(uint16_t *mean, const uint16_t *const *xs, int k, int64_t n, const float *dn, float mn,
                     double *sums) {
    double (*acc)[DLANES] = calloc((size_t)(k > 0 ? k : 1), sizeof *acc);
    float m[BLK], t[BLK];
    if (!acc)
        return -1;
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int64_t c = 0; c < len; c++) {
            m[c] = rb(bf(mean[lo + c]) / mn);
            mean[lo + c] = bf_bits(m[c]);
        }
        for (int i = 0; i < k; i++) {
            const uint16_t *x = xs[i] + lo;
            float d = dn[i];
            for (int64_t c = 0; c < len; c++)
                t[c] = rb(rb(bf(x[c]) / d) * m[c]);
            dsum_add(acc[i], t, len);
        }
    }
    dsums_finish(acc, k, sums);
    return 0;
}

/* The tangent at the held (normalised) mean: v_i = rb(rb(u_i - rb(d_i m)) w_i) with
 * u_i = rb(x_i / dn_i), summed in float32 in order without rounding between adds, then rounded:
 * written; returns the sum of its squares (torch's order, ``block``). */
float mlx_ssp_msl_tangent(const uint16_t *mean, const uint16_t *const *xs, int k, int64_t n, const float *dn,
                          const float *d, const float *w, uint16_t *tangent, int block) {
    lanes_t L;
    float m[BLK], g[BLK];
    lanes_init(&L, n, block);
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int64_t c = 0; c < len; c++)
            m[c] = bf(mean[lo + c]);
        for (int i = 0; i < k; i++) {
            const uint16_t *x = xs[i] + lo;
            float e = dn[i], di = d[i], wi = w[i];
            if (i == 0) {
                for (int64_t c = 0; c < len; c++)
                    g[c] = rb(rb(rb(bf(x[c]) / e) - rb(di * m[c])) * wi);
            } else {
                for (int64_t c = 0; c < len; c++)
                    g[c] = g[c] + rb(rb(rb(bf(x[c]) / e) - rb(di * m[c])) * wi);
            }
        }
        hold_squares(tangent + lo, g, len, 1);
        lanes_add(&L, lo, g, len);
    }
    return lanes_result(&L);
}

/* The exponential map back, scaled: rb(rb(rb(m cs) + rb(tg sn)) avg), as bf16 bits (``out_f32`` 0;
 * ``out`` may be the mean or the tangent itself) or float32. */
void mlx_ssp_msl_out(const uint16_t *mean, const uint16_t *tangent, int64_t n, float cs, float sn, float avg,
                     void *out, int out_f32) {
    float r[BLK];
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int64_t c = 0; c < len; c++)
            r[c] = rb(rb(rb(bf(mean[lo + c]) * cs) + rb(bf(tangent[lo + c]) * sn)) * avg);
        if (out_f32)
            memcpy((float *)out + lo, r, (size_t)len * 4);
        else
            for (int64_t c = 0; c < len; c++)
                ((uint16_t *)out)[lo + c] = bf_bits(r[c]);
    }
}
