// @kernel inputs=logits,targets,inv_temp outputs=logp,lse template=T,V,TG,M header=ssp_metal.h
//
// Fused selective log-softmax, forward (Metal kernel body for mx.fast.metal_kernel).
// One threadgroup of TG threads per row of logits [n, V]; grid = (TG * n, 1, 1).
// Each thread walks the row in blocks of TG * M (M contiguous elements per thread, coalesced), keeping
// an online (max, sum of exp) pair in float32 whatever T is (float32 / float16 / bfloat16); the pairs
// are merged by a threadgroup max, a rescale and a threadgroup sum. V need not be a multiple of TG * M.
//   lse[i]  = logsumexp_j(logits[i, j] * inv_temp)                      (float32, kept for the backward)
//   logp[i] = logits[i, targets[i]] * inv_temp - lse[i]                 (float32)
// inv_temp is a 1-element float32 array (1 / temperature). A target outside [0, V) is clamped so the
// kernel never reads out of bounds (the reference is undefined there).
constexpr int N_SIMD = TG / 32;
threadgroup float ssp_buf[32];

const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const float it = static_cast<float>(inv_temp[0]);
auto x = logits + ulong(row) * ulong(V);

float m = SSP_NEG_BIG;
float s = 0.0f;
for (int base = int(tid) * M; base < V; base += TG * M) {
  float v[M];
  float bm = m;
  for (int j = 0; j < M; ++j) {
    int k = base + j;
    v[j] = (k < V) ? static_cast<float>(x[k]) * it : SSP_NEG_BIG;
    bm = metal::max(bm, v[j]);
  }
  s *= metal::exp(m - bm);
  for (int j = 0; j < M; ++j) {
    if (base + j < V) {
      s += metal::exp(v[j] - bm);
    }
  }
  m = bm;
}

const float gm = ssp_tg_max<N_SIMD>(m, ssp_buf, lane, sg);
const float gs = ssp_tg_sum<N_SIMD>(s * metal::exp(m - gm), ssp_buf, lane, sg);

if (tid == 0) {
  const int t = metal::clamp(int(targets[row]), 0, V - 1);
  const float l = gm + metal::log(gs);
  lse[row] = l;
  logp[row] = static_cast<float>(x[t]) * it - l;
}
