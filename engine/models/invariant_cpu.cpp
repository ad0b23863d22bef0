// The batch-invariant operators on CPU tensors (engine/models/invariant.py): every output of each is
// computed by one fixed sequence of float32 operations whatever the number of rows of the call, which
// rows come with it, how the call is split over threads, and whether the forward is eager or compiled.
//
// augur::invariant_linear: y = x @ w^T (+ bias). A BLAS picks its blocking, and with it the order of
// each output's sum over k, by the shape of the call: one row of a decode, sixteen of a batch and two
// thousand of a prefill chunk reduce the same row differently, and in bfloat16 the last bits that
// differ change tokens. Here an output's sum has one order: sixteen lanes, lane j adding x[k] w[k] for
// k = j, j + 16, ... in order (a fused multiply-add where the CPU has one), then one fixed tree over the lanes, then the bias, then one rounding to the
// output's dtype. Rows and features are tiled and spread over threads in any way the shape
// suggests; no tiling changes that order.
//
// augur::invariant_rms_norm, augur::invariant_act_mul, augur::invariant_softcap: a row's norm (its sum
// of squares on the same lanes), the MLP's activation times its up projection, the logits'
// soft cap. torch's own kernels, and the ones inductor writes when the forward is compiled, treat an
// element by where it falls in the flat tensor's split over threads and vectors (a vector exp or a
// scalar one; a fused reduction split its own way), and round their intermediates differently; here
// an element's value depends on its row alone, with the roundings of the eager PyTorch expression
// each operator replaces.
//
// GCC/Clang vector types, which the compiler maps to the CPU's own registers: one source for every
// x86 and Arm CPU, built with -march=native by engine/attention/cpu_kernel.py (the lanes, and so the
// order, are the CPU's: a deployment's every process computes alike), and with -ffp-contract=off: a
// product and a sum stay two roundings unless the code asks for a fused multiply-add, never one chosen
// by the compiler site by site. bfloat16 inputs are widened to float32 as they are read.
//
// On a CPU with AVX512-BF16 units a bfloat16 linear layer takes another fixed order, one these units
// run at the weights' streaming speed (the generic one widens every weight first and, at a decode's
// one row, streams them at a third of that): lane j of an output's sixteen adds, for each 32 k in
// order, x[k] w[k] for the pair k = 32c + 2j, 32c + 2j + 1 (`vdpbf16ps`: the products are exact in
// float32, and the CPU's one instruction adds them), then one fixed tree over the lanes (`sum4`), the
// bias, one rounding. Every row count, tile and thread split runs that one instruction sequence.

#include <ATen/ATen.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

// Sixteen float32 lanes a sum, held as kParts native vectors (GCC/Clang vector types: one AVX-512
// register, two AVX2 ones). A step computes a tile of R rows by F features; rows come kRows at a time
// (the weight row is read once for them), a lone row kFeats features at a time.
constexpr int kLanes = 16;
#if defined(__AVX512F__)
constexpr int kWidth = 16, kRows = 6, kFeats = 4;
#else
constexpr int kWidth = 8, kRows = 6, kFeats = 4;
#endif
constexpr int kParts = kLanes / kWidth;
typedef float vf __attribute__((vector_size(4 * kWidth)));
typedef uint32_t vu32 __attribute__((vector_size(4 * kWidth)));
typedef uint16_t vu16 __attribute__((vector_size(2 * kWidth)));
constexpr int64_t kRowBlock = 48;   // rows a work item (its x block stays in cache while its features run)
constexpr int64_t kFeatBlock = 64;  // features a work item

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf load(const c10::BFloat16* p) {  // bfloat16 → float32: its bits in the high half
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32 wide = __builtin_convertvector(h, vu32) << 16;
  vf v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// acc + a * b: one fused multiply-add (one rounding) where the CPU has it, at every site alike; else a
// product and a sum (-ffp-contract=off: the compiler never fuses them on its own, site by site).
inline vf mul_add(vf acc, vf a, vf b) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, acc);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, acc);
#else
  const vf p = a * b;
  return acc + p;
#endif
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// The sixteen lanes' sum by one fixed tree: halves added pairwise until one is left (the parts' sum is
// the tree's first level where a vector holds eight). By value: an accumulator whose address were taken
// would live in memory, not a register.
inline __attribute__((always_inline)) float lane_sum(const vf (&parts)[kParts]) {
  vf v = parts[0];
  for (int q = 1; q < kParts; ++q) v = v + parts[q];
  float s[kWidth];
  std::memcpy(s, &v, sizeof(s));
  for (int half = kWidth / 2; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) s[j] = s[j] + s[j + half];
  return s[0];
}

// Rows [m0, m0 + R) against features [n0, n0 + F): lane j of an output's accumulator adds
// x[k] * w[k] for k = j, j + 16, ... in order. K's last partial sixteen are read through a zero-padded
// copy (zeros add nothing).
template <typename T, int R, int F>
void tile(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  vf acc[R][F][kParts];
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f)
      for (int q = 0; q < kParts; ++q) acc[r][f][q] = vf{};
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    vf xv[R][kParts];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < kParts; ++q) xv[r][q] = load(x + (m0 + r) * K + k + q * kWidth);
    for (int f = 0; f < F; ++f)
      for (int q = 0; q < kParts; ++q) {
        const vf wv = load(w + (n0 + f) * K + k + q * kWidth);
        for (int r = 0; r < R; ++r) acc[r][f][q] = mul_add(acc[r][f][q], xv[r][q], wv);
      }
  }
  if (body < K) {
    T xt[R][kLanes], wt[F][kLanes];
    for (int j = 0; j < kLanes; ++j) {
      const bool in = body + j < K;
      for (int r = 0; r < R; ++r) xt[r][j] = in ? x[(m0 + r) * K + body + j] : T(0);
      for (int f = 0; f < F; ++f) wt[f][j] = in ? w[(n0 + f) * K + body + j] : T(0);
    }
    for (int f = 0; f < F; ++f)
      for (int q = 0; q < kParts; ++q)
        for (int r = 0; r < R; ++r)
          acc[r][f][q] = mul_add(acc[r][f][q], load(xt[r] + q * kWidth), load(wt[f] + q * kWidth));
  }
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) {
      const float b = bias ? widen(bias[n0 + f]) : 0.f;
      y[(m0 + r) * N + n0 + f] = static_cast<T>(lane_sum(acc[r][f]) + b);  // BFloat16: nearest even
    }
}

// Rows [m0, m0 + R) against features [n0, n1): F at a time, then one at a time.
template <typename T, int R, int F>
void feature_run(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                 int64_t n1) {
  int64_t n = n0;
  for (; n + F <= n1; n += F) tile<T, R, F>(x, w, bias, y, K, N, m0, n);
  for (; n < n1; ++n) tile<T, R, 1>(x, w, bias, y, K, N, m0, n);
}

// A block's rows [m, m1) left after its kRows-row tiles: fewer than kRows, read together.
template <typename T>
void last_rows(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t N, int64_t m, int64_t m1, int64_t n0,
               int64_t n1) {
  switch (m1 - m) {
    case 1: return feature_run<T, 1, kFeats>(x, w, bias, y, K, N, m, n0, n1);
    case 2: return feature_run<T, 2, 2>(x, w, bias, y, K, N, m, n0, n1);
    case 3: return feature_run<T, 3, 1>(x, w, bias, y, K, N, m, n0, n1);
    case 4: return feature_run<T, 4, 1>(x, w, bias, y, K, N, m, n0, n1);
    case 5: return feature_run<T, 5, 1>(x, w, bias, y, K, N, m, n0, n1);
    default: return;
  }
}

// The work items of an [M, N] output, kRowBlock rows by kFeatBlock features each, spread over threads:
// fn(m0, m1, n0, n1) for each.
template <typename Fn>
void for_blocks(int64_t M, int64_t N, const Fn& fn) {
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock, feat_blocks = (N + kFeatBlock - 1) / kFeatBlock;
  at::parallel_for(0, row_blocks * feat_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rb = item / feat_blocks, fb = item % feat_blocks, n0 = fb * kFeatBlock;
      fn(rb * kRowBlock, std::min(M, (rb + 1) * kRowBlock), n0, std::min(N, n0 + kFeatBlock));
    }
  });
}

template <typename T>
void run(const T* x, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N) {
  static_assert(kRows == 6, "last_rows covers 1 .. kRows - 1 rows");
  for_blocks(M, N, [&](int64_t m, int64_t m1, int64_t n0, int64_t n1) {
    for (; m + kRows <= m1; m += kRows) feature_run<T, kRows, 1>(x, w, bias, y, K, N, m, n0, n1);
    last_rows(x, w, bias, y, K, N, m, m1, n0, n1);
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define AUGUR_INVARIANT_DPBF16 1
// ---- bfloat16 on AVX512-BF16 units ----------------------------------------------------------------

// Rows a tile (kDpRows x kDpFeats sums, a weight vector each feature, an x vector: 29 of 32 registers),
// four features a tile whatever its rows.
constexpr int kDpRows = 6, kDpFeats = 4;

inline __m512bh dp_load(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh dp_load(const c10::BFloat16* p, __mmask32 mask) {  // the lanes past K read as zeros
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Four sums by one tree, each alike: within a 128-bit quarter (l0 + l2) + (l1 + l3), then the quarters
// (q0 + q2) + (q1 + q3). Fewer features pass zero vectors beside theirs. By value, inlined: an
// accumulator whose address escaped would be kept in memory through the loop.
inline __attribute__((always_inline)) __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1)));
  const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1)));
  const __m512 u = _mm512_add_ps(lo, hi);
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

// One 32-wide step of k for every sum of a tile: the F weight vectors loaded once, each row's x once.
template <int R, int F, typename... Mask>
inline __attribute__((always_inline)) void dp_step(__m512 (&acc)[R][F], const c10::BFloat16* x, const c10::BFloat16* w,
                                                   int64_t K, Mask... mask) {
  __m512bh wv[F];
  for (int f = 0; f < F; ++f) wv[f] = dp_load(w + f * K, mask...);
  for (int r = 0; r < R; ++r) {
    const __m512bh xv = dp_load(x + r * K, mask...);
    for (int f = 0; f < F; ++f) acc[r][f] = _mm512_dpbf16_ps(acc[r][f], wv[f], xv);
  }
}

// Rows [m0, m0 + R) against the F (1 or kDpFeats) features from n0.
template <int R, int F>
void dp_tile(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t K,
             int64_t N, int64_t m0, int64_t n0) {
  static_assert(F == 1 || F == kDpFeats, "sum4 reduces four features, or one");
  __m512 acc[R][F];
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) acc[r][f] = _mm512_setzero_ps();
  const c10::BFloat16* xr = x + m0 * K;
  const c10::BFloat16* wf = w + n0 * K;
  const int64_t body = K - K % 32;
  for (int64_t k = 0; k < body; k += 32) dp_step<R, F>(acc, xr + k, wf + k, K);
  if (body < K) dp_step<R, F>(acc, xr + body, wf + body, K, (__mmask32)((1ULL << (K - body)) - 1));
  // The epilogue in vectors (at K ~ 300 a scalar one cost a third of the tile): each row's sums, plus
  // the bias, rounded to bfloat16 by `vcvtneps2bf16` (nearest even; subnormal floats flush to zero).
  const __m512 zero = _mm512_setzero_ps();
  __m128 b = _mm_setzero_ps();
  if (bias) {
    uint16_t bits[4] = {0, 0, 0, 0};
    std::memcpy(bits, bias + n0, F * sizeof(uint16_t));
    b = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bits))), 16));
  }
  for (int r = 0; r < R; ++r) {
    c10::BFloat16* dst = y + (m0 + r) * N + n0;
    if constexpr (F == 1) {
      const __m128i out = (__m128i)_mm_cvtneps_pbh(_mm_add_ps(sum4(acc[r][0], zero, zero, zero), b));
      const uint16_t first = static_cast<uint16_t>(_mm_extract_epi16(out, 0));
      std::memcpy(dst, &first, sizeof(first));
    } else {
      const __m128i out = (__m128i)_mm_cvtneps_pbh(_mm_add_ps(sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), b));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), out);
    }
  }
}

// Rows [m0, m0 + R) against features [n0, n1).
template <int R>
void dp_feature_run(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
                    int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kDpFeats <= n1; n += kDpFeats) dp_tile<R, kDpFeats>(x, w, bias, y, K, N, m0, n);
  for (; n < n1; ++n) dp_tile<R, 1>(x, w, bias, y, K, N, m0, n);
}

void dp_run(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t M,
            int64_t K, int64_t N) {
  static_assert(kDpRows == 6, "the switch covers 1 .. kDpRows - 1 rows");
  for_blocks(M, N, [&](int64_t m, int64_t m1, int64_t n0, int64_t n1) {
    for (; m + kDpRows <= m1; m += kDpRows) dp_feature_run<kDpRows>(x, w, bias, y, K, N, m, n0, n1);
    switch (m1 - m) {
      case 1: dp_feature_run<1>(x, w, bias, y, K, N, m, n0, n1); break;
      case 2: dp_feature_run<2>(x, w, bias, y, K, N, m, n0, n1); break;
      case 3: dp_feature_run<3>(x, w, bias, y, K, N, m, n0, n1); break;
      case 4: dp_feature_run<4>(x, w, bias, y, K, N, m, n0, n1); break;
      case 5: dp_feature_run<5>(x, w, bias, y, K, N, m, n0, n1); break;
      default: break;
    }
  });
}
#endif

at::Tensor invariant_linear_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& bias_in) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "augur::invariant_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(w_in.scalar_type() == dtype && (!bias_in || bias_in->scalar_type() == dtype),
              "augur::invariant_linear: x, weight and bias share a dtype");
  if (dtype != at::kFloat && dtype != at::kBFloat16) return at::linear(x_in, w_in, bias_in);  // not served
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const std::optional<at::Tensor> bias = bias_in ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (dtype == at::kFloat) {
    run<float>(x.data_ptr<float>(), w.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<float>(), M, K, N);
  } else {
    using B = c10::BFloat16;
#ifdef AUGUR_INVARIANT_DPBF16
    dp_run(x.data_ptr<B>(), w.data_ptr<B>(), bias ? bias->data_ptr<B>() : nullptr, y.data_ptr<B>(), M, K, N);
#else
    run<B>(x.data_ptr<B>(), w.data_ptr<B>(), bias ? bias->data_ptr<B>() : nullptr, y.data_ptr<B>(), M, K, N);
#endif
  }
  return y;
}

// ---- norms, activations, soft caps ---------------------------------------------------------------

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }  // BFloat16: nearest even; float: itself

// Rows [begin, end) of an [M, D] tensor, spread over threads by rows only (an element's arithmetic never
// depends on the split).
template <typename F>
void for_rows(int64_t M, int64_t D, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) fn(m);
  });
}

// y = x / rms(x) scaled: Llama's order (normalize in float32, round to the dtype, times the weight in
// the dtype) or, with unit_offset, Gemma's (times 1 + weight in float32, then one rounding).
template <typename T>
void rms_norm(const T* x, const T* w, T* y, int64_t M, int64_t D, float eps, bool unit_offset) {
  for_rows(M, D, [&](int64_t m) {
    const T* row = x + m * D;
    T* out = y + m * D;
    vf acc[kParts] = {};
    const int64_t body = D - D % kLanes;
    for (int64_t k = 0; k < body; k += kLanes)
      for (int q = 0; q < kParts; ++q) {
        const vf v = load(row + k + q * kWidth);
        acc[q] = mul_add(acc[q], v, v);
      }
    if (body < D) {
      T tail[kLanes];
      for (int j = 0; j < kLanes; ++j) tail[j] = body + j < D ? row[body + j] : T(0);
      for (int q = 0; q < kParts; ++q) {
        const vf v = load(tail + q * kWidth);
        acc[q] = mul_add(acc[q], v, v);
      }
    }
    const float inv = 1.f / std::sqrt(lane_sum(acc) / static_cast<float>(D) + eps);
    if (unit_offset) {
      for (int64_t j = 0; j < D; ++j) out[j] = round_to<T>((widen(row[j]) * inv) * (1.f + widen(w[j])));
    } else {
      for (int64_t j = 0; j < D; ++j) out[j] = round_to<T>(widen(w[j]) * widen(round_to<T>(widen(row[j]) * inv)));
    }
  });
}

enum class Act { kSilu, kGelu, kGeluTanh, kRelu };

inline float activate(Act act, float g) {
  switch (act) {
    case Act::kSilu:
      return g / (1.f + std::exp(-g));
    case Act::kGelu:
      return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case Act::kGeluTanh: {
      const float inner = 0.79788456080286536f * (g + 0.044715f * (g * g * g));
      return 0.5f * g * (1.f + std::tanh(inner));
    }
    case Act::kRelu:
      return g > 0.f ? g : 0.f;
  }
  return g;
}

// y[m, j] = act(gate[m, j]) * up[m, j] for gate_up = [gate | up] of [M, 2I]: the activation rounded to
// the dtype, then the product rounded (eager's two operators).
#if defined(__AVX512F__)
// e^x for sixteen floats: x = n ln 2 + r (n nearest x / ln 2, ln 2 in two parts), e^r by Cephes' degree-7
// polynomial in fused multiply-adds (about one ulp), times 2^n by `vscalefps` (overflow to infinity,
// underflow to zero; NaN stays NaN).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

template <typename T>
void act_mul(const T* gu, T* y, int64_t M, int64_t I, Act act) {
  for_rows(M, 2 * I, [&](int64_t m) {
    const T* gate = gu + m * 2 * I;
    const T* up = gate + I;
    T* out = y + m * I;
    int64_t j = 0;
#if defined(__AVX512F__)
    // SiLU sixteen features at a time (a feature takes this path or the scalar one by its index alone,
    // whatever the rows): the activation in vectors, its two roundings as below.
    if (act == Act::kSilu) {
      for (; j + kWidth <= I; j += kWidth) {
        vf g = load(gate + j);
        __m512 gv;
        std::memcpy(&gv, &g, sizeof(gv));
        const __m512 a = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        float av[kWidth];
        _mm512_storeu_ps(av, a);
        for (int t = 0; t < kWidth; ++t) out[j + t] = round_to<T>(widen(round_to<T>(av[t])) * widen(up[j + t]));
      }
    }
#endif
    for (; j < I; ++j) out[j] = round_to<T>(widen(round_to<T>(activate(act, widen(gate[j])))) * widen(up[j]));
  });
}

Act act_named(const std::string& name) {
  if (name == "silu" || name == "swish") return Act::kSilu;
  if (name == "gelu") return Act::kGelu;
  if (name == "gelu_pytorch_tanh") return Act::kGeluTanh;
  if (name == "relu") return Act::kRelu;
  TORCH_CHECK(false, "augur::invariant_act_mul: no activation named ", name);
}

void check_served(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": float32 or bfloat16 tensors (the dtypes the batch-invariant mode serves)");
}

at::Tensor invariant_rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& w_in, double eps, bool unit_offset) {
  check_served(x_in, "augur::invariant_rms_norm");
  TORCH_CHECK(w_in.dim() == 1 && x_in.size(-1) == w_in.size(0) && w_in.scalar_type() == x_in.scalar_type(),
              "augur::invariant_rms_norm: a weight [D] of x's dtype");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t D = x.size(-1), M = D ? x.numel() / D : 0;
  if (x.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    rms_norm<float>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, D, eps, unit_offset);
  } else {
    using B = c10::BFloat16;
    rms_norm<B>(x.data_ptr<B>(), w.data_ptr<B>(), y.data_ptr<B>(), M, D, eps, unit_offset);
  }
  return y;
}

at::Tensor invariant_act_mul_cpu(const at::Tensor& gu_in, c10::string_view act_name) {
  check_served(gu_in, "augur::invariant_act_mul");
  TORCH_CHECK(gu_in.size(-1) % 2 == 0, "augur::invariant_act_mul: [..., 2 I] (gate, then up)");
  const Act act = act_named(std::string(act_name));
  const at::Tensor gu = gu_in.contiguous();
  const int64_t I = gu.size(-1) / 2, M = I ? gu.numel() / (2 * I) : 0;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = I;
  at::Tensor y = at::empty(shape, gu.options());
  if (y.numel() == 0) return y;
  if (gu.scalar_type() == at::kFloat) {
    act_mul<float>(gu.data_ptr<float>(), y.data_ptr<float>(), M, I, act);
  } else {
    using B = c10::BFloat16;
    act_mul<B>(gu.data_ptr<B>(), y.data_ptr<B>(), M, I, act);
  }
  return y;
}

// cap * tanh(x / cap) over float32 logits (Gemma-2's final soft cap), in eager's order.
at::Tensor invariant_softcap_cpu(const at::Tensor& x_in, double cap_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "augur::invariant_softcap: float32 logits");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const float cap = static_cast<float>(cap_in);
  const float* src = x.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  const int64_t D = x.dim() ? x.size(-1) : 1, M = D ? x.numel() / D : 0;
  if (x.numel() == 0) return y;
  for_rows(M, D, [&](int64_t m) {
    for (int64_t j = m * D; j < (m + 1) * D; ++j) dst[j] = std::tanh(src[j] / cap) * cap;
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(augur, CPU, m) {
  m.impl("invariant_linear", &invariant_linear_cpu);
  m.impl("invariant_rms_norm", &invariant_rms_norm_cpu);
  m.impl("invariant_act_mul", &invariant_act_mul_cpu);
  m.impl("invariant_softcap", &invariant_softcap_cpu);
}
