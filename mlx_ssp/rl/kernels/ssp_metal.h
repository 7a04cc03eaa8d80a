// mlx_ssp: helpers shared by the Metal kernels. Passed as the `header` of mx.fast.metal_kernel, so it
// is compiled after mlx's own Metal utils (metal_stdlib, bfloat16_t) and before the generated kernel.
//
// Threadgroup reductions for TG = 32 * N_SIMD threads (1 <= N_SIMD <= 32): a SIMD-group reduction,
// one float per SIMD group through threadgroup memory, then a second SIMD-group reduction. Every
// thread of the threadgroup must call them (they contain barriers) and every thread gets the result.
// The trailing barrier lets the caller reuse `buf` for the next reduction.

#define SSP_NEG_BIG (-3.0e38f)

template <int N_SIMD>
inline float ssp_tg_max(float v, threadgroup float* buf, uint lane, uint sg) {
  v = metal::simd_max(v);
  if (lane == 0) {
    buf[sg] = v;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  v = (lane < uint(N_SIMD)) ? buf[lane] : SSP_NEG_BIG;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return metal::simd_max(v);
}

template <int N_SIMD>
inline float ssp_tg_sum(float v, threadgroup float* buf, uint lane, uint sg) {
  v = metal::simd_sum(v);
  if (lane == 0) {
    buf[sg] = v;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  v = (lane < uint(N_SIMD)) ? buf[lane] : 0.0f;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  return metal::simd_sum(v);
}

// D_ME(p || 0.5) = p ln(2p) + (1 - p) ln(2(1 - p)), with 0 ln 0 = 0 (VibeThinker-1.5B, section 3.4).
inline float ssp_dme(float p) {
  float a = (p > 0.0f) ? p * metal::log(2.0f * p) : 0.0f;
  float b = (p < 1.0f) ? (1.0f - p) * metal::log(2.0f * (1.0f - p)) : 0.0f;
  return a + b;
}
