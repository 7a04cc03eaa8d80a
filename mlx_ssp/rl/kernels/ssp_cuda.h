// mlx_ssp: helpers shared by the CUDA kernels. Passed as the `header` of mx.fast.cuda_kernel, so it
// is compiled after mlx's device utils (cuda_bf16 / cuda_fp16, cooperative_groups) and before the
// generated kernel.
//
// Block reductions for TG = 32 * N_WARP threads (1 <= N_WARP <= 32): a warp shuffle reduction, one
// float per warp through shared memory, then a second warp reduction. Every thread of the block must
// call them (they contain barriers) and every thread gets the result. The trailing barrier lets the
// caller reuse `buf` for the next reduction.

#define SSP_NEG_BIG (-3.0e38f)

template <int N_WARP>
__device__ __forceinline__ float ssp_block_max(float v, float* buf, int lane, int warp) {
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  if (lane == 0) {
    buf[warp] = v;
  }
  __syncthreads();
  v = (lane < N_WARP) ? buf[lane] : SSP_NEG_BIG;
  __syncthreads();
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

template <int N_WARP>
__device__ __forceinline__ float ssp_block_sum(float v, float* buf, int lane, int warp) {
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  if (lane == 0) {
    buf[warp] = v;
  }
  __syncthreads();
  v = (lane < N_WARP) ? buf[lane] : 0.0f;
  __syncthreads();
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// D_ME(p || 0.5) = p ln(2p) + (1 - p) ln(2(1 - p)), with 0 ln 0 = 0 (VibeThinker-1.5B, section 3.4).
__device__ __forceinline__ float ssp_dme(float p) {
  float a = (p > 0.0f) ? p * logf(2.0f * p) : 0.0f;
  float b = (p < 1.0f) ? (1.0f - p) * logf(2.0f * (1.0f - p)) : 0.0f;
  return a + b;
}
