// y[M, N] = x[M, K] @ w[K, N] in float32 for a few rows M, as an XLA FFI custom call.
//
// Why: a decoding step multiplies one row by every weight matrix and streams the weights at
// the memory-bandwidth floor. Verifying a small tree multiplies 2-8 rows by the same weights,
// and XLA's CPU matrix-matrix kernels stream them markedly slower: on 2 cores of an AMD EPYC
// the teacher's products cost ~1.35x one row at 2-4 rows (docs/RESULTS.md, "A few-row
// product kernel"). Here the weights are read once, in memory order, for all rows: each
// thread owns a contiguous range of output columns; for every KB = 8 consecutive rows of w
// it loads each 16-column piece of the M outputs into registers, adds the KB rows' terms
// (fused multiply-add, each x broadcast once per piece and row) and stores them back. The
// outputs of a range stay in the core's caches, the weights stream through once; so a few
// rows cost about what one row costs.
//
// Every output element is summed over k = 0, 1, ..., K - 1 in that order whatever M, the
// thread count or the range: a row's result does not depend on the rows it is computed with.
//
// Built at first use by eaglepangu_jax/models/few_row.py (OpenMP) for the widest of the two
// instruction sets the CPU has: AVX-512F (16 floats a register) or AVX2 with FMA (8). The
// instructions differ, the arithmetic does not: every output is the same chain of fused
// multiply-adds over k in order, so both builds give bitwise the same result. The caller checks
// the shapes (x [M, K] with 1 <= M <= 16, w [K, N] with N a multiple of 16).

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace {

// One register of float lanes and the operations the sweep needs.
#if defined(__AVX512F__)
using Lanes = __m512;
constexpr int64_t kLanes = 16;
inline Lanes Zero() { return _mm512_setzero_ps(); }
inline Lanes Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
inline Lanes Broadcast(float a) { return _mm512_set1_ps(a); }
inline Lanes MulAdd(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
using Lanes = __m256;
constexpr int64_t kLanes = 8;
inline Lanes Zero() { return _mm256_setzero_ps(); }
inline Lanes Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
inline Lanes Broadcast(float a) { return _mm256_set1_ps(a); }
inline Lanes MulAdd(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
#else
#error "few_row_product needs AVX-512F, or AVX2 with FMA"
#endif

// A piece of 16 columns is the unit of work: a thread's columns are whole pieces, and one
// broadcast of x serves the whole piece (two registers with AVX2: broadcasting for every
// 8-float register cost AVX2 ~10% of the product at 2 rows on the AMD machine).
constexpr int64_t kPiece = 16;
constexpr int kRegs = kPiece / kLanes;  // registers a piece of one row takes
constexpr int64_t kMaxRows = 16;        // rows a call may take (MAX_ROWS in few_row.py routes 8)
constexpr int kRowsPerLoad = 8;         // rows of w added to the outputs between loads and stores

// Output columns [begin, end) of the R rows.
template <int R>
void Sweep(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t begin,
           int64_t end) {
  for (int64_t k0 = 0; k0 < K; k0 += kRowsPerLoad) {
    const int64_t kb = std::min<int64_t>(kRowsPerLoad, K - k0);
    const float* wk = w + k0 * N;
    for (int64_t n = begin; n < end; n += kPiece) {
      Lanes acc[R][kRegs];
      for (int r = 0; r < R; ++r) {
        for (int g = 0; g < kRegs; ++g) {
          acc[r][g] = k0 == 0 ? Zero() : Load(y + r * N + n + g * kLanes);
        }
      }
      for (int64_t j = 0; j < kb; ++j) {
        const float* wj = wk + j * N + n;
        for (int r = 0; r < R; ++r) {
          const Lanes a = Broadcast(x[r * K + k0 + j]);
          for (int g = 0; g < kRegs; ++g) acc[r][g] = MulAdd(a, Load(wj + g * kLanes), acc[r][g]);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int g = 0; g < kRegs; ++g) Store(y + r * N + n + g * kLanes, acc[r][g]);
      }
    }
  }
}

template <int... Rs>
void SweepRows(int64_t rows, const float* x, int64_t K, const float* w, int64_t N, float* y,
               int64_t begin, int64_t end, std::integer_sequence<int, Rs...>) {
  // Rs = 0, ..., kMaxRows - 1: dispatch to Sweep<rows>.
  ((rows == Rs + 1 ? (Sweep<Rs + 1>(x, K, w, N, y, begin, end), 0) : 0), ...);
}

void FewRowProduct(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
  const int64_t pieces = N / kPiece;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t begin = pieces * t / threads * kPiece;
    const int64_t end = pieces * (t + 1) / threads * kPiece;
    if (begin < end) {
      SweepRows(M, x, K, w, N, y, begin, end, std::make_integer_sequence<int, kMaxRows>{});
    }
  }
}

xla::ffi::Error Product(xla::ffi::Buffer<xla::ffi::F32> x, xla::ffi::Buffer<xla::ffi::F32> w,
                        xla::ffi::ResultBuffer<xla::ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || xd[0] < 1 || xd[0] > kMaxRows ||
      wd[1] % kPiece != 0) {
    return xla::ffi::Error::InvalidArgument(
        "few_row_product: x must be [M, K] with 1 <= M <= 16 and w [K, N] with N a multiple "
        "of 16");
  }
  if (xd[1] == 0) {  // an empty sum: the sweep would leave y as it found it
    std::fill_n(y->typed_data(), xd[0] * wd[1], 0.0f);
  } else {
    FewRowProduct(x.typed_data(), xd[0], xd[1], w.typed_data(), wd[1], y->typed_data());
  }
  return xla::ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EaglepanguFewRowProduct, Product,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
