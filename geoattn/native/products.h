// Sparse bilinear products of multivectors (geoattn.algebra.kernels): c_k = Σ_e s_e a_i b_j over the
// entries e = (i, j, k, s) of one product's table (the geometric product, its gradients, a product
// into grade-path slots). What torch.compile otherwise builds from the generated per-blade Python,
// without its first-call tracing (seconds per kernel) and for any table at run time.
//
// Layouts: each operand is (M, width) rows with a row stride and a blade stride, so one kernel reads
// both memory orders: batch-major (row stride = width, blade stride 1) and blade by blade (row stride
// 1, blade stride M). Rows go in blocks of kRows: a block's blades are copied into a small buffer,
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

// One operand or the result: element (row m, blade i) at data[m * row + i * blade].
template <typename T>
struct Strided {
  T* data;
  int64_t width, row, blade;
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
    const T* src = x.data + m0 * x.row + i * x.blade;
    T* dst = out + i * kRows;
    for (int64_t r = 0; r < n; ++r) dst[r] = src[r * x.row];
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

// a, b: (M, width) batch-major or, with blades_first, (width, M) blade by blade (each blade's M
// numbers contiguous, blades at any stride); entries (E, 4) int64 rows (i, j, k, sign); the result
// (M, out_dim) or (out_dim, M), contiguous, a's dtype (float32 or float64).
inline torch::Tensor bilinear_product(const torch::Tensor& a, const torch::Tensor& b,
                                      const torch::Tensor& entries, int64_t out_dim, bool blades_first) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "bilinear_product: a and b must be 2-D");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "bilinear_product: a and b differ in dtype");
  TORCH_CHECK(entries.scalar_type() == torch::kInt64 && entries.dim() == 2 && entries.size(1) == 4 &&
                  entries.is_contiguous(),
              "bilinear_product: entries must be contiguous int64 (E, 4)");
  const int64_t rows = blades_first ? a.size(1) : a.size(0);
  TORCH_CHECK((blades_first ? b.size(1) : b.size(0)) == rows, "bilinear_product: a and b differ in rows");
  const int64_t mdim = blades_first ? 1 : 0, bdim = 1 - mdim;
  TORCH_CHECK(a.stride(mdim) == (blades_first ? 1 : a.size(1)) && a.stride(bdim) >= (blades_first ? rows : 1),
              "bilinear_product: a's layout");
  TORCH_CHECK(b.stride(mdim) == (blades_first ? 1 : b.size(1)) && b.stride(bdim) >= (blades_first ? rows : 1),
              "bilinear_product: b's layout");
  const int64_t* e = entries.data_ptr<int64_t>();
  for (int64_t n = 0; n < entries.size(0); ++n)
    TORCH_CHECK(e[4 * n] >= 0 && e[4 * n] < a.size(bdim) && e[4 * n + 1] >= 0 && e[4 * n + 1] < b.size(bdim) &&
                    e[4 * n + 2] >= 0 && e[4 * n + 2] < out_dim,
                "bilinear_product: entry ", n, " names a blade outside the operands' widths");
  auto c = blades_first ? torch::empty({out_dim, rows}, a.options()) : torch::empty({rows, out_dim}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "bilinear_product", [&] {
    using T = scalar_t;
    const products::Strided<const T> sa{a.data_ptr<T>(), a.size(bdim), a.stride(mdim), a.stride(bdim)};
    const products::Strided<const T> sb{b.data_ptr<T>(), b.size(bdim), b.stride(mdim), b.stride(bdim)};
    const products::Strided<T> sc{c.data_ptr<T>(), out_dim, c.stride(mdim), c.stride(bdim)};
    products::run<T>(sa, sb, sc, rows, entries.data_ptr<int64_t>(), entries.size(0));
  });
  return c;
}
