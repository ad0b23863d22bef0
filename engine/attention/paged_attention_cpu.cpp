// The CPU kernel of augur::paged_attention (the op and its arguments: engine/attention/sdpa.py).
//
// Built on first use by engine/attention/cpu_kernel.py and registered for CPU tensors; the Python
// implementation in sdpa.py stays the reference and serves other devices. Two paths:
//
// - few queries per sequence (decode, draft levels, verify trees): one pass per (token, KV head)
//   reads each key and value row once for the whole query-head group, straight from the pool;
// - more (prefill chunks): the reference's gather + scaled_dot_product_attention, in ATen calls;
//   augur::paged_attention_rows (the batch-invariant mode) takes the first path for every query.
//
// Either way it runs without returning to Python: a compiled forward calls it once per layer, and
// for a small model the Python implementation's interpreter and dispatch cost more than its maths.
//
// A pool of 8-bit floats (--kv-cache-dtype fp8, engine/attention/kv_dtype.py) is written as
// round(x / scale) saturated at +-448 and read as stored * scale, with the layer's scale per KV head
// (kv_scales [2, Hkv]; none: 1.0), bit for bit as the Python implementation computes them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Above this many query rows per sequence the gathered SDPA path (blocked GEMMs) is faster.
constexpr int64_t kMaxFusedQueries = 32;

using fp8_t = c10::Float8_e4m3fn;
constexpr float kFp8Max = 448.f;

// Every 8-bit float's value, by its bits: the read path's conversion is one load.
const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(fp8_t(static_cast<uint8_t>(b), fp8_t::from_bits()));
    return t;
  }();
  return table;
}

template <typename scalar_t, typename cache_t>
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, const float* scale /* [Hkv] or null */) {
  // src [T, Hkv, D] (rows may be strided, e.g. a split of the fused QKV output); cache [S, Hkv, D].
  const int64_t T = src.size(0), Hkv = src.size(1), D = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  const scalar_t* in = src.data_ptr<scalar_t>();
  cache_t* out = static_cast<cache_t*>(cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    cache_t* dst = out + slots[t] * Hkv * D;
    for (int64_t h = 0; h < Hkv; ++h) {
      const scalar_t* row = in + t * s0 + h * s1;
      if constexpr (std::is_same_v<cache_t, fp8_t>) {
        const float s = scale ? scale[h] : 1.f;
        for (int64_t d = 0; d < D; ++d) {
          const float x = static_cast<float>(row[d * s2]) / s;
          dst[h * D + d] = fp8_t(std::min(std::max(x, -kFp8Max), kFp8Max));
        }
      } else if (s2 == 1) {
        std::memcpy(dst + h * D, row, D * sizeof(scalar_t));
      } else {
        for (int64_t d = 0; d < D; ++d) dst[h * D + d] = row[d * s2];
      }
    }
  }
}

// exp(x) for x <= 0 in float32 arithmetic that vectorizes (the scalar libm call does not): x = k ln2 + r
// with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error ~1e-7, float32's own
// rounding), 2^k built in the exponent bits. Below -87 (2^-126) it returns 2^-126's neighbourhood
// instead of smaller numbers: nothing next to the row maximum's exp(0) = 1 in a softmax sum.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f +
                                                                         r * (0.00833333377f + r * 0.00138888892f)))));
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(float));
  return p * two_k;
}

// One work item of fused_attention: token t's G query heads against KV head kvh, over the keys its mask
// row shows. kD > 0 fixes the head size at compile time (64 and 128 are most models'): the compiler then
// keeps a head's query and output accumulator in registers and unrolls every loop over the head.
template <typename scalar_t, typename cache_t, int kD>
void attend_item(const float* qf /* [G, D], scaled */, const cache_t* kc, const cache_t* vc,
                 float k_scale, float v_scale /* an FP8 pool's, this KV head's */, const int64_t* slots,
                 const int64_t* visible, int64_t n, int64_t Hkv, int64_t kvh, int64_t G, int64_t D_runtime,
                 int64_t Kmax, float fscale, float fcap, const float* sinks /* [G] or null */,
                 float* scores /* [G, Kmax] */,
                 float* rows /* [Kmax, D] */, float* spare /* [2 * D]: the accumulators when kD == 0 */,
                 scalar_t* dst /* [G, D] */) {
  const int64_t D = kD > 0 ? kD : D_runtime;
  // The visible keys' rows in float32, once for the whole group: the score pass reads them, then
  // the values overwrite them for the output pass.
  auto gather = [&](const cache_t* cache, float scale) {
    for (int64_t jj = 0; jj < n; ++jj) {
      const cache_t* src = cache + (slots[visible[jj]] * Hkv + kvh) * D;
      float* out = rows + jj * D;
      if constexpr (std::is_same_v<cache_t, fp8_t>) {
        const uint8_t* u = reinterpret_cast<const uint8_t*>(src);
        const float* values = fp8_values().data();
        for (int64_t d = 0; d < D; ++d) out[d] = values[u[d]] * scale;
      } else if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
        const uint16_t* u = reinterpret_cast<const uint16_t*>(src);
        uint32_t* o = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<uint32_t>(u[d]) << 16;  // bfloat16 → float32
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(src[d]);
      }
    }
  };
  gather(kc, k_scale);
  for (int64_t g = 0; g < G; ++g) {
    const float* qv = qf + g * D;
    float* sg = scores + g * Kmax;
    // Four keys at a time: four independent sums, so that one key's horizontal reduction does not
    // wait for the last (the loop is bound by those reductions, not by the multiply-adds).
    int64_t jj = 0;
    for (; jj + 4 <= n; jj += 4) {
      const float* k0 = rows + jj * D;
      float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
      for (int64_t d = 0; d < D; ++d) {
        d0 += qv[d] * k0[d];
        d1 += qv[d] * k0[D + d];
        d2 += qv[d] * k0[2 * D + d];
        d3 += qv[d] * k0[3 * D + d];
      }
      sg[jj] = d0;
      sg[jj + 1] = d1;
      sg[jj + 2] = d2;
      sg[jj + 3] = d3;
    }
    for (; jj < n; ++jj) {
      const float* key = rows + jj * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qv[d] * key[d];
      sg[jj] = dot;
    }
    if (fcap > 0.f) {
      for (int64_t j = 0; j < n; ++j) sg[j] = fcap * std::tanh(sg[j] * fscale / fcap);
    }
    float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
    if (sinks) mx = std::max(mx, sinks[g]);  // the head's sink: one more logit, with no value
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const float e = exp_nonpositive(sg[j] - mx);
      sg[j] = e;
      sum += e;
    }
    if (sinks) sum += exp_nonpositive(sinks[g] - mx);
    const float inv = 1.f / sum;  // every real query sees at least its own key: the sum is positive
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  gather(vc, v_scale);
  for (int64_t g = 0; g < G; ++g) {
    // Two accumulators over alternate keys: half as long a chain of dependent multiply-adds.
    const float* pg = scores + g * Kmax;
    float acc[2 * (kD > 0 ? kD : 1)];
    float* a = kD > 0 ? acc : spare;
    for (int64_t d = 0; d < 2 * D; ++d) a[d] = 0.f;
    float* b = a + D;
    int64_t jj = 0;
    for (; jj + 2 <= n; jj += 2) {
      const float p0 = pg[jj], p1 = pg[jj + 1];
      const float* v0 = rows + jj * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        a[d] += p0 * v0[d];
        b[d] += p1 * v0[D + d];
      }
    }
    for (; jj < n; ++jj) {
      const float p = pg[jj];
      const float* val = rows + jj * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * val[d];
    }
    for (int64_t d = 0; d < D; ++d) dst[g * D + d] = static_cast<scalar_t>(a[d] + b[d]);
  }
}

template <typename scalar_t, typename cache_t>
void fused_attention(const at::Tensor& q,         // [T, H, D]
                     const at::Tensor& k_cache,   // [S, Hkv, D] (contiguous)
                     const at::Tensor& v_cache,   // [S, Hkv, D]
                     const at::Tensor& kv_slots,  // [B, Kmax] int64
                     const at::Tensor& mask,      // [B, Q, Kmax] bool (contiguous)
                     const at::Tensor& q_index,   // [T] int64: token -> b * Q + i
                     double scale, double softcap, const float* sinks /* [H] or null */,
                     const float* kv_scales /* [2, Hkv] or null */, at::Tensor& out /* [T, H, D] */) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), G = H / Hkv;
  const int64_t Kmax = kv_slots.size(1), Q = mask.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kc = static_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* vc = static_cast<const cache_t*>(v_cache.data_ptr());
  const int64_t* slots_all = kv_slots.data_ptr<int64_t>();
  const bool* mask_all = mask.data_ptr<bool>();
  const int64_t* qi_all = q_index.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  // The queries carry the softmax scale, unless a soft-cap needs the raw score.
  const float qmul = fcap > 0.f ? 1.f : fscale;

  // One work item: a token and a KV head, i.e. the G query heads that share it. Spread over threads
  // only when there is enough of it to pay for waking them.
  const int64_t items = T * Hkv;
  const int64_t per_item = std::max<int64_t>(Kmax * G * D, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_item);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores(G * Kmax), rows(Kmax * D), spare(2 * D);
    std::vector<int64_t> visible(Kmax);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hkv, kvh = item % Hkv;
      const int64_t flat = qi_all[t], b = flat / Q, i = flat % Q;
      const bool* m = mask_all + (b * Q + i) * Kmax;
      int64_t n = 0;  // the visible keys' indices, in order
      for (int64_t j = 0; j < Kmax; ++j) {
        visible[n] = j;
        n += m[j];
      }
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* src = qp + t * qs0 + (kvh * G + g) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(src[d * qs2]) * qmul;
      }
      const int64_t* slots = slots_all + b * Kmax;
      scalar_t* dst = op + (t * H + kvh * G) * D;
      auto run = [&](auto kd) {
        const float ks = kv_scales ? kv_scales[kvh] : 1.f, vs = kv_scales ? kv_scales[Hkv + kvh] : 1.f;
        attend_item<scalar_t, cache_t, decltype(kd)::value>(qf.data(), kc, vc, ks, vs, slots, visible.data(), n, Hkv,
                                                            kvh, G, D, Kmax, fscale, fcap,
                                                            sinks ? sinks + kvh * G : nullptr, scores.data(),
                                                            rows.data(), spare.data(), dst);
      };
      if (D == 64) {
        run(std::integral_constant<int, 64>{});
      } else if (D == 128) {
        run(std::integral_constant<int, 128>{});
      } else {
        run(std::integral_constant<int, 0>{});
      }
    }
  });
}

// Rows `slots` of a cache [S, Hkv, D], dequantized to `dtype` where the pool holds 8-bit floats (ATen has no
// index_select for those: the bytes are gathered), as kv_dtype.read_rows does.
at::Tensor read_rows(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& scale /* [Hkv] or undefined */,
                     at::ScalarType dtype) {
  if (cache.scalar_type() != at::kFloat8_e4m3fn) return cache.index_select(0, slots);
  at::Tensor x = cache.view(at::kByte).index_select(0, slots).view(at::kFloat8_e4m3fn).to(at::kFloat);
  if (scale.defined()) x = x * scale.view({-1, 1});
  return x.to(dtype);
}

// The reference's path for long query runs, in ATen: gather each sequence's keys, pad the queries.
at::Tensor gathered_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& kv_slots, const at::Tensor& mask /* [B,1,Q,Kmax] */,
                              const at::Tensor& q_index, double scale, double softcap,
                              const c10::optional<at::Tensor>& sinks, const at::Tensor& kv_scales) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = kv_slots.size(0), Q = mask.size(2), Hkv = k_cache.size(1);
  const at::Tensor flat = kv_slots.reshape({-1});
  const at::Tensor k_scale = kv_scales.defined() ? kv_scales.select(0, 0) : at::Tensor();
  const at::Tensor v_scale = kv_scales.defined() ? kv_scales.select(0, 1) : at::Tensor();
  at::Tensor keys = read_rows(k_cache, flat, k_scale, q.scalar_type()).view({B, -1, Hkv, D}).transpose(1, 2);
  at::Tensor values = read_rows(v_cache, flat, v_scale, q.scalar_type()).view({B, -1, Hkv, D}).transpose(1, 2);
  at::Tensor qp = q.new_zeros({B * Q, H, D});
  qp.index_copy_(0, q_index, q);
  qp = qp.view({B, Q, H, D}).transpose(1, 2);  // [B, H, Q, D]
  at::Tensor out;
  if (softcap > 0.0 || sinks.has_value()) {  // grouped query heads, scores in float32 (as the reference's)
    at::Tensor qg = qp.reshape({B, Hkv, H / Hkv, Q, D});
    at::Tensor scores = at::matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).to(at::kFloat) * scale;
    if (softcap > 0.0) scores = at::tanh(scores / softcap) * softcap;
    scores = scores.masked_fill(mask.unsqueeze(2).logical_not(), -std::numeric_limits<double>::infinity());
    at::Tensor probs;
    if (sinks.has_value()) {  // each head's sink joins its softmax, then leaves (it has no value)
      at::Tensor sink = sinks->to(at::kFloat).view({1, Hkv, H / Hkv, 1, 1}).expand({B, Hkv, H / Hkv, Q, 1});
      probs = at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, scores.size(-1));
    } else {
      probs = at::softmax(scores, -1);
    }
    probs = probs.to(values.scalar_type());
    out = at::matmul(probs, values.unsqueeze(2)).reshape({B, H, Q, D});
  } else {
    out = at::scaled_dot_product_attention(qp, keys, values, mask, 0.0, false, scale, Hkv != H);
  }
  return out.transpose(1, 2).reshape({B * Q, H * D}).index_select(0, q_index);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_pool, int64_t layer,
                     const at::Tensor& slot_mapping, const at::Tensor& kv_slots, const at::Tensor& mask,
                     const at::Tensor& q_index, double scale, double softcap,
                     const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& kv_scales_in,
                     bool rows_only) {
  TORCH_CHECK(kv_pool.is_contiguous(), "augur::paged_attention: the KV pool must be contiguous");
  const bool fp8 = kv_pool.scalar_type() == at::kFloat8_e4m3fn;
  const at::ScalarType rows_type = fp8 ? k.scalar_type() : kv_pool.scalar_type();  // what the pool's rows hold
  TORCH_CHECK(k.scalar_type() == rows_type && v.scalar_type() == rows_type,
              "augur::paged_attention: new K/V and the pool must share a dtype");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  at::Tensor k_cache = kv_pool.select(0, layer).select(0, 0);  // [S, Hkv, D], contiguous
  at::Tensor v_cache = kv_pool.select(0, layer).select(0, 1);
  const int64_t Hkv = k_cache.size(1);
  at::Tensor kv_scales;  // [2, Hkv] float32, an FP8 pool's (undefined: 1.0)
  if (fp8 && kv_scales_in.has_value()) kv_scales = kv_scales_in->to(at::kFloat).contiguous().view({2, Hkv});
  const float* scales = kv_scales.defined() ? kv_scales.data_ptr<float>() : nullptr;
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows_type, "augur_kv_write", [&] {
    if (fp8) {
      write_rows<scalar_t, fp8_t>(k, k_cache, slots.data_ptr<int64_t>(), scales);
      write_rows<scalar_t, fp8_t>(v, v_cache, slots.data_ptr<int64_t>(), scales ? scales + Hkv : nullptr);
    } else {
      write_rows<scalar_t, scalar_t>(k, k_cache, slots.data_ptr<int64_t>(), nullptr);
      write_rows<scalar_t, scalar_t>(v, v_cache, slots.data_ptr<int64_t>(), nullptr);
    }
  });
  if (T == 0) return q.new_empty({0, H * D});
  const int64_t Q = mask.size(2);
  if ((Q > kMaxFusedQueries && !rows_only) || q.scalar_type() != rows_type) {
    return gathered_attention(q, k_cache, v_cache, kv_slots, mask, q_index, scale, softcap, sinks, kv_scales);
  }
  at::Tensor sink_f;
  if (sinks.has_value()) sink_f = sinks->to(at::kFloat).contiguous();
  const float* sink_ptr = sinks.has_value() ? sink_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({T, H, D}, q.options());
  const at::Tensor m = mask.reshape({mask.size(0), Q, mask.size(3)}).contiguous();
  const at::Tensor ks = kv_slots.to(at::kLong).contiguous(), qi = q_index.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "augur_paged_attention", [&] {
    if (fp8) {
      fused_attention<scalar_t, fp8_t>(q, k_cache, v_cache, ks, m, qi, scale, softcap, sink_ptr, scales, out);
    } else {
      fused_attention<scalar_t, scalar_t>(q, k_cache, v_cache, ks, m, qi, scale, softcap, sink_ptr, nullptr, out);
    }
  });
  return out.view({T, H * D});
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_pool,
                               int64_t layer, const at::Tensor& slot_mapping, const at::Tensor& kv_slots,
                               const at::Tensor& mask, const at::Tensor& q_index, double scale, double softcap,
                               const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& kv_scales) {
  return attention(q, k, v, kv_pool, layer, slot_mapping, kv_slots, mask, q_index, scale, softcap, sinks, kv_scales,
                   false);
}

// augur::paged_attention_rows: every query by the fused path, whatever the number of queries. Each
// (token, KV head) item is computed alone, over its visible keys in their order, so a token's output
// is the same in a decode, a verify tree and a prefill chunk of any length: the batch-invariant mode.
at::Tensor paged_attention_rows_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor kv_pool,
                                    int64_t layer, const at::Tensor& slot_mapping, const at::Tensor& kv_slots,
                                    const at::Tensor& mask, const at::Tensor& q_index, double scale, double softcap,
                                    const c10::optional<at::Tensor>& sinks,
                                    const c10::optional<at::Tensor>& kv_scales) {
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "augur::paged_attention_rows: q and the new K share a dtype");
  return attention(q, k, v, kv_pool, layer, slot_mapping, kv_slots, mask, q_index, scale, softcap, sinks, kv_scales,
                   true);
}

}  // namespace

TORCH_LIBRARY_IMPL(augur, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("paged_attention_rows", &paged_attention_rows_cpu);
}
