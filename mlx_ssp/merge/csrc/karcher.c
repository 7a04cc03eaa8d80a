/* mergekit's karcher in bf16 (mlx_ssp/merge/sphere_means.py: karcher_parts), one pass per
 * function over whole flat tensors: the same values, operation for operation, as the MLX kernels
 * there (_kar_mean0 / _kar_mean_more, _normalised / _products, _kar_tsq, _kar_step, _kar_out), each
 * bf16 rounding at the same place (rb), the norms' squares in torch's lane order (common.h) and the
 * dots in float64. Held values (unit vectors, mean, tangent) are bf16 bits. */
#include "common.h"

/* The first pass: the unit vectors u_i = rb(x_i / ns_i) and the first mean
 * m = rb(al_0 u_0), then m = rb(m + rb(al_i u_i)) for each further input, both written; returns the
 * sum of the held mean's squares (torch's order, ``block``). */
float mlx_ssp_kar_first(const uint16_t *const *xs, int k, int64_t n, const float *ns, const float *al,
                        uint16_t *const *units, uint16_t *mean, int block) {
    lanes_t L;
    float m[BLK];
    lanes_init(&L, n, block);
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int i = 0; i < k; i++) {
            const uint16_t *x = xs[i] + lo;
            uint16_t *u = units[i] + lo;
            float d = ns[i], a = al[i];
            if (i == 0) {
                for (int64_t c = 0; c < len; c++) {
                    float v = rb(bf(x[c]) / d);
                    u[c] = bf_bits(v);
                    m[c] = rb(a * v);
                }
            } else {
                for (int64_t c = 0; c < len; c++) {
                    float v = rb(bf(x[c]) / d);
                    u[c] = bf_bits(v);
                    m[c] = rb(m[c] + rb(a * v));
                }
            }
        }
        hold_squares(mean + lo, m, len, 0);
        lanes_add(&L, lo, m, len);
    }
    return lanes_result(&L);
}

/* the held mean's ``len`` elements divided by p: m = rb(m / p), into ``m`` (float32) and back into
 * the mean */
static void normalised(uint16_t *mean, int64_t len, float p, float *m) {
    for (int64_t c = 0; c < len; c++) {
        m[c] = rb(bf(mean[c]) / p);
        mean[c] = bf_bits(m[c]);
    }
}

/* The dots' pass: the held mean divided by its pending norm first (``pending``: m = rb(m / p),
 * written back), then sums[i] = sum of the float32 products m * u_i, in float64. Returns 0, or -1
 * (nothing done) where memory for the sums' lanes could not be had. */
int mlx_ssp_kar_dots(uint16_t *mean, const uint16_t *const *us, int k, int64_t n, int pending, float p,
                      double *sums) {
    double (*acc)[DLANES] = calloc((size_t)k, sizeof *acc);
    float m[BLK], t[BLK];
    if (!acc)
        return -1;
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        if (pending) {
            normalised(mean + lo, len, p, m);
        } else {
            for (int64_t c = 0; c < len; c++)
                m[c] = bf(mean[lo + c]);
        }
        for (int i = 0; i < k; i++) {
            const uint16_t *u = us[i] + lo;
            for (int64_t c = 0; c < len; c++)
                t[c] = m[c] * bf(u[c]);
            dsum_add(acc[i], t, len);
        }
    }
    dsums_finish(acc, k, sums);
    return 0;
}


/* The tangent at the held (normalised) mean: step_i = rb(c_i rb(u_i - rb(d_i m))), tg = step_0,
 * then tg = rb(tg + step_i); written; returns the sum of its squares (torch's order, ``block``). */
float mlx_ssp_kar_tangent(const uint16_t *mean, const uint16_t *const *us, int k, int64_t n, const float *d,
                          const float *cf, uint16_t *tangent, int block) {
    lanes_t L;
    float m[BLK], g[BLK];
    lanes_init(&L, n, block);
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int64_t c = 0; c < len; c++)
            m[c] = bf(mean[lo + c]);
        for (int i = 0; i < k; i++) {
            const uint16_t *u = us[i] + lo;
            float di = d[i], ci = cf[i];
            if (i == 0) {
                for (int64_t c = 0; c < len; c++)
                    g[c] = rb(ci * rb(bf(u[c]) - rb(di * m[c])));
            } else {
                for (int64_t c = 0; c < len; c++)
                    g[c] = rb(g[c] + rb(ci * rb(bf(u[c]) - rb(di * m[c]))));
            }
        }
        hold_squares(tangent + lo, g, len, 0);
        lanes_add(&L, lo, g, len);
    }
    return lanes_result(&L);
}

/* The step to the next mean, m = rb(rb(cs m) + rb(sn rb(tg / tn))), written in place; returns the
 * sum of its squares (torch's order, ``block``). */
float mlx_ssp_kar_step(uint16_t *mean, const uint16_t *tangent, int64_t n, float tn, float cs, float sn,
                       int block) {
    lanes_t L;
    float m[BLK];
    lanes_init(&L, n, block);
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        for (int64_t c = 0; c < len; c++)
            m[c] = rb(rb(cs * bf(mean[lo + c])) + rb(sn * rb(bf(tangent[lo + c]) / tn)));
        hold_squares(mean + lo, m, len, 0);
        lanes_add(&L, lo, m, len);
    }
    return lanes_result(&L);
}

/* The output rb(sc m) (the held mean divided by its pending norm first: m = rb(m / p)), as bf16
 * bits (``out_f32`` 0; may be the mean itself) or float32. */
void mlx_ssp_kar_out(const uint16_t *mean, int64_t n, int pending, float p, float sc, void *out, int out_f32) {
    for (int64_t lo = 0; lo < n; lo += BLK) {
        int64_t len = n - lo < BLK ? n - lo : BLK;
        float r[BLK];
        if (pending) {
            for (int64_t c = 0; c < len; c++)
                r[c] = rb(sc * rb(bf(mean[lo + c]) / p));
        } else {
            for (int64_t c = 0; c < len; c++)
                r[c] = rb(sc * bf(mean[lo + c]));
        }
        if (out_f32)
            memcpy((float *)out + lo, r, (size_t)len * 4);
        else
            for (int64_t c = 0; c < len; c++)
                ((uint16_t *)out)[lo + c] = bf_bits(r[c]);
    }
}
