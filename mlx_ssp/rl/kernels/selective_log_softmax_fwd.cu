// @kernel inputs=logits,targets,inv_temp outputs=logp,lse template=T,V,TG,M header=ssp_cuda.h
//
// Fused selective log-softmax, forward (CUDA kernel body for mx.fast.cuda_kernel; the twin of
// selective_log_softmax_fwd.metal, same algorithm and outputs).
// One block of TG threads per row of logits [n, V]; grid = (TG * n, 1, 1) threads, so blockIdx.x is the
// row (no 65535 limit). Online (max, sum of exp) per thread in float32, M contiguous elements per
// thread per block of TG * M, then block max, rescale, block sum.
//   lse[i]  = logsumexp_j(logits[i, j] * inv_temp)        (float32, kept for the backward)
//   logp[i] = logits[i, targets[i]] * inv_temp - lse[i]   (float32)
// A target outside [0, V) is clamped so the kernel never reads out of bounds.
constexpr int N_WARP = TG / 32;
__shared__ float ssp_buf[32];

const int row = blockIdx.x;
const int tid = threadIdx.x;
const int lane = tid & 31;
const int warp = tid >> 5;
const float it = static_cast<float>(inv_temp[0]);
const T* x = logits + static_cast<long long>(row) * V;

float m = SSP_NEG_BIG;
float s = 0.0f;
for (int base = tid * M; base < V; base += TG * M) {
  float v[M];
  float bm = m;
#pragma unroll
  for (int j = 0; j < M; ++j) {
    int k = base + j;
    v[j] = (k < V) ? static_cast<float>(x[k]) * it : SSP_NEG_BIG;
    bm = fmaxf(bm, v[j]);
  }
  s *= expf(m - bm);
#pragma unroll
  for (int j = 0; j < M; ++j) {
    if (base + j < V) {
      s += expf(v[j] - bm);
    }
  }
  m = bm;
}

const float gm = ssp_block_max<N_WARP>(m, ssp_buf, lane, warp);
const float gs = ssp_block_sum<N_WARP>(s * expf(m - gm), ssp_buf, lane, warp);

if (tid == 0) {
  const int t = min(max(static_cast<int>(targets[row]), 0), V - 1);
  const float l = gm + logf(gs);
  lse[row] = l;
  logp[row] = static_cast<float>(x[t]) * it - l;
}
