// moetray's few-rows int8 products, each weight row read once for all the activation rows that
// multiply it, into 2·M independent float32 accumulators per row (a one-accumulator loop is bound
// by its add latency; see engine/models/few_rows.py):
// - int8_rows_mm: x [M, K] bfloat16 (M <= 8) times an int8 weight [N, K] with per-row scales [N]
//   bfloat16, in float32, rounded once: (x @ qweightᵀ) · qscale, as torch's _weight_int8pack_mm.
// - int8_experts_mm: a decode step's routed experts, each token-expert pair's rows times its slot's
//   int8 weight [N, K] of a pool [C, N, K] (scales [C, N]); the pairs that share a slot are computed
//   together, so a step reads each routed expert once, not once per token routed to it.
// - half_rows_mm, half_experts_mm: the same for bfloat16 or float16 weights ([N, K], a pool
//   [C, N, K]; no scales), the activations in the weights' dtype, float32 sums out. With AVX512-BF16,
//   bfloat16 pairs multiply by vdpbf16ps (32 products an instruction into float32 lanes); otherwise
//   the weights are widened to float32.
// On a CPU with AVX512-VNNI both int8 products compute in integers: each activation row is rounded to
// int16 with one scale (max|x| / 32767: 15 bits, far finer than the bfloat16 it comes in), the weights
// widened to int16, and vpdpwssd sums 32 products an instruction into int32 lanes, exactly; a row's
// sum is converted once. Without VNNI, float32: widen, convert and multiply-add per 16 weights.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;

// 16 weights widened to float32.
inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 widen(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512 widen(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Output rows [n0, n1) of M activation rows xs[m] (float32, K each) times the int8, bfloat16 or float16
// rows of w (row n at w + n·K), each widened to float32, scaled by scale[n] where scales are given; row
// m's outputs go to outs[m][n].
template <int M, typename W, typename Out>
void dot_rows(const float* const* xs, int64_t K, const W* w, const at::BFloat16* scale,
              Out* const* outs, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) {
      acc0[m] = _mm512_setzero_ps();
      acc1[m] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512 w0 = widen(row + k), w1 = widen(row + k + 16);
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[m] + k), w0, acc0[m]);
        acc1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[m] + k + 16), w1, acc1[m]);
      }
    }
    if (k + 16 <= K) {
      __m512 w0 = widen(row + k);
      for (int m = 0; m < M; ++m) acc0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[m] + k), w0, acc0[m]);
      k += 16;
    }
    const float s = scale ? static_cast<float>(scale[n]) : 1.0f;
    for (int m = 0; m < M; ++m) {
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
      for (int64_t t = k; t < K; ++t) sum += xs[m][t] * static_cast<float>(row[t]);
      outs[m][n] = static_cast<Out>(sum * s);
    }
  }
}

// Inputs of a row the int16 products take: an int32 lane sums K / 16 products of at most 32767 · 127.
constexpr int64_t kMaxWordInputs = 8192;

bool words_serve(int64_t K) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni && K <= kMaxWordInputs;
}

// Float32 activation rows [rows, K] rounded to int16, one scale per row (max|x| / 32767).
struct WordRows {
  std::vector<int16_t> words;
  std::vector<float> scale;

  WordRows(const float* x, int64_t rows, int64_t K) : words(rows * K), scale(rows) {
    const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * K;
      __m512 top = _mm512_setzero_ps();
      __mmask16 odd = 0;  // a NaN or an infinity: the row's products are NaN, as in float32
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m512 magnitude = _mm512_abs_ps(_mm512_loadu_ps(xr + k));
        odd |= _mm512_cmp_ps_mask(magnitude, largest, _CMP_NLE_UQ);
        top = _mm512_max_ps(top, magnitude);
      }
      float amax = _mm512_reduce_max_ps(top);
      bool finite = odd == 0;
      for (int64_t t = k; t < K; ++t) {
        finite = finite && std::isfinite(xr[t]);
        amax = std::max(amax, std::abs(xr[t]));
      }
      scale[r] = finite ? amax / 32767.0f : std::numeric_limits<float>::quiet_NaN();
      const float inverse = finite && amax > 0.0f ? 32767.0f / amax : 0.0f;
      const __m512 by = _mm512_set1_ps(inverse);
      int16_t* out = words.data() + r * K;
      for (k = 0; k + 16 <= K; k += 16) {
        const __m256i q = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + k), by)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), q);
      }
      for (int64_t t = k; t < K; ++t) out[t] = static_cast<int16_t>(std::nearbyint(xr[t] * inverse));
    }
  }

  const int16_t* row(int64_t r, int64_t K) const { return words.data() + r * K; }
};

// dot_rows over WordRows: rows[m] picks activation row m, its sum is converted once and scaled by the
// row's and the weight row's scales.
template <int M, typename Out>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void word_rows(const WordRows& x, const int64_t* rows, int64_t K, const int8_t* w, const at::BFloat16* scale,
               Out* const* outs, int64_t n0, int64_t n1) {
  const int16_t* xs[M];
  float xscale[M];
  for (int m = 0; m < M; ++m) {
    xs[m] = x.row(rows[m], K);
    xscale[m] = x.scale[rows[m]];
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpwssd_epi32(acc[m], _mm512_loadu_si512(xs[m] + k), wv);
    }
    const float s = static_cast<float>(scale[n]);
    for (int m = 0; m < M; ++m) {
      // The lanes in int64: sixteen full lanes may pass int32 even where each one does not.
      const __m512i lanes = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[m])),
                                             _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[m], 1)));
      int64_t sum = _mm512_reduce_add_epi64(lanes);
      for (int64_t t = k; t < K; ++t) sum += static_cast<int64_t>(xs[m][t]) * row[t];
      outs[m][n] = static_cast<Out>(static_cast<float>(sum) * xscale[m] * s);
    }
  }
}

// fn(std::integral_constant<int, count>{}): a kernel templated on its row count, called for count rows.
template <typename Fn>
void rows_of(int count, const Fn& fn) {
  switch (count) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}

// Output rows per task: ~64 KiB of weights, so a team's threads share the rows evenly.
int64_t grain_of(int64_t K) { return std::max<int64_t>(16, (64 << 10) / std::max<int64_t>(K, 1)); }

at::Tensor int8_rows_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& qscale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: [M, K] bfloat16");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "qweight: contiguous [N, K] int8");
  TORCH_CHECK(qscale.dim() == 1 && qscale.scalar_type() == at::kBFloat16 && qscale.is_contiguous(),
              "qscale: contiguous [N] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && qscale.size(0) == N, "shapes disagree");
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "1 to 8 rows");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xs[kMaxRows];
  at::BFloat16* outs[kMaxRows];
  for (int64_t m = 0; m < M; ++m) {
    xs[m] = xf.data_ptr<float>() + m * K;
    outs[m] = out.data_ptr<at::BFloat16>() + m * N;
  }
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const at::BFloat16* sp = qscale.data_ptr<at::BFloat16>();
  std::optional<WordRows> words;
  if (words_serve(K)) words.emplace(xf.data_ptr<float>(), M, K);
  const int64_t rows[kMaxRows] = {0, 1, 2, 3, 4, 5, 6, 7};
  at::parallel_for(0, N, grain_of(K), [&](int64_t n0, int64_t n1) {
    rows_of(static_cast<int>(M), [&](auto R) {
      if (words) {
        word_rows<R>(*words, rows, K, wp, sp, outs, n0, n1);
      } else {
        dot_rows<R>(xs, K, wp, sp, outs, n0, n1);
      }
    });
  });
  return out;
}

// A step's token-expert pairs (slots [T, k]) grouped by slot, at most kMaxRows pairs a group (a token
// routes to a slot at most once, so a decode step of up to eight tokens makes one group per routed
// slot), and the loop that hands out (group, block of output rows) tasks to the intra-op threads.
struct SlotGroups {
  std::vector<int64_t> order;                        // pair indices, by slot
  std::vector<std::pair<int64_t, int64_t>> groups;   // [begin, end) in order

  SlotGroups(const int64_t* slots, int64_t pairs, int64_t capacity) : order(pairs) {
    for (int64_t p = 0; p < pairs; ++p) {
      TORCH_CHECK(slots[p] >= 0 && slots[p] < capacity, "a slot outside the pool");
      order[p] = p;
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slots[a] < slots[b]; });
    for (int64_t p = 0; p < pairs;) {
      int64_t q = p;
      while (q < pairs && slots[order[q]] == slots[order[p]] && q - p < kMaxRows) ++q;
      groups.emplace_back(p, q);
      p = q;
    }
  }

  // task(first pair, end pair, n0, n1) for every group and block of ``grain`` output rows of N.
  template <typename Task>
  void parallel(int64_t N, int64_t grain, const Task& task) const {
    const int64_t blocks = (N + grain - 1) / grain, G = static_cast<int64_t>(groups.size());
    at::parallel_for(0, G * blocks, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const auto [b, e] = groups[i / blocks];
        const int64_t n0 = (i % blocks) * grain;
        task(b, e, n0, std::min(N, n0 + grain));
      }
    });
  }
};

// The checks both experts products make of x ([T, K] or [T, k, K]) and slots ([T, k]).
void check_pairs(const at::Tensor& x, const at::Tensor& slots, int64_t K) {
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == at::kLong, "slots: [T, k] int64");
  TORCH_CHECK(x.dim() == 2 || (x.dim() == 3 && x.size(1) == slots.size(1)), "x: [T, K] or [T, k, K]");
  TORCH_CHECK(x.size(0) == slots.size(0), "x and slots disagree on T");
  TORCH_CHECK(x.size(-1) == K, "x and the weights disagree on K");
}

at::Tensor int8_experts_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& qscale,
                           const at::Tensor& slots) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.scalar_type() == at::kChar && qweight.stride(2) == 1 &&
                  qweight.stride(1) == qweight.size(2),
              "qweight: [C, N, K] int8, each slot's [N, K] contiguous");
  TORCH_CHECK(qscale.dim() == 2 && qscale.scalar_type() == at::kBFloat16 && qscale.stride(1) == 1,
              "qscale: [C, N] bfloat16, each slot's [N] contiguous");
  const int64_t C = qweight.size(0), N = qweight.size(1), K = qweight.size(2);
  check_pairs(x, slots, K);
  TORCH_CHECK(qscale.size(0) == C && qscale.size(1) == N, "shapes disagree");
  const int64_t T = slots.size(0), top = slots.size(1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor sl = slots.contiguous();
  at::Tensor out = at::empty({T, top, N}, x.options().dtype(at::kFloat));
  const int64_t x_per_pair = x.dim() == 3 ? 1 : top;
  const int64_t* sp = sl.data_ptr<int64_t>();
  const SlotGroups pairs(sp, T * top, C);
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const at::BFloat16* scp = qscale.data_ptr<at::BFloat16>();
  std::optional<WordRows> words;
  if (words_serve(K)) words.emplace(xp, xf.numel() / K, K);
  pairs.parallel(N, grain_of(K), [&](int64_t b, int64_t e, int64_t n0, int64_t n1) {
    int64_t rows[kMaxRows];
    const float* xs[kMaxRows];
    float* outs[kMaxRows];
    for (int64_t j = b; j < e; ++j) {
      rows[j - b] = pairs.order[j] / x_per_pair;
      xs[j - b] = xp + rows[j - b] * K;
      outs[j - b] = op + pairs.order[j] * N;
    }
    const int64_t slot = sp[pairs.order[b]];
    const int8_t* w = wp + slot * qweight.stride(0);
    const at::BFloat16* scale = scp + slot * qscale.stride(0);
    rows_of(static_cast<int>(e - b), [&](auto R) {
      if (words) {
        word_rows<R>(*words, rows, K, w, scale, outs, n0, n1);
      } else {
        dot_rows<R>(xs, K, w, scale, outs, n0, n1);
      }
    });
  });
  return out;
}

bool pairs_serve(int64_t K) {
  static const bool bf16 = __builtin_cpu_supports("avx512bf16");
  return bf16 && K % 32 == 0;
}

// M bfloat16 activation rows times the bfloat16 rows [n0, n1) of w: vdpbf16ps multiplies 32 pairs of
// bfloat16 exactly and adds them into 16 float32 lanes (K a multiple of 32: pairs_serve).
template <int M>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void pair_rows(const at::BFloat16* const* xs, int64_t K, const at::BFloat16* w, float* const* outs,
               int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* row = w + n * K;
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) {
      acc0[m] = _mm512_setzero_ps();
      acc1[m] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k), w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_dpbf16_ps(acc0[m], (__m512bh)_mm512_loadu_si512(xs[m] + k), w0);
        acc1[m] = _mm512_dpbf16_ps(acc1[m], (__m512bh)_mm512_loadu_si512(xs[m] + k + 32), w1);
      }
    }
    if (k < K) {  // the last 32
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m) acc0[m] = _mm512_dpbf16_ps(acc0[m], (__m512bh)_mm512_loadu_si512(xs[m] + k), w0);
    }
    for (int m = 0; m < M; ++m) outs[m][n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
  }
}

// Activation rows [rows, K] for the 16-bit products: bfloat16 as they are where the pair products
// serve (pairs_serve), else widened to float32 once; products() runs the kernel that takes them.
struct HalfRows {
  at::ScalarType dtype;
  bool pairs;
  at::Tensor values;

  HalfRows(const at::Tensor& x, int64_t K)
      : dtype(x.scalar_type()),
        pairs(dtype == at::kBFloat16 && pairs_serve(K)),
        values(pairs ? x.contiguous() : x.to(at::kFloat).contiguous()) {}

  const void* row(int64_t r, int64_t K) const {
    return static_cast<const char*>(values.data_ptr()) + r * K * values.element_size();
  }

  // The float32 sums of the activation rows xs[0..count) times the weight rows [n0, n1) of w into outs.
  void products(int count, const void* const* xs, int64_t K, const void* w, float* const* outs, int64_t n0,
                int64_t n1) const {
    rows_of(count, [&](auto R) {
      if (pairs) {
        pair_rows<R>(reinterpret_cast<const at::BFloat16* const*>(xs), K, static_cast<const at::BFloat16*>(w),
                     outs, n0, n1);
      } else if (dtype == at::kBFloat16) {
        dot_rows<R>(reinterpret_cast<const float* const*>(xs), K, static_cast<const at::BFloat16*>(w), nullptr,
                    outs, n0, n1);
      } else {
        dot_rows<R>(reinterpret_cast<const float* const*>(xs), K, static_cast<const at::Half*>(w), nullptr, outs,
                    n0, n1);
      }
    });
  }
};

void check_half(const at::Tensor& x, const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "weight: bfloat16 or float16");
  TORCH_CHECK(weight.stride(-1) == 1 && weight.stride(-2) == weight.size(-1),
              "weight: each [N, K] matrix contiguous");
  TORCH_CHECK(x.scalar_type() == dtype, "x in the weights' dtype");
}

at::Tensor half_rows_mm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x: [M, K], weight: [N, K]");
  check_half(x, weight);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "x and the weight disagree on K");
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "1 to 8 rows");
  const HalfRows rows(x, K);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const void* xs[kMaxRows];
  float* outs[kMaxRows];
  for (int64_t m = 0; m < M; ++m) {
    xs[m] = rows.row(m, K);
    outs[m] = out.data_ptr<float>() + m * N;
  }
  const void* w = weight.data_ptr();
  at::parallel_for(0, N, grain_of(2 * K), [&](int64_t n0, int64_t n1) {
    rows.products(static_cast<int>(M), xs, K, w, outs, n0, n1);
  });
  return out;
}

at::Tensor half_experts_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& slots) {
  TORCH_CHECK(weight.dim() == 3, "weight: [C, N, K]");
  check_half(x, weight);
  const int64_t C = weight.size(0), N = weight.size(1), K = weight.size(2);
  check_pairs(x, slots, K);
  const int64_t T = slots.size(0), top = slots.size(1);
  const HalfRows rows(x, K);
  at::Tensor sl = slots.contiguous();
  at::Tensor out = at::empty({T, top, N}, x.options().dtype(at::kFloat));
  const int64_t x_per_pair = x.dim() == 3 ? 1 : top;
  const int64_t* sp = sl.data_ptr<int64_t>();
  const SlotGroups pairs(sp, T * top, C);
  float* op = out.data_ptr<float>();
  const auto* base = static_cast<const char*>(weight.data_ptr());
  const int64_t slot_bytes = weight.stride(0) * weight.element_size();
  pairs.parallel(N, grain_of(2 * K), [&](int64_t b, int64_t e, int64_t n0, int64_t n1) {
    const void* xs[kMaxRows];
    float* outs[kMaxRows];
    for (int64_t j = b; j < e; ++j) {
      xs[j - b] = rows.row(pairs.order[j] / x_per_pair, K);
      outs[j - b] = op + pairs.order[j] * N;
    }
    rows.products(static_cast<int>(e - b), xs, K, base + sp[pairs.order[b]] * slot_bytes, outs, n0, n1);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moetray, m) {
  m.def("int8_rows_mm(Tensor x, Tensor qweight, Tensor qscale) -> Tensor");
  m.def("int8_experts_mm(Tensor x, Tensor qweight, Tensor qscale, Tensor slots) -> Tensor");
  m.def("half_rows_mm(Tensor x, Tensor weight) -> Tensor");
  m.def("half_experts_mm(Tensor x, Tensor weight, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(moetray, CPU, m) {
  m.impl("int8_rows_mm", &int8_rows_mm);
  m.impl("int8_experts_mm", &int8_experts_mm);
  m.impl("half_rows_mm", &half_rows_mm);
  m.impl("half_experts_mm", &half_experts_mm);
}
