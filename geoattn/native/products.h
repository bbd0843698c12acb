// Sparse bilinear products of multivectors (geoattn.algebra.kernels): c_k = Σ_e s_e a_i b_j over the
// entries e = (i, j, k, s) of one product's table (the geometric product, its gradients, a product
// into grade-path slots). What torch.compile otherwise builds from the generated per-blade Python,
// without its first-call tracing (seconds per kernel) and for any table at run time.
//
// Layouts: each operand is (M, width) rows with a row stride and a blade stride, so one kernel reads
// both memory orders: batch-major (row stride = width, blade stride 1) and blade by blade (row stride
// 1, blade stride ≥ M). Blade by blade, the rows may also come in runs of `inner` contiguous ones
// `outer` apart: a channel slice of the layers' blade-major stream, read where it lies. Rows go in blocks of kRows: a block's blades are copied into a small buffer,
// one blade after the other (a transpose for batch-major rows), every entry is then one vector loop
// over the block's rows in that buffer, and the result goes back in the output's order.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace products {

constexpr int64_t kRows = 64;  // rows per block: the block's operands and result stay in L1
constexpr int64_t kGrain = 16;  // blocks per parallel task at least (1,024 rows)

// One operand or the result: element (row m, blade i) at
// data[(m / inner) * outer + (m % inner) * row + i * blade].
template <typename T>
struct Strided {
  T* data;
  int64_t width, row, blade, inner, outer;
};

// Batch-major rows of a fixed width (8: Cl(3), 16: PGA): the transpose with its trip counts known
template <int W, typename T>
inline void load_rows(const T* __restrict src, int64_t n, T* __restrict out) {
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < W; ++i) out[i * kRows + r] = src[r * W + i];
  for (int i = 0; i < W; ++i) std::fill(out + i * kRows + n, out + (i + 1) * kRows, T(0));
}

template <int W, typename T>
inline void store_rows(const T* __restrict in, int64_t n, T* __restrict dst) {
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < W; ++i) dst[r * W + i] = in[i * kRows + r];
}

template <typename T>
inline void load(const Strided<const T>& x, int64_t m0, int64_t n, T* __restrict out) {
  if (x.blade == 1 && x.row == x.width && x.width == 8) return load_rows<8>(x.data + m0 * 8, n, out);
  if (x.blade == 1 && x.row == x.width && x.width == 16) return load_rows<16>(x.data + m0 * 16, n, out);
  for (int64_t i = 0; i < x.width; ++i) {
    T* dst = out + i * kRows;
    for (int64_t r = 0, m = m0; r < n;) {  // run by run of contiguous rows
      const int64_t rem = m % x.inner, run = std::min(n - r, x.inner - rem);
      const T* src = x.data + (m / x.inner) * x.outer + rem * x.row + i * x.blade;
      for (int64_t t = 0; t < run; ++t) dst[r + t] = src[t * x.row];
      r += run, m += run;
    }
    std::fill(dst + n, dst + kRows, T(0));  // the last block's padding rows
  }
}

template <typename T>
inline void store(const T* __restrict in, int64_t m0, int64_t n, const Strided<T>& x) {
  if (x.blade == 1 && x.row == x.width && x.width == 8) return store_rows<8>(in, n, x.data + m0 * 8);
  if (x.blade == 1 && x.row == x.width && x.width == 16) return store_rows<16>(in, n, x.data + m0 * 16);
  for (int64_t i = 0; i < x.width; ++i) {
    const T* src = in + i * kRows;
    T* dst = x.data + m0 * x.row + i * x.blade;
    for (int64_t r = 0; r < n; ++r) dst[r * x.row] = src[r];
  }
}

template <typename T>
void run(const Strided<const T>& a, const Strided<const T>& b, const Strided<T>& c, int64_t rows,
         const int64_t* entries, int64_t n_entries) {
  std::vector<T> sign(n_entries);
  for (int64_t e = 0; e < n_entries; ++e) sign[e] = T(entries[4 * e + 3]);
  const int64_t blocks = (rows + kRows - 1) / kRows;
  at::parallel_for(0, blocks, kGrain, [&](int64_t lo, int64_t hi) {
    std::vector<T> buffer((a.width + b.width + c.width) * kRows);
    T* la = buffer.data();
    T* lb = la + a.width * kRows;
    T* lc = lb + b.width * kRows;
    for (int64_t block = lo; block < hi; ++block) {
      const int64_t m0 = block * kRows, n = std::min(kRows, rows - m0);
      load(a, m0, n, la);
      load(b, m0, n, lb);
      std::fill(lc, lc + c.width * kRows, T(0));
      for (int64_t e = 0; e < n_entries; ++e) {
        const T* __restrict x = la + entries[4 * e] * kRows;
        const T* __restrict y = lb + entries[4 * e + 1] * kRows;
        T* __restrict z = lc + entries[4 * e + 2] * kRows;
        const T s = sign[e];
#pragma omp simd
        for (int64_t r = 0; r < kRows; ++r) z[r] += s * x[r] * y[r];
      }
      store(lc, m0, n, c);
    }
  });
}

}  // namespace products

namespace products {

// An operand's rows and blades as a Strided: (M, width) contiguous rows, or blade by blade a
// (width, G, inner) view whose runs of `inner` rows are contiguous (M = G · inner rows, every run of
// one blade apart from those of the others).
template <typename T>
inline Strided<const T> operand(const torch::Tensor& x, bool blades_first, const char* name) {
  if (!blades_first) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "bilinear_product: ", name, " must be contiguous (M, width)");
    return {x.data_ptr<T>(), x.size(1), x.size(1), 1, std::max<int64_t>(x.size(0), 1), 0};
  }
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "bilinear_product: ", name,
              " must be (width, G, inner), each run of inner rows contiguous");
  const int64_t inner = std::max<int64_t>(x.size(2), 1);
  TORCH_CHECK(x.size(1) < 2 || x.stride(1) >= inner, "bilinear_product: ", name, "'s runs overlap");
  return {x.data_ptr<T>(), x.size(0), 1, x.stride(0), inner, x.stride(1)};
}

}  // namespace products

// a, b: (M, width) batch-major or, with blades_first, (width, G, inner) blade by blade (rows
// m = g · inner + r; runs of inner rows contiguous, at any other strides); entries (E, 4) int64 rows
// (i, j, k, sign); the result (M, out_dim) or (out_dim, M), contiguous, a's dtype (float32/float64).
inline torch::Tensor bilinear_product(const torch::Tensor& a, const torch::Tensor& b,
                                      const torch::Tensor& entries, int64_t out_dim, bool blades_first) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "bilinear_product: a and b differ in dtype");
  TORCH_CHECK(entries.scalar_type() == torch::kInt64 && entries.dim() == 2 && entries.size(1) == 4 &&
                  entries.is_contiguous(),
              "bilinear_product: entries must be contiguous int64 (E, 4)");
  auto rows_of = [&](const torch::Tensor& x) { return blades_first ? x.size(1) * x.size(2) : x.size(0); };
  TORCH_CHECK(a.dim() == (blades_first ? 3 : 2) && b.dim() == a.dim(), "bilinear_product: a and b must be ",
              blades_first ? "(width, G, inner)" : "(M, width)");
  const int64_t rows = rows_of(a);
  TORCH_CHECK(rows_of(b) == rows, "bilinear_product: a and b differ in rows");
  const int64_t width_a = blades_first ? a.size(0) : a.size(1), width_b = blades_first ? b.size(0) : b.size(1);
  const int64_t* e = entries.data_ptr<int64_t>();
  for (int64_t n = 0; n < entries.size(0); ++n)
    TORCH_CHECK(e[4 * n] >= 0 && e[4 * n] < width_a && e[4 * n + 1] >= 0 && e[4 * n + 1] < width_b &&
                    e[4 * n + 2] >= 0 && e[4 * n + 2] < out_dim,
                "bilinear_product: entry ", n, " names a blade outside the operands' widths");
  auto c = blades_first ? torch::empty({out_dim, rows}, a.options()) : torch::empty({rows, out_dim}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "bilinear_product", [&] {
    using T = scalar_t;
    const auto sa = products::operand<T>(a, blades_first, "a"), sb = products::operand<T>(b, blades_first, "b");
    const int64_t row = blades_first ? 1 : out_dim, blade = blades_first ? rows : 1;
    const products::Strided<T> sc{c.data_ptr<T>(), out_dim, row, blade, std::max<int64_t>(rows, 1), 0};
    products::run<T>(sa, sb, sc, rows, e, entries.size(0));
  });
  return c;
}
