// @kernel inputs=rewards,group_ids,params,sizes outputs=adv,raw,weight,gp,gd,gw,gmean,gstd,gcount,gequal template=TG,SCALE header=ssp_cuda.h
//
// MGPO grouped advantages in one launch (CUDA twin of grouped_advantages.metal, same algorithm; the
// semantics are those of mlx_ssp.rl.mgpo.mgpo_advantages).
// rewards [N] float32, group_ids [N] int32 in [0, G), params = [lambda, eps] float32, sizes = [N, G] int32.
// One block of TG threads; grid = (TG, 1, 1).
// Pass 1, one group per thread (strided): count, mean, sample std (divisor max(count - 1, 1)),
//   all-equal flag, p = clamp(mean, 0, 1), D_ME(p || 0.5), w = exp(-lambda * D_ME) (1 for lambda = 0).
// Batch std (SCALE 2): sample std of all N rewards (two-pass block reduction).
// Pass 2, one sample per thread, after __syncthreads (global writes visible to the block):
//   raw = 0 if the group is all-equal else r - mean, / (group std + eps) (SCALE 1) or
//   / (batch std + eps) (SCALE 2); weight = w; adv = w * raw.
constexpr int N_WARP = TG / 32;
__shared__ float ssp_buf[32];

const int tid = threadIdx.x;
const int lane = tid & 31;
const int warp = tid >> 5;
const float lam = static_cast<float>(params[0]);
const float eps = static_cast<float>(params[1]);
const int N = static_cast<int>(sizes[0]);
const int G = static_cast<int>(sizes[1]);

for (int g = tid; g < G; g += TG) {
  float cnt = 0.0f;
  float sum = 0.0f;
  float lo = -SSP_NEG_BIG;
  float hi = SSP_NEG_BIG;
  for (int j = 0; j < N; ++j) {
    if (static_cast<int>(group_ids[j]) == g) {
      const float r = static_cast<float>(rewards[j]);
      cnt += 1.0f;
      sum += r;
      lo = fminf(lo, r);
      hi = fmaxf(hi, r);
    }
  }
  const float mean = sum / fmaxf(cnt, 1.0f);
  float ss = 0.0f;
  for (int j = 0; j < N; ++j) {
    if (static_cast<int>(group_ids[j]) == g) {
      const float d = static_cast<float>(rewards[j]) - mean;
      ss += d * d;
    }
  }
  const float p = fminf(fmaxf(mean, 0.0f), 1.0f);
  const float dme = ssp_dme(p);
  gcount[g] = cnt;
  gmean[g] = mean;
  gstd[g] = sqrtf(ss / fmaxf(cnt - 1.0f, 1.0f));
  gp[g] = p;
  gd[g] = dme;
  gw[g] = (lam != 0.0f) ? expf(-lam * dme) : 1.0f;
  gequal[g] = (hi <= lo) ? 1.0f : 0.0f;
}

float bstd = 0.0f;
if (SCALE == 2) {
  float acc = 0.0f;
  for (int i = tid; i < N; i += TG) {
    acc += static_cast<float>(rewards[i]);
  }
  const float bmean = ssp_block_sum<N_WARP>(acc, ssp_buf, lane, warp) / static_cast<float>(N);
  float acc2 = 0.0f;
  for (int i = tid; i < N; i += TG) {
    const float d = static_cast<float>(rewards[i]) - bmean;
    acc2 += d * d;
  }
  bstd = sqrtf(ssp_block_sum<N_WARP>(acc2, ssp_buf, lane, warp) / static_cast<float>(max(N - 1, 1)));
}

__syncthreads();

for (int i = tid; i < N; i += TG) {
  const int g = static_cast<int>(group_ids[i]);
  float a = (gequal[g] != 0.0f) ? 0.0f : static_cast<float>(rewards[i]) - gmean[g];
  if (SCALE == 1) {
    a = a / (gstd[g] + eps);
  } else if (SCALE == 2) {
    a = a / (bstd + eps);
  }
  raw[i] = a;
  weight[i] = gw[g];
  adv[i] = gw[g] * a;
}
