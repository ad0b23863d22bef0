// augur::small_linear on CPU tensors: y = x @ w^T (+ bias) for bfloat16 activations and weights
// with few rows, the shape of a decode, a draft level and a small verify (engine/models/small_linear.py).
//
// At one to eight rows a linear layer is a matrix-vector product: it reads each weight once and does
// two flops per weight read, so its speed is how fast the weights stream. oneDNN's bfloat16 GEMM is
// built for many rows and streams the demo target's weights at 16-23 GB/s there; this kernel reads a
// block of four weight rows once, multiplies it with every row of x by AVX512-BF16 dot products
// (`vdpbf16ps`: bfloat16 pairs into float32 sums) and keeps the 4 x M sums in registers.
//
// Each output is one float32 sum over k in the same order whatever the number of rows up to kMaxRows.
// Past that the sums are compute-bound and oneDNN's blocked layout does them faster: more rows go to
// its prepacked weights (``packed``, mkldnn::_linear_pointwise), and other dtypes, CPUs without
// AVX512-BF16 and a layer without packed weights to at::linear, as the op's Python reference does.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AUGUR_SMALL_LINEAR 1
#endif

namespace {

constexpr int64_t kMaxRows = 3;  // measured: at 4 rows and more oneDNN's blocked GEMM is faster

#ifdef AUGUR_SMALL_LINEAR
constexpr int kOut = 4;  // output features a block: four weight rows share each x load

inline __m512bh load_bf16(const uint16_t* p, int64_t left) {
  if (left >= 32) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ULL << left) - 1), p);  // zeros: no contribution
}

inline uint16_t to_bf16(float v) { return c10::BFloat16(v).x; }  // round to nearest even, as ATen

// The sums of four accumulators' sixteen lanes each, by one tree for all four (a fixed order: the
// same for every row count). A tree a sum would cost twice the instructions, a real share at K ~ 300.
inline void sum4(const __m512 a[4], float out[4]) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1)));
  const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1)));
  const __m512 u = _mm512_add_ps(lo, hi);  // each 128-bit lane: partial sums of a0, a1, a2, a3
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  const __m128 w = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  _mm_storeu_ps(out, w);
}

template <int M>
void rows_block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t K, int64_t N,
                int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kOut <= n1; n += kOut) {
    __m512 acc[M][kOut];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kOut; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* wn = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv[kOut];
      for (int r = 0; r < kOut; ++r) wv[r] = load_bf16(wn + r * K + k, K - k);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = load_bf16(x + m * K + k, K - k);
        for (int r = 0; r < kOut; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
      }
    }
    float b[kOut] = {0.f, 0.f, 0.f, 0.f};
    if (bias)
      for (int r = 0; r < kOut; ++r) b[r] = static_cast<float>(c10::BFloat16(bias[n + r], c10::BFloat16::from_bits()));
    for (int m = 0; m < M; ++m) {
      float s[kOut];
      sum4(acc[m], s);
      for (int r = 0; r < kOut; ++r) y[m * N + n + r] = to_bf16(s[r] + b[r]);
    }
  }
  for (; n < n1; ++n) {  // the last few features: one weight row at a time, the same sums
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh wv = load_bf16(w + n * K + k, K - k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, load_bf16(x + m * K + k, K - k));
    }
    for (int m = 0; m < M; ++m) {
      float b = bias ? static_cast<float>(c10::BFloat16(bias[n], c10::BFloat16::from_bits())) : 0.f;
      y[m * N + n] = to_bf16(_mm512_reduce_add_ps(acc[m]) + b);
    }
  }
}

template <int M>
void run(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t K, int64_t N) {
  const int64_t blocks = (N + kOut - 1) / kOut;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    rows_block<M>(x, w, bias, y, K, N, b0 * kOut, std::min(b1 * kOut, N));
  });
}
#endif

bool kernel_serves(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
#ifdef AUGUR_SMALL_LINEAR
  static const bool has_units = __builtin_cpu_supports("avx512bf16");
  return has_units && x.dim() == 2 && w.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows &&
         x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
         x.size(1) == w.size(1) &&
         (!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == w.size(0)));
#else
  return false;
#endif
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias ? c10::IValue(*bias) : c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

at::Tensor small_linear_cpu(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& packed,
                            const std::optional<at::Tensor>& bias) {
  if (!kernel_serves(x_in, w, bias)) {
    if (packed && x_in.dim() == 2 && x_in.scalar_type() == packed->scalar_type()) return onednn_linear(x_in, *packed, bias);
    return at::linear(x_in, w, bias);
  }
#ifdef AUGUR_SMALL_LINEAR
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto bp = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  switch (M) {
    case 1: run<1>(xp, wp, bp, yp, K, N); break;
    case 2: run<2>(xp, wp, bp, yp, K, N); break;
    default: run<3>(xp, wp, bp, yp, K, N); break;
  }
  return y;
#else
  return at::linear(x_in, w, bias);
#endif
}

}  // namespace

// The packed weight is an MkldnnCPU tensor, which the dispatcher ranks above CPU.
TORCH_LIBRARY_IMPL(augur, CPU, m) { m.impl("small_linear", &small_linear_cpu); }
TORCH_LIBRARY_IMPL(augur, MkldnnCPU, m) { m.impl("small_linear", &small_linear_cpu); }
