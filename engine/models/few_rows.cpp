// moetray::int8_rows_mm: x [M, K] bfloat16 (M <= 8) times an int8 weight [N, K] with per-row scales
// [N] bfloat16, in float32, rounded once: (x @ qweightᵀ) · qscale, as torch's _weight_int8pack_mm.
// Each weight row is read once for all M rows, into 2·M independent float32 accumulators (a
// one-accumulator loop is bound by its add latency; see engine/models/few_rows.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

constexpr int64_t kMaxRows = 8;

template <int M>
void rows_range(const float* x, int64_t K, const int8_t* w, const at::BFloat16* scale, at::BFloat16* out,
                int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * K;
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) {
      acc0[m] = _mm512_setzero_ps();
      acc1[m] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + k))));
      __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + k + 16))));
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, acc0[m]);
        acc1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), w1, acc1[m]);
      }
    }
    if (k + 16 <= K) {
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + k))));
      for (int m = 0; m < M; ++m) acc0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), w0, acc0[m]);
      k += 16;
    }
    const float s = static_cast<float>(scale[n]);
    for (int m = 0; m < M; ++m) {
      float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
      for (int64_t t = k; t < K; ++t) sum += x[m * K + t] * static_cast<float>(row[t]);
      out[m * N + n] = static_cast<at::BFloat16>(sum * s);
    }
  }
}

template <int M>
void rows_all(const float* x, int64_t K, const int8_t* w, const at::BFloat16* scale, at::BFloat16* out,
              int64_t N) {
  // Blocks of output rows per task: ~64 KiB of weights, so a team's threads share the rows evenly.
  const int64_t grain = std::max<int64_t>(16, (64 << 10) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { rows_range<M>(x, K, w, scale, out, N, n0, n1); });
}

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
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const at::BFloat16* sp = qscale.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  switch (M) {
    case 1: rows_all<1>(xp, K, wp, sp, op, N); break;
    case 2: rows_all<2>(xp, K, wp, sp, op, N); break;
    case 3: rows_all<3>(xp, K, wp, sp, op, N); break;
    case 4: rows_all<4>(xp, K, wp, sp, op, N); break;
    case 5: rows_all<5>(xp, K, wp, sp, op, N); break;
    case 6: rows_all<6>(xp, K, wp, sp, op, N); break;
    case 7: rows_all<7>(xp, K, wp, sp, op, N); break;
    default: rows_all<8>(xp, K, wp, sp, op, N); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moetray, m) {
  m.def("int8_rows_mm(Tensor x, Tensor qweight, Tensor qscale) -> Tensor");
}

TORCH_LIBRARY_IMPL(moetray, CPU, m) {
  m.impl("int8_rows_mm", &int8_rows_mm);
}
