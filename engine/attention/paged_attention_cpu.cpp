// The CPU kernel of augur::paged_attention (the op and its arguments: engine/attention/sdpa.py).
//
// Built on first use by engine/attention/cpu_kernel.py and registered for CPU tensors; the Python
// implementation in sdpa.py stays the reference and serves other devices. Two paths:
//
// - few queries per sequence (decode, draft levels, verify trees): one pass per (token, KV head)
//   reads each key and value row once for the whole query-head group, straight from the pool;
// - more (prefill chunks): the reference's gather + scaled_dot_product_attention, in ATen calls.
//
// Either way it runs without returning to Python: a compiled forward calls it once per layer, and
// for a small model the Python implementation's interpreter and dispatch cost more than its maths.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Above this many query rows per sequence the gathered SDPA path (blocked GEMMs) is faster.
constexpr int64_t kMaxFusedQueries = 32;

template <typename scalar_t>
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  // src [T, Hkv, D] (rows may be strided, e.g. a split of the fused QKV output); cache [S, Hkv, D].
  const int64_t T = src.size(0), Hkv = src.size(1), D = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  const scalar_t* in = src.data_ptr<scalar_t>();
  scalar_t* out = cache.data_ptr<scalar_t>();
  for (int64_t t = 0; t < T; ++t) {
    scalar_t* dst = out + slots[t] * Hkv * D;
    for (int64_t h = 0; h < Hkv; ++h) {
      const scalar_t* row = in + t * s0 + h * s1;
      if (s2 == 1) {
        std::memcpy(dst + h * D, row, D * sizeof(scalar_t));
      } else {
        for (int64_t d = 0; d < D; ++d) dst[h * D + d] = row[d * s2];
      }
    }
  }
}

template <typename scalar_t>
void fused_attention(const at::Tensor& q,         // [T, H, D]
                     const at::Tensor& k_cache,   // [S, Hkv, D] (contiguous)
                     const at::Tensor& v_cache,   // [S, Hkv, D]
                     const at::Tensor& kv_slots,  // [B, Kmax] int64
                     const at::Tensor& mask,      // [B, Q, Kmax] bool (contiguous)
                     const at::Tensor& q_index,   // [T] int64: token -> b * Q + i
                     double scale, double softcap, at::Tensor& out /* [T, H, D] */) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), G = H / Hkv;
  const int64_t Kmax = kv_slots.size(1), Q = mask.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t* slots_all = kv_slots.data_ptr<int64_t>();
  const bool* mask_all = mask.data_ptr<bool>();
  const int64_t* qi_all = q_index.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // One work item: a token and a KV head, i.e. the G query heads that share it. Spread over threads
  // only when there is enough of it to pay for waking them.
  const int64_t items = T * Hkv;
  const int64_t per_item = std::max<int64_t>(Kmax * G * D, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_item);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores(G * Kmax);
    std::vector<float> row_max(G), row_sum(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hkv, kvh = item % Hkv;
      const int64_t flat = qi_all[t], b = flat / Q, i = flat % Q;
      const bool* m = mask_all + (b * Q + i) * Kmax;
      const int64_t* slots = slots_all + b * Kmax;
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* src = qp + t * qs0 + (kvh * G + g) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(src[d * qs2]);
        row_max[g] = neg_inf;
      }
      // Scores: each visible key row is read once for the whole group.
      for (int64_t j = 0; j < Kmax; ++j) {
        if (!m[j]) {
          for (int64_t g = 0; g < G; ++g) scores[g * Kmax + j] = neg_inf;
          continue;
        }
        const scalar_t* key = kc + (slots[j] * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qv = qf.data() + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qv[d] * static_cast<float>(key[d]);
          float s = dot * fscale;
          if (fcap > 0.f) s = fcap * std::tanh(s / fcap);
          scores[g * Kmax + j] = s;
          row_max[g] = std::max(row_max[g], s);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        float* sg = scores.data() + g * Kmax;
        for (int64_t j = 0; j < Kmax; ++j) {
          const float e = sg[j] == neg_inf ? 0.f : std::exp(sg[j] - row_max[g]);
          sg[j] = e;
          sum += e;
        }
        row_sum[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < Kmax; ++j) {
        if (!m[j]) continue;
        const scalar_t* val = vc + (slots[j] * Hkv + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * Kmax + j];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(val[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        // Every real query sees at least its own key, so the sum is positive.
        const float inv = 1.f / row_sum[g];
        scalar_t* dst = op + (t * H + kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

// The reference's path for long query runs, in ATen: gather each sequence's keys, pad the queries.
at::Tensor gathered_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& kv_slots, const at::Tensor& mask /* [B,1,Q,Kmax] */,
                              const at::Tensor& q_index, double scale, double softcap) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = kv_slots.size(0), Q = mask.size(2), Hkv = k_cache.size(1);
  const at::Tensor flat = kv_slots.reshape({-1});
  at::Tensor keys = k_cache.index_select(0, flat).view({B, -1, Hkv, D}).transpose(1, 2);  // [B, Hkv, Kmax, D]
  at::Tensor values = v_cache.index_select(0, flat).view({B, -1, Hkv, D}).transpose(1, 2);
  at::Tensor qp = q.new_zeros({B * Q, H, D});
  qp.index_copy_(0, q_index, q);
  qp = qp.view({B, Q, H, D}).transpose(1, 2);  // [B, H, Q, D]
  at::Tensor out;
  if (softcap > 0.0) {  // grouped query heads, scores capped in float32 (as the reference does)
    at::Tensor qg = qp.reshape({B, Hkv, H / Hkv, Q, D});
    at::Tensor scores = at::matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).to(at::kFloat) * scale;
    scores = at::tanh(scores / softcap) * softcap;
    scores = scores.masked_fill(mask.unsqueeze(2).logical_not(), -std::numeric_limits<double>::infinity());
    at::Tensor probs = at::softmax(scores, -1).to(values.scalar_type());
    out = at::matmul(probs, values.unsqueeze(2)).reshape({B, H, Q, D});
  } else {
    out = at::scaled_dot_product_attention(qp, keys, values, mask, 0.0, false, scale, Hkv != H);
  }
  return out.transpose(1, 2).reshape({B * Q, H * D}).index_select(0, q_index);
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_pool,
                               int64_t layer, const at::Tensor& slot_mapping, const at::Tensor& kv_slots,
                               const at::Tensor& mask, const at::Tensor& q_index, double scale, double softcap) {
  TORCH_CHECK(kv_pool.is_contiguous(), "augur::paged_attention: the KV pool must be contiguous");
  TORCH_CHECK(k.scalar_type() == kv_pool.scalar_type() && v.scalar_type() == kv_pool.scalar_type(),
              "augur::paged_attention: new K/V and the pool must share a dtype");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor k_cache = kv_pool.select(0, layer).select(0, 0);  // [S, Hkv, D], contiguous
  at::Tensor v_cache = kv_pool.select(0, layer).select(0, 1);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv_pool.scalar_type(), "augur_kv_write", [&] {
    write_rows<scalar_t>(k, k_cache, slots.data_ptr<int64_t>());
    write_rows<scalar_t>(v, v_cache, slots.data_ptr<int64_t>());
  });
  if (T == 0) return q.new_empty({0, H * D});
  const int64_t Q = mask.size(2);
  if (Q > kMaxFusedQueries || q.scalar_type() != kv_pool.scalar_type()) {
    return gathered_attention(q, k_cache, v_cache, kv_slots, mask, q_index, scale, softcap);
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
  const at::Tensor m = mask.reshape({mask.size(0), Q, mask.size(3)}).contiguous();
  const at::Tensor ks = kv_slots.to(at::kLong).contiguous(), qi = q_index.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "augur_paged_attention", [&] {
    fused_attention<scalar_t>(q, k_cache, v_cache, ks, m, qi, scale, softcap, out);
  });
  return out.view({T, H * D});
}

}  // namespace

TORCH_LIBRARY_IMPL(augur, CPU, m) { m.impl("paged_attention", &paged_attention_cpu); }
