/* Shared pieces of the merge's native passes (mlx_ssp/merge/native.py builds every .c file of this
 * directory into one library).
 *
 * Exactness: the passes replace MLX kernels whose output mergekit's goldens check bit for bit, so
 * every value is computed as the MLX kernel computes it: float32 operations one at a time in the
 * kernel's order (the library is built with -ffp-contract=off and without -ffast-math, so the
 * compiler neither fuses a multiply into an add nor reorders a sum), each rounding to bf16 by
 * rb() below, and every sum in the order stated beside it. */
#ifndef MLX_SSP_MERGE_COMMON_H
#define MLX_SSP_MERGE_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* elements per block of the passes: their float32 temporaries stay in L1 */
#define BLK 512

static inline uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
}

static inline float float_of(uint32_t b) {
    float x;
    memcpy(&x, &b, 4);
    return x;
}

/* a bf16 value (its bits) as float32: exact */
static inline float bf(uint16_t h) { return float_of((uint32_t)h << 16); }

/* float32 rounded to the nearest bf16, ties to even, still float32: the bits of kernels.round_bf16
 * and of MLX's cast to bf16 and back for every float32 (a NaN becomes the quiet NaN 0x7FC0, as
 * MLX's and torch's casts make it) */
static inline float rb(float x) {
    uint32_t b = bits_of(x);
    uint32_t r = (b + (0x7FFFu + ((b >> 16) & 1u))) & 0xFFFF0000u;
    return float_of(x != x ? 0x7FC00000u : r); /* a float compare and a select: no branch */
}

/* a float32 that already holds a bf16 value, as its bf16 bits */
static inline uint16_t bf_bits(float x) { return (uint16_t)(bits_of(x) >> 16); }

/* Sums of squares in the order of torch's CPU norm kernel (kernels.TORCH_LANES): over the longest
 * prefix of m = n - n % block elements, lane j (of 8) adds elements j, j + 8, ... in order; the
 * lanes are then added in order, then the elements after the prefix one by one. Blocks come in
 * order and start at multiples of 8; ``block`` is 8 or 16 (torch's vector of float32 or bf16),
 * at most MAX_BLOCK. */
#define MAX_BLOCK 64 /* the largest ``block`` (a multiple of 8) the lanes take */

typedef struct {
    float acc[8];
    float tail[MAX_BLOCK];
    int ntail;
    int64_t m;
} lanes_t;

static inline void lanes_init(lanes_t *L, int64_t n, int block) {
    memset(L, 0, sizeof *L);
    L->m = n - n % block;
}

/* the terms t[0..len) of elements lo .. lo + len - 1 */
static inline void lanes_add(lanes_t *L, int64_t lo, const float *t, int64_t len) {
    int64_t end = lo + len < L->m ? lo + len : L->m;
    for (int64_t i = lo; i + 8 <= end; i += 8)
        for (int j = 0; j < 8; j++)
            L->acc[j] += t[i - lo + j];
    for (int64_t i = lo > L->m ? lo : L->m; i < lo + len; i++)
        L->tail[L->ntail++] = t[i - lo];
}

static inline float lanes_result(const lanes_t *L) {
    float b = L->acc[0];
    for (int j = 1; j < 8; j++)
        b += L->acc[j];
    for (int i = 0; i < L->ntail; i++)
        b += L->tail[i];
    return b;
}

/* Held values: v[0..len) (bf16 values in float32; ``round`` first rounds them) written as bf16
 * bits at dst and replaced by their squares, the terms of their norm */
static inline void hold_squares(uint16_t *dst, float *v, int64_t len, int round) {
    for (int64_t c = 0; c < len; c++) {
        float x = round ? rb(v[c]) : v[c];
        dst[c] = bf_bits(x);
        v[c] = x * x;
    }
}

/* Whole-tensor sums in float64 of float32 terms (kernels._Exact: within rounding of the exact sum
 * whatever the order; here 32 lanes, so that the additions do not wait on each other, then added
 * in order) */
#define DLANES 32

static inline void dsum_add(double acc[DLANES], const float *t, int64_t len) {
    int64_t i = 0;
    for (; i + DLANES <= len; i += DLANES)
        for (int j = 0; j < DLANES; j++)
            acc[j] += (double)t[i + j];
    for (; i < len; i++)
        acc[0] += (double)t[i];
}

static inline double dsum_result(const double acc[DLANES]) {
    double s = acc[0];
    for (int j = 1; j < DLANES; j++)
        s += acc[j];
    return s;
}

/* the k sums of a pass's lanes (allocated with calloc) into sums, the lanes freed */
static inline void dsums_finish(double (*acc)[DLANES], int k, double *sums) {
    for (int i = 0; i < k; i++)
        sums[i] = dsum_result(acc[i]);
    free(acc);
}

#endif
