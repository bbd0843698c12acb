// Sparse bilinear products of multivectors (geoattn.algebra.kernels): c_k = Σ_e s_e a_i b_j over the
// entries e = (i, j, k, s) of one product's table (the geometric product, its gradients, a product
// into grade-path slots). What torch.compile otherwise builds from the generated per-blade Python,
// without its first-call tracing (seconds per kernel) and for any table at run time.
//
// Layouts: each operand is (M, width) rows with a row stride and a blade stride, so one kernel reads
// both memory orders: batch-major (row stride = width, blade stride 1) and blade by blade (row stride
// 1, blade stride ≥ M). Blade by blade, the rows may also come in runs of `inner` contiguous ones
// `outer` apart: a channel slice of the layers' blade-major stream, read where it lies.
//
// Rows go in blocks (kRows, or one run). The tables the build carries as constants (`fixed_block`)
// read a block's blades in place where its rows lie contiguous, else from a small buffer they are
// copied into (a transpose for batch-major rows); any other table runs its terms, grouped by output
// blade, over that buffer. The result goes back in the output's order.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "products_tables.h"

#include <algorithm>
#include <utility>
#include <cstdint>
#include <cstring>
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

// f(r, p, run) for each run of contiguous rows among rows m0 .. m0 + n of blade i: r the first row's
// place in the block, p that row's address in x, run how many follow it in x's run.
template <typename P, typename F>
inline void each_run(const Strided<P>& x, int64_t i, int64_t m0, int64_t n, F&& f) {
  for (int64_t r = 0, m = m0; r < n;) {
    const int64_t rem = m % x.inner, run = std::min(n - r, x.inner - rem);
    f(r, x.data + (m / x.inner) * x.outer + rem * x.row + i * x.blade, run);
    r += run, m += run;
  }
}

template <typename T>
inline void load(const Strided<const T>& x, int64_t m0, int64_t n, T* __restrict out) {
  if (x.blade == 1 && x.row == x.width && x.width == 8) return load_rows<8>(x.data + m0 * 8, n, out);
  if (x.blade == 1 && x.row == x.width && x.width == 16) return load_rows<16>(x.data + m0 * 16, n, out);
  for (int64_t i = 0; i < x.width; ++i) {
    T* dst = out + i * kRows;
    each_run(x, i, m0, n, [&](int64_t r, const T* src, int64_t run) {
      if (x.row == 1)
        std::copy(src, src + run, dst + r);
      else
        for (int64_t t = 0; t < run; ++t) dst[r + t] = src[t * x.row];
    });
    std::fill(dst + n, dst + kRows, T(0));  // the last block's padding rows
  }
}

template <typename T>
inline void store(const T* __restrict in, int64_t m0, int64_t n, const Strided<T>& x) {
  if (x.blade == 1 && x.row == x.width && x.width == 8) return store_rows<8>(in, n, x.data + m0 * 8);
  if (x.blade == 1 && x.row == x.width && x.width == 16) return store_rows<16>(in, n, x.data + m0 * 16);
  for (int64_t i = 0; i < x.width; ++i) {
    const T* src = in + i * kRows;
    each_run(x, i, m0, n, [&](int64_t r, T* dst, int64_t run) {
      if (x.row == 1)
        std::copy(src + r, src + r + run, dst);
      else
        for (int64_t t = 0; t < run; ++t) dst[t * x.row] = src[r + t];
    });
  }
}

constexpr int64_t kChunk = 16;  // rows per accumulator: one AVX-512 register of float32s

// kChunk rows as one GCC vector (lowered to the target's registers: one or two per chunk of float32s)
// (per type: GCC ignores vector_size on a dependent alias)
template <typename T>
struct Chunk;
template <>
struct Chunk<float> {
  typedef float type __attribute__((vector_size(kChunk * sizeof(float))));
};
template <>
struct Chunk<double> {
  typedef double type __attribute__((vector_size(kChunk * sizeof(double))));
};

template <typename V, typename T>
inline V load_chunk(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// The entries grouped by output blade: each output's terms summed in registers, one chunk of rows at
// a time, and written once.
template <typename T>
struct Terms {
  std::vector<int64_t> a, b, start;  // per term its blades' offsets in the block; per output its terms
  std::vector<T> sign;

  Terms(const int64_t* entries, int64_t n, int64_t outputs) : start(outputs + 1, 0) {
    for (int64_t e = 0; e < n; ++e) ++start[entries[4 * e + 2] + 1];
    for (int64_t k = 0; k < outputs; ++k) start[k + 1] += start[k];
    a.resize(n), b.resize(n), sign.resize(n);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t e = 0; e < n; ++e) {
      const int64_t t = next[entries[4 * e + 2]]++;
      a[t] = entries[4 * e] * kRows, b[t] = entries[4 * e + 1] * kRows, sign[t] = T(entries[4 * e + 3]);
    }
  }
};

// In the Clifford products (geometric, outer, contractions) and their gradients each output blade k
// takes blade i of a at most once, with the partner blade of b whose bit set is i's xor k's. In the
// algebra's blade order (by grade, then lexicographic: geoattn.algebra) for 8 and 16 blades those
// partners are constants here.
template <int W>
struct Blades;
template <>
struct Blades<8> {  // 1, e1, e2, e3, e12, e13, e23, e123
  static constexpr int mask[8] = {0, 1, 2, 4, 3, 5, 6, 7};
  static constexpr int index[8] = {0, 1, 2, 4, 3, 5, 6, 7};  // of a bit set
};
template <>
struct Blades<16> {  // 1, e1..e4, e12, e13, e14, e23, e24, e34, e123, e124, e134, e234, e1234
  static constexpr int mask[16] = {0, 1, 2, 4, 8, 3, 5, 9, 6, 10, 12, 7, 11, 13, 14, 15};
  static constexpr int index[16] = {0, 1, 2, 5, 3, 6, 8, 11, 4, 7, 9, 12, 10, 13, 14, 15};
};

template <int W>
constexpr int partner(int i, int k) {
  return Blades<W>::index[Blades<W>::mask[i] ^ Blades<W>::mask[k]];
}

// A table the build carries (products_tables.h: Cl(3)'s and PGA's geometric products and their
// gradients), its partners and signs constants: a's and b's chunks stay in registers, the compiler
// folds each term into one add or subtract and drops the absent ones. Its operands' and result's blades are pointers to kRows numbers each: into the block's buffer, or
// straight into the tensors where the block's rows lie contiguous there.
template <int W, int Id, typename T>
inline void fixed_block(const T* const* pa, const T* const* pb, T* const* pc, int64_t span) {
  using V = typename Chunk<T>::type;
  constexpr const signed char* sign = FixedTables<W>::sign[Id];
  for (int64_t v = 0; v < span; v += kChunk) {
    V a[W], b[W];
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) a[i] = load_chunk<V>(pa[i] + v), b[i] = load_chunk<V>(pb[i] + v);
#pragma GCC unroll 16
    for (int k = 0; k < W; ++k) {
      V acc = {};
#pragma GCC unroll 16
      for (int i = 0; i < W; ++i) {
        if (sign[i * W + k] > 0) acc += a[i] * b[partner<W>(i, k)];
        if (sign[i * W + k] < 0) acc -= a[i] * b[partner<W>(i, k)];
      }
      std::memcpy(pc[k] + v, &acc, sizeof(V));
    }
  }
}

// The block kernel of one carried table (Id), chosen at run time.
template <int W, typename T, int... Id>
inline void fixed_dispatch(int id, const T* const* pa, const T* const* pb, T* const* pc, int64_t span,
                           std::integer_sequence<int, Id...>) {
  ((id == Id ? fixed_block<W, Id>(pa, pb, pc, span) : void()), ...);
}

// Pointers to a block's rows of each blade (`span` of them, n real): into x where they lie contiguous
// there (a whole block inside one run), else into `buffer` after copying them there. Whether they
// are x's.
template <typename T, typename S>
inline bool blade_rows(const Strided<S>& x, int64_t m0, int64_t n, int64_t span, T* buffer, S** out, bool copy) {
  const int64_t rem = m0 % x.inner;
  if (x.row == 1 && n == span && rem + span <= x.inner) {
    for (int64_t i = 0; i < x.width; ++i) out[i] = x.data + (m0 / x.inner) * x.outer + rem + i * x.blade;
    return true;
  }
  if (copy) load(Strided<const T>{x.data, x.width, x.row, x.blade, x.inner, x.outer}, m0, n, buffer);
  for (int64_t i = 0; i < x.width; ++i) out[i] = buffer + i * kRows;
  return false;
}

// Which carried table has these signs, or -1.
template <int W, typename T>
int fixed_table(const std::vector<T>& signs) {
  if (signs.size() != static_cast<size_t>(W * W)) return -1;
  for (int id = 0; id < FixedTables<W>::count; ++id)
    if (std::equal(signs.begin(), signs.end(), FixedTables<W>::sign[id],
                   [](T s, signed char f) { return s == T(f); }))
      return id;
  return -1;
}

// The dense signs (W × W, [i][k]) of a table of that form, to find it among the carried ones; empty
// where the widths differ or are not 8 or 16, or an entry pairs other blades or repeats a pair.
template <typename T>
std::vector<T> dense_signs(const int64_t* entries, int64_t n, int64_t wa, int64_t wb, int64_t wc) {
  const int64_t w = wc;
  if (wa != w || wb != w || (w != 8 && w != 16)) return {};
  std::vector<T> sign(w * w, T(0));
  std::vector<bool> seen(w * w, false);
  for (int64_t e = 0; e < n; ++e) {
    const int64_t i = entries[4 * e], j = entries[4 * e + 1], k = entries[4 * e + 2];
    const int64_t expected = w == 8 ? partner<8>(i, k) : partner<16>(i, k);
    if (j != expected || seen[i * w + k]) return {};
    seen[i * w + k] = true;
    sign[i * w + k] = T(entries[4 * e + 3]);
  }
  return sign;
}

template <typename T>
void run(const Strided<const T>& a, const Strided<const T>& b, const Strided<T>& c, int64_t rows,
         const int64_t* entries, int64_t n_entries) {
  const Terms<T> terms(entries, n_entries, c.width);
  const std::vector<T> signs = dense_signs<T>(entries, n_entries, a.width, b.width, c.width);
  const int fixed8 = fixed_table<8>(signs), fixed16 = fixed_table<16>(signs);
  // blocks of kRows rows, or of one run where both operands come in equal runs of whole chunks
  const bool by_run = a.row == 1 && b.row == 1 && a.inner == b.inner && a.inner < kRows && a.inner % kChunk == 0;
  const int64_t size = by_run ? a.inner : kRows, blocks = (rows + size - 1) / size;
  at::parallel_for(0, blocks, kGrain * kRows / size, [&](int64_t lo, int64_t hi) {
    std::vector<T> buffer((a.width + b.width + c.width) * kRows);
    T* la = buffer.data();
    T* lb = la + a.width * kRows;
    T* lc = lb + b.width * kRows;
    for (int64_t block = lo; block < hi; ++block) {
      const int64_t m0 = block * size, n = std::min(size, rows - m0);
      if (fixed8 >= 0 || fixed16 >= 0) {
        const T* pa[16];
        const T* pb[16];
        T* pc[16];
        const int64_t span = (n + kChunk - 1) / kChunk * kChunk;
        blade_rows(a, m0, n, span, la, pa, true);
        blade_rows(b, m0, n, span, lb, pb, true);
        const bool direct = blade_rows(c, m0, n, span, lc, pc, false);
        if (fixed8 >= 0)
          fixed_dispatch<8>(fixed8, pa, pb, pc, span, std::make_integer_sequence<int, FixedTables<8>::count>());
        else
          fixed_dispatch<16>(fixed16, pa, pb, pc, span, std::make_integer_sequence<int, FixedTables<16>::count>());
        if (!direct) store(lc, m0, n, c);
        continue;
      }
      load(a, m0, n, la);  // any other table: its terms, grouped by output blade, from the buffers
      load(b, m0, n, lb);
      for (int64_t k = 0; k < c.width; ++k)
        for (int64_t v = 0; v < kRows; v += kChunk) {
          using V = typename Chunk<T>::type;
          V acc = {};
          for (int64_t t = terms.start[k]; t < terms.start[k + 1]; ++t)
            acc += terms.sign[t] * load_chunk<V>(la + terms.a[t] + v) * load_chunk<V>(lb + terms.b[t] + v);
          std::memcpy(lc + k * kRows + v, &acc, sizeof(V));
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
// U: const T for an operand read, T for an output written.
template <typename U>
inline Strided<U> operand(const torch::Tensor& x, bool blades_first, const char* name) {
  U* data = static_cast<U*>(x.data_ptr());
  if (!blades_first) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "bilinear_product: ", name, " must be contiguous (M, width)");
    return {data, x.size(1), x.size(1), 1, std::max<int64_t>(x.size(0), 1), 0};
  }
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "bilinear_product: ", name,
              " must be (width, G, inner), each run of inner rows contiguous");
  const int64_t inner = std::max<int64_t>(x.size(2), 1);
  TORCH_CHECK(x.size(1) < 2 || x.stride(1) >= inner, "bilinear_product: ", name, "'s runs overlap");
  return {data, x.size(0), 1, x.stride(0), inner, x.stride(1)};
}

}  // namespace products

namespace products {

// The checks both entry points share: dtypes, the table's form, the operands' shapes and rows, every
// entry inside the operands' and the result's widths. The rows.
inline int64_t checked_rows(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& entries,
                            int64_t out_dim, bool blades_first) {
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
  return rows;
}

}  // namespace products

// a, b: (M, width) batch-major or, with blades_first, (width, G, inner) blade by blade (rows
// m = g · inner + r; runs of inner rows contiguous, at any other strides); entries (E, 4) int64 rows
// (i, j, k, sign); the result (M, out_dim) or (out_dim, M), contiguous, a's dtype (float32/float64).
inline torch::Tensor bilinear_product(const torch::Tensor& a, const torch::Tensor& b,
                                      const torch::Tensor& entries, int64_t out_dim, bool blades_first) {
  const int64_t rows = products::checked_rows(a, b, entries, out_dim, blades_first);
  const int64_t* e = entries.data_ptr<int64_t>();
  auto c = blades_first ? torch::empty({out_dim, rows}, a.options()) : torch::empty({rows, out_dim}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "bilinear_product", [&] {
    using T = scalar_t;
    const auto sa = products::operand<const T>(a, blades_first, "a");
    const auto sb = products::operand<const T>(b, blades_first, "b");
    const int64_t row = blades_first ? 1 : out_dim, blade = blades_first ? rows : 1;
    const products::Strided<T> sc{c.data_ptr<T>(), out_dim, row, blade, std::max<int64_t>(rows, 1), 0};
    products::run<T>(sa, sb, sc, rows, e, entries.size(0));
  });
  return c;
}

// The same product blade by blade, written into `out` (out_dim, G, inner) runs where they lie (a channel
// slice of a larger blade-major tensor: a layer's gradient written where its concatenation would put
// it); out's rows those of a and b. Returns out.
inline torch::Tensor bilinear_product_into(const torch::Tensor& a, const torch::Tensor& b,
                                           const torch::Tensor& entries, torch::Tensor out) {
  TORCH_CHECK(out.scalar_type() == a.scalar_type(), "bilinear_product_into: out differs from a in dtype");
  TORCH_CHECK(out.dim() == 3, "bilinear_product_into: out must be (out_dim, G, inner) runs");
  const int64_t rows = products::checked_rows(a, b, entries, out.size(0), true);
  TORCH_CHECK(out.size(1) * out.size(2) == rows, "bilinear_product_into: out holds other rows than a and b");
  const int64_t* e = entries.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "bilinear_product_into", [&] {
    using T = scalar_t;
    const auto sa = products::operand<const T>(a, true, "a"), sb = products::operand<const T>(b, true, "b");
    products::run<T>(sa, sb, products::operand<T>(out, true, "out"), rows, e, entries.size(0));
  });
  return out;
}
