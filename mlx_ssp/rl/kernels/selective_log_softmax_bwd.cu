// @kernel inputs=logits,targets,inv_temp,lse,cotan outputs=dlogits template=T,V,TG,M header=ssp_cuda.h
//
// Fused selective log-softmax, backward (CUDA twin of selective_log_softmax_bwd.metal).
// One block of TG threads per row; grid = (TG * n, 1, 1) threads; M contiguous elements per thread.
//   dlogits[i, j] = (exp(logits[i, j] * inv_temp - lse[i]) - [j == targets[i]]) * (-cotan[i] * inv_temp)
// computed in float32 and cast to T. Rows with cotan == 0 (masked tokens) get exact zeros.
const int row = blockIdx.x;
const int tid = threadIdx.x;
const float it = static_cast<float>(inv_temp[0]);
const float l = static_cast<float>(lse[row]);
const float scale = -static_cast<float>(cotan[row]) * it;
const int t = min(max(static_cast<int>(targets[row]), 0), V - 1);
const T* x = logits + static_cast<long long>(row) * V;
T* dx = dlogits + static_cast<long long>(row) * V;

for (int base = tid * M; base < V; base += TG * M) {
#pragma unroll
  for (int j = 0; j < M; ++j) {
    int k = base + j;
    if (k < V) {
      float p = expf(static_cast<float>(x[k]) * it - l);
      float onehot = (k == t) ? 1.0f : 0.0f;
      dx[k] = static_cast<T>((p - onehot) * scale);
    }
  }
}
