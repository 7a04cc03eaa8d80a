// @kernel inputs=rewards,group_ids,params,sizes outputs=adv,raw,weight,gp,gd,gw,gmean,gstd,gcount,gequal template=TG,SCALE header=ssp_metal.h
//
// MGPO grouped advantages in one launch (Metal kernel body for mx.fast.metal_kernel); the semantics are
// those of mlx_ssp.rl.mgpo.mgpo_advantages (VibeThinker-1.5B section 3.4; GRPO; Dr.GRPO for SCALE 0).
// rewards [N] float32, group_ids [N] int32 in [0, G) (any order), params = [lambda, eps] float32,
// sizes = [N, G] int32 (runtime values: a new batch size does not compile a new kernel).
// One threadgroup of TG threads; grid = (TG, 1, 1).
// Pass 1, one group per thread (strided): scan the rewards for the group's members -> count, mean,
//   sample std (divisor max(count - 1, 1), two-pass), all-equal flag (max <= min, true for a group of
//   one or none), p = clamp(mean, 0, 1), D_ME(p || 0.5), w = exp(-lambda * D_ME) (exactly 1 for
//   lambda = 0). O(G * N / TG), no atomics, deterministic.
// Batch std (SCALE 2): sample std of all N rewards, a two-pass threadgroup reduction.
// Pass 2, one sample per thread (strided), after a device-memory barrier:
//   raw[i] = 0 if the group is all-equal else r_i - mean; / (group std + eps) (SCALE 1) or
//   / (batch std + eps) (SCALE 2); weight[i] = w; adv[i] = w * raw[i].
constexpr int N_SIMD = TG / 32;
threadgroup float ssp_buf[32];

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const float lam = static_cast<float>(params[0]);
const float eps = static_cast<float>(params[1]);
const int N = int(sizes[0]);
const int G = int(sizes[1]);

for (int g = int(tid); g < G; g += TG) {
  float cnt = 0.0f;
  float sum = 0.0f;
  float lo = -SSP_NEG_BIG;
  float hi = SSP_NEG_BIG;
  for (int j = 0; j < N; ++j) {
    if (int(group_ids[j]) == g) {
      const float r = static_cast<float>(rewards[j]);
      cnt += 1.0f;
      sum += r;
      lo = metal::min(lo, r);
      hi = metal::max(hi, r);
    }
  }
  const float mean = sum / metal::max(cnt, 1.0f);
  float ss = 0.0f;
  for (int j = 0; j < N; ++j) {
    if (int(group_ids[j]) == g) {
      const float d = static_cast<float>(rewards[j]) - mean;
      ss += d * d;
    }
  }
  const float p = metal::clamp(mean, 0.0f, 1.0f);
  const float dme = ssp_dme(p);
  gcount[g] = cnt;
  gmean[g] = mean;
  gstd[g] = metal::sqrt(ss / metal::max(cnt - 1.0f, 1.0f));
  gp[g] = p;
  gd[g] = dme;
  gw[g] = (lam != 0.0f) ? metal::exp(-lam * dme) : 1.0f;
  gequal[g] = (hi <= lo) ? 1.0f : 0.0f;
}

float bstd = 0.0f;
if (SCALE == 2) {
  float acc = 0.0f;
  for (int i = int(tid); i < N; i += TG) {
    acc += static_cast<float>(rewards[i]);
  }
  const float bmean = ssp_tg_sum<N_SIMD>(acc, ssp_buf, lane, sg) / float(N);
  float acc2 = 0.0f;
  for (int i = int(tid); i < N; i += TG) {
    const float d = static_cast<float>(rewards[i]) - bmean;
    acc2 += d * d;
  }
  bstd = metal::sqrt(ssp_tg_sum<N_SIMD>(acc2, ssp_buf, lane, sg) / float(metal::max(N - 1, 1)));
}

// the group statistics written above by other threads of this threadgroup must be visible
metal::threadgroup_barrier(metal::mem_flags::mem_device);

for (int i = int(tid); i < N; i += TG) {
  const int g = int(group_ids[i]);
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
