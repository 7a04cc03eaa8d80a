// @kernel inputs=logits,targets,inv_temp,lse,cotan outputs=dlogits template=T,V,TG,M header=ssp_metal.h
//
// Fused selective log-softmax, backward (Metal kernel body for mx.fast.metal_kernel).
// One threadgroup of TG threads per row; grid = (TG * n, 1, 1); M contiguous elements per thread.
// With p_j = exp(logits[i, j] * inv_temp - lse[i]) (lse saved by the forward kernel, so one pass):
//   dlogits[i, j] = (p_j - [j == targets[i]]) * (-cotan[i] * inv_temp)
// i.e. cotan * (onehot - softmax(logits / T)) / T, computed in float32 and cast to T.
// No reduction, no threadgroup memory. Rows with cotan == 0 (masked tokens) get exact zeros.
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_index_in_threadgroup;
const float it = static_cast<float>(inv_temp[0]);
const float l = static_cast<float>(lse[row]);
const float scale = -static_cast<float>(cotan[row]) * it;
const int t = metal::clamp(int(targets[row]), 0, V - 1);
auto x = logits + ulong(row) * ulong(V);
auto dx = dlogits + ulong(row) * ulong(V);

for (int base = int(tid) * M; base < V; base += TG * M) {
  for (int j = 0; j < M; ++j) {
    int k = base + j;
    if (k < V) {
      float p = metal::exp(static_cast<float>(x[k]) * it - l);
      float onehot = (k == t) ? 1.0f : 0.0f;
      dx[k] = static_cast<T>((p - onehot) * scale);
    }
  }
}
