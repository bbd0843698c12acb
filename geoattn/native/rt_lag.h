// RT-Filter attention on the CPU for precisions that depend on the lag i − j only (the default
// times): a fused flash-style forward and backward, one pass over the key blocks per query block.
//
// Per head, with a relative table ``lc[i − j + N − 1] = log c`` (shape (H, 2N − 1)), ``m²_j = e^{lm2_j}``:
//
//     bκ_ij    = β m²_j e^{−lc}          (flushed below tiny^¾, like the Python kernels)
//     logit_ij = lm2_j − lc + bκ_ij (⟨q_i, k_j⟩ − 1)
//     o_i      = Σ_j softmax_j(logit_ij) v_j
//
// The matmuls go to the BLAS that torch links (sgemm_/dgemm_); the elementwise work runs in loops
// the compiler vectorises (a branch-free exp for float32). The Python side (geoattn.attention.native)
// builds it (module.cpp) once per machine and falls back to the blockwise kernel when it cannot.
//
// Layouts: q, k (B, H, N, D), v and grad_out (B, H, N, Dv) with contiguous rows (any batch, head and
// row strides: a token-major projection is read in place); lm2 (B, H, N), table (H, 2N − 1) and
// beta (H,) contiguous. Outputs are contiguous, as documented on each function.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "fpmode.h"

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
}

namespace {

// Column-major C (m × n) = alpha op(A) op(B) + beta C, as the Fortran BLAS takes it.
void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
          int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
          int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Row-major products, written once here so that the kernels read like the maths:
// C (r × c) = A (r × k) · Bᵀ where B is (c × k).
template <typename T>
void mm_abt(int r, int c, int k, const T* a, int lda, const T* b, int ldb, T beta, T* out, int ldo) {
  gemm('T', 'N', c, r, k, T(1), b, ldb, a, lda, beta, out, ldo);
}
// C (r × c) += A (r × k) · B (k × c).
template <typename T>
void mm_ab(int r, int c, int k, const T* a, int lda, const T* b, int ldb, T beta, T* out, int ldo) {
  gemm('N', 'N', c, r, k, T(1), b, ldb, a, lda, beta, out, ldo);
}
// C (r × c) += Aᵀ · B where A is (k × r) and B is (k × c).
template <typename T>
void mm_atb(int r, int c, int k, const T* a, int lda, const T* b, int ldb, T beta, T* out, int ldo) {
  gemm('N', 'T', c, r, k, T(1), b, ldb, a, lda, beta, out, ldo);
}

// The elementwise work runs on lanes: kLanes float32s at a time as a GCC vector, and one at a time
// for the tail and for float64. Each formula below is written once, for any lane type L. The vector
// is as wide as the registers of the ISA the build targets (its -march, seen through the predefined
// macros): 16 floats with AVX-512, 8 with AVX2, 4 with NEON or SSE2; on any other target GCC lowers
// the same code to what the target has (plain C++, no intrinsics). A vector wider than the
// registers would be split into several by the compiler, which undoes the point of writing lanes.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr const char* kIsa = "AVX-512";
#elif defined(__AVX2__)
constexpr int kLanes = 8;
constexpr const char* kIsa = "AVX2";
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr const char* kIsa = "AVX";
#elif defined(__ARM_NEON)
constexpr int kLanes = 4;
constexpr const char* kIsa = "NEON";
#elif defined(__SSE2__)
constexpr int kLanes = 4;
constexpr const char* kIsa = "SSE2";
#else
constexpr int kLanes = 4;
constexpr const char* kIsa = "generic";
#endif
using vf = float __attribute__((vector_size(sizeof(float) * kLanes)));
using vi = int32_t __attribute__((vector_size(sizeof(int32_t) * kLanes)));
using Lanes = std::make_index_sequence<kLanes>;

template <typename L, typename T>
inline L load(const T* p) {
  if constexpr (std::is_same_v<L, vf>) {
    vf x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  } else {
    return *p;
  }
}
template <typename L, typename T>
inline void store(T* p, L x) {
  if constexpr (std::is_same_v<L, vf>) {
    std::memcpy(p, &x, sizeof(x));
  } else {
    *p = x;
  }
}
template <typename L, typename T>
inline L splat(T x) {
  if constexpr (std::is_same_v<L, vf>) {
    return vf{} + static_cast<float>(x);
  } else {
    return x;
  }
}

// |x| < tiny → 0: factors that would be subnormal change no sum, but slow every product they enter.
template <typename L>
inline L flush(L x, L tiny, L zero) {
  return (x < tiny && x > -tiny) ? zero : x;
}

// e^x without a call, so that it vectorises: Cody–Waite reduction by ln 2 and a degree-6 polynomial
// (relative error about 2 ulp); x below −87.3 (−inf included) gives 0, a weight the callers flush.
template <typename L>
inline L exp_lane(L x) {
  if constexpr (std::is_same_v<L, double>) {
    return std::exp(x);
  } else {
    const L lo = splat<L>(-87.3f), hi = splat<L>(88.3f), zero = splat<L>(0.0f);
    const auto under = x < lo;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const L t = x * 1.44269504088896341f + 0.5f;
    L n;
    int32_t ni_s = 0;
    vi ni_v{};
    if constexpr (std::is_same_v<L, vf>) {  // floor: truncate, then step down where it rounded up
      ni_v = __builtin_convertvector(t, vi);
      n = __builtin_convertvector(ni_v, vf);
      ni_v = n > t ? ni_v - 1 : ni_v;
      n = __builtin_convertvector(ni_v, vf);
    } else {
      n = std::floor(t);
      ni_s = static_cast<int32_t>(n);
    }
    L r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    L p = splat<L>(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    L scale;
    if constexpr (std::is_same_v<L, vf>) {
      const vi bits = (ni_v + 127) << 23;
      std::memcpy(&scale, &bits, sizeof(scale));
    } else {
      const int32_t bits = (ni_s + 127) << 23;
      std::memcpy(&scale, &bits, sizeof(scale));
    }
    return under ? zero : p * scale;
  }
}

// op over the lanes as a tree (halving the vector at each step) rather than a chain: it ends every
// row. The shuffles need GCC ≥ 12 (`__builtin_shufflevector`).
template <typename V, std::size_t... I>
inline auto lower_half(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, I...);
}
template <typename V, std::size_t... I>
inline auto upper_half(V v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (I + sizeof...(I))...);
}
template <typename V, typename Op>
inline float lane_reduce(V v, Op op) {
  constexpr std::size_t n = sizeof(V) / sizeof(float);
  static_assert(n >= 4 && (n & (n - 1)) == 0, "lanes: a power of two, at least 4");
  if constexpr (n == 4) {
    return op(op(v[0], v[2]), op(v[1], v[3]));
  } else {
    constexpr auto half = std::make_index_sequence<n / 2>{};
    return lane_reduce(op(lower_half(v, half), upper_half(v, half)), op);
  }
}

template <std::size_t... I>
inline vi iota_of(std::index_sequence<I...>) {
  return vi{static_cast<int32_t>(I)...};
}

// Which lanes of the vector at j lie before `width` (always true one value at a time), and x where
// they do, `other` where not.
template <typename L>
inline auto lanes_before(int j, int width) {
  if constexpr (std::is_same_v<L, vf>) {
    return (iota_of(Lanes{}) + j) < width;
  } else {
    return true;
  }
}
template <typename L, typename M>
inline L keep(M mask, L x, L other) {
  if constexpr (std::is_same_v<L, vf>) {
    return mask ? x : other;
  } else {
    return x;
  }
}

// acc = op(acc, f(j, L{}, mask)) over j < width: whole vectors of float32s first, then one at a time.
// The last vector may run past `width` up to `span` (the buffer's end), its lanes at j ≥ width marked
// false in `mask` for f to neutralise: a causal row's ragged end then costs one vector, not up to
// kLanes − 1 calls on single values.
template <typename T, typename F, typename Op>
inline T over_lanes(int width, int span, T init, Op op, F&& f) {
  T acc = init;
  int j = 0;
  if constexpr (std::is_same_v<T, float>) {
    vf vacc = splat<vf>(init);
    for (; j < width && j + kLanes <= span; j += kLanes) vacc = op(vacc, f(j, vf{}, lanes_before<vf>(j, width)));
    acc = op(acc, lane_reduce(vacc, op));
  }
  for (; j < width; ++j) acc = op(acc, f(j, T{}, true));
  return acc;
}

const auto add = [](auto a, auto b) { return a + b; };
const auto maximum = [](auto a, auto b) { return a > b ? a : b; };

template <typename T>
T tiny34() {
  return std::pow(std::numeric_limits<T>::min(), T(0.75));
}

// The per-row inputs of one (query row, key block) stretch: pointers shifted so that index j of
// the block reads key j's scalars and the table at lag i − j.
template <typename T>
struct Row {
  const T* lc;     // log c at (i, j), reversed table: rev[N − 1 − i + j]
  const T* invc;   // e^{−log c}, same indexing
  const T* lm2;    // log m²_j
  const T* bm2;    // β m²_j

  // β κ = β m²_j / c (flushed) and the logit, from the dot s, at key j.
  template <typename L>
  inline L beta_kappa(int j, T tiny) const {
    return flush(load<L>(bm2 + j) * load<L>(invc + j), splat<L>(tiny), splat<L>(T(0)));
  }
  template <typename L>
  inline L logit(int j, L s, L bk) const {
    return load<L>(lm2 + j) - load<L>(lc + j) + bk * (s - T(1));
  }
};

// Logits of one row stretch of `width` keys, from the dots in `s` (overwritten; up to `span` of it,
// −inf past `width`), and their max.
template <typename T>
T row_logits(T* s, int width, int span, const Row<T>& row, T tiny) {
  const T inf = std::numeric_limits<T>::infinity();
  return over_lanes<T>(width, span, -inf, maximum, [&](int j, auto lane, auto mask) {
    using L = decltype(lane);
    const L logit = keep(mask, row.logit(j, load<L>(s + j), row.template beta_kappa<L>(j, tiny)), splat<L>(-inf));
    store(s + j, logit);
    return logit;
  });
}

// A (B, H, N, ·) input whose rows are contiguous but whose batch, head and row strides are free:
// the token-major (B, N, H, D) layout of a fused projection is read where it lies. The matmuls take
// the row stride as their leading dimension.
template <typename T>
struct Rows {
  const T* p;
  int64_t h, sb, sh, sn;
  const T* at(int64_t x, int64_t i) const { return p + (x / h) * sb + (x % h) * sh + i * sn; }
  int ld() const { return static_cast<int>(sn); }
};

template <typename T>
Rows<T> rows_of(const torch::Tensor& t) {
  return {t.data_ptr<T>(), t.size(1), t.stride(0), t.stride(1), t.stride(2)};
}

template <typename T>
struct Tables {
  std::vector<T> lc, invc;  // (H, 2N − 1) reversed: entry N − 1 − (i − j)
};

template <typename T>
Tables<T> reversed_tables(const T* table, int64_t h, int64_t n) {
  const int64_t w = 2 * n - 1;
  Tables<T> t{std::vector<T>(h * w), std::vector<T>(h * w)};
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t x = 0; x < w; ++x) {
      const T v = table[hh * w + (w - 1 - x)];
      t.lc[hh * w + x] = v;
      t.invc[hh * w + x] = std::exp(-v);
    }
  return t;
}

// y = R(sign·θ) x on consecutive pairs, from the pairs' (cos θ, sin θ) in `turns` (x and y may alias):
// (x₀, x₁) → (cos·x₀ − sin·x₁, sin·x₀ + cos·x₁), as geoattn.algebra.rotation.rotate_pairs.
template <typename T>
inline void turn_pairs(const T* x, T* y, const T* turns, int64_t pairs, T sign) {
#pragma omp simd
  for (int64_t p = 0; p < pairs; ++p) {
    const T c = turns[2 * p], s = sign * turns[2 * p + 1], x0 = x[2 * p], x1 = x[2 * p + 1];
    y[2 * p] = c * x0 - s * x1;
    y[2 * p + 1] = s * x0 + c * x1;
  }
}

// What the attention reads of one head instance x: its q, k, v rows (each with its row stride, the
// matmuls' leading dimension), its keys' log m² (N,) and, where the source has them, m² itself (else
// null: e^{log m²}).
template <typename T>
struct HeadIn {
  const T *q, *k, *v, *lm2;
  int ldq, ldk, ldv;
  const T* m2 = nullptr;

  // β m²_j of the head's keys
  void scaled_m2(T beta, T* out, int64_t n) const {
    for (int64_t j = 0; j < n; ++j) out[j] = beta * (m2 ? m2[j] : std::exp(lm2[j]));
  }
};

// What the backward reads and writes of one head instance: ∂o's rows (common frame), the rowsums
// δ_i = ⟨∂o_i, o_i⟩ (N,), and the zeroed gradients ∂q, ∂k (N, D), ∂v (N, Dv), ∂log m² (N,).
template <typename T>
struct HeadGrad {
  const T *dout, *delta;
  int lddo;
  T *dq, *dk, *dv, *dlm2;
};

// The heads as they lie in memory (rt_lag_forward / rt_lag_backward): nothing to prepare, and the
// gradients go straight to the (B, H, N, ·) outputs.
template <typename T>
struct StoredHeads {
  Rows<T> q, k, v, dout;
  const T *lm2, *delta;
  T *dq, *dk, *dv, *dlm2;
  int64_t n, d, dv_;

  int64_t scratch() const { return 0; }
  HeadIn<T> inputs(int64_t x, T*) const {
    return {q.at(x, 0), k.at(x, 0), v.at(x, 0), lm2 + x * n, q.ld(), k.ld(), v.ld()};
  }
  HeadGrad<T> grads(int64_t x, T*) const {
    return {dout.at(x, 0), delta + x * n, dout.ld(), dq + x * n * d, dk + x * n * d, dv + x * n * dv_, dlm2 + x * n};
  }
  void finish(int64_t, const HeadGrad<T>&) const {}
};

// q, k, v (B, H, N, ·) and log m² (B, H, N) as the forward reads them; the backward adds ∂o, δ and
// the gradients' outputs.
template <typename T>
StoredHeads<T> stored_heads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& lm2) {
  StoredHeads<T> heads{};
  heads.q = rows_of<T>(q), heads.k = rows_of<T>(k), heads.v = rows_of<T>(v), heads.lm2 = lm2.data_ptr<T>();
  heads.n = q.size(2), heads.d = q.size(3), heads.dv_ = v.size(3);
  return heads;
}

// Heads come from `heads.inputs(x, scratch)`: a per-thread scratch of `heads.scratch()` values that
// the source may fill (the fused entry of rt_qkv.h normalises a head's rows into it), read again only
// when the head changes. Work items are (head instance, query block), consecutive per thread.
template <typename T, typename Heads>
void forward_impl(const Heads& heads, const T* table, const T* beta, T* out, T* lse, int64_t bh, int64_t h,
                  int64_t n, int64_t d, int64_t dv, bool causal, int64_t bq, int64_t bk,
                  const T* turns = nullptr) {
  const auto tabs = reversed_tables(table, h, n);
  const int64_t w = 2 * n - 1, nqb = (n + bq - 1) / bq;
  const T tiny = tiny34<T>(), inf = std::numeric_limits<T>::infinity();
  at::parallel_for(0, bh * nqb, 1, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    std::vector<T> s(bq * bk), acc(bq * dv), mx(bq), sum(bq), bm2(n), scratch(heads.scratch());
    HeadIn<T> in{};
    int64_t last_head = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t x = task / nqb, q0 = (task % nqb) * bq, q1 = std::min(q0 + bq, n);
      const int rows = static_cast<int>(q1 - q0), hh = static_cast<int>(x % h);
      if (x != last_head) {  // the head's rows, and β m²_j of its keys
        in = heads.inputs(x, scratch.data());
        in.scaled_m2(beta[hh], bm2.data(), n);
        last_head = x;
      }
      std::fill(acc.begin(), acc.end(), T(0));
      std::fill(mx.begin(), mx.end(), -inf);
      std::fill(sum.begin(), sum.end(), T(0));
      const int64_t key_end = causal ? q1 : n;
      for (int64_t k0 = 0; k0 < key_end; k0 += bk) {
        const int cols = static_cast<int>(std::min(k0 + bk, key_end) - k0);
        mm_abt<T>(rows, cols, d, in.q + q0 * in.ldq, in.ldq, in.k + k0 * in.ldk, in.ldk, T(0), s.data(), cols);
        for (int r = 0; r < rows; ++r) {
          const int64_t i = q0 + r;
          T* sr = s.data() + r * cols;
          const int width = causal ? static_cast<int>(std::clamp<int64_t>(i + 1 - k0, 0, cols)) : cols;
          const int64_t off = hh * w + (n - 1 - i + k0);
          const Row<T> row{tabs.lc.data() + off, tabs.invc.data() + off, in.lm2 + k0, bm2.data() + k0};
          const T row_max = width > 0 ? row_logits(sr, width, cols, row, tiny) : -inf;
          const T new_max = std::max(mx[r], row_max);
          if (new_max == -inf) {  // nothing seen yet in this row
            std::fill(sr, sr + cols, T(0));
            continue;
          }
          const T psum = over_lanes<T>(width, cols, T(0), add, [&](int j, auto lane, auto) {
            using L = decltype(lane);  // −inf past width: p = 0 there
            const L p = flush(exp_lane(load<L>(sr + j) - new_max), splat<L>(tiny), splat<L>(T(0)));
            store(sr + j, p);
            return p;
          });
          std::fill(sr + width, sr + cols, T(0));
          const T rescale = mx[r] == -inf ? T(0) : exp_lane(mx[r] - new_max);
          if (rescale != T(1)) {
            T* ar = acc.data() + r * dv;
            for (int64_t c = 0; c < dv; ++c) ar[c] *= rescale;
          }
          sum[r] = sum[r] * rescale + psum;
          mx[r] = new_max;
        }
        mm_ab<T>(rows, dv, cols, s.data(), cols, in.v + k0 * in.ldv, in.ldv, T(1), acc.data(), dv);
      }
      for (int r = 0; r < rows; ++r) {
        T* o = out + (x * n + q0 + r) * dv;
        const T inv = T(1) / sum[r];
        for (int64_t c = 0; c < dv; ++c) o[c] = acc[r * dv + c] * inv;
        if (turns) turn_pairs(o, o, turns + (hh * n + q0 + r) * dv, dv / 2, T(1));  // to the query's frame
        lse[x * n + q0 + r] = mx[r] + std::log(sum[r]);
      }
    }
  });
}

// One work item per head instance x: `heads.inputs` and `heads.grads` give its rows and zeroed
// gradients (in a per-thread scratch of `heads.scratch()` values), `heads.finish` takes the gradients
// on once the head is done. dtab (B·H, 2N − 1, reversed lag order) and dbeta (B·H,) get one row per
// head instance: no races.
template <typename T, typename Heads>
void backward_impl(const Heads& heads, const T* table, const T* beta, const T* lse, T* dtab, T* dbeta, int64_t bh,
                   int64_t h, int64_t n, int64_t d, int64_t dv, bool causal, int64_t bq, int64_t bk) {
  const auto tabs = reversed_tables(table, h, n);
  const int64_t w = 2 * n - 1;
  const T tiny = tiny34<T>();
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    std::vector<T> s(bq * bk), dp(bq * bk), bm2(n), scratch(heads.scratch());
    for (int64_t x = begin; x < end; ++x) {
      const int hh = static_cast<int>(x % h);
      const HeadIn<T> in = heads.inputs(x, scratch.data());
      const HeadGrad<T> hg = heads.grads(x, scratch.data());
      T* dtabx = dtab + x * w;
      T through_kappa = 0;
      in.scaled_m2(beta[hh], bm2.data(), n);
      for (int64_t q0 = 0; q0 < n; q0 += bq) {
        const int64_t q1 = std::min(q0 + bq, n);
        const int rows = static_cast<int>(q1 - q0);
        const int64_t key_end = causal ? q1 : n;
        const T* qb = in.q + q0 * in.ldq;
        const T* dob = hg.dout + q0 * hg.lddo;
        for (int64_t k0 = 0; k0 < key_end; k0 += bk) {
          const int cols = static_cast<int>(std::min(k0 + bk, key_end) - k0);
          const T* kb = in.k + k0 * in.ldk;
          const T* vb = in.v + k0 * in.ldv;
          mm_abt<T>(rows, cols, d, qb, in.ldq, kb, in.ldk, T(0), s.data(), cols);
          mm_abt<T>(rows, cols, dv, dob, hg.lddo, vb, in.ldv, T(0), dp.data(), cols);
          for (int r = 0; r < rows; ++r) {
            const int64_t i = q0 + r;
            T* sr = s.data() + r * cols;  // dots in, P out
            T* dr = dp.data() + r * cols;  // dP in, ∂/∂dot out
            const int width = causal ? static_cast<int>(std::clamp<int64_t>(i + 1 - k0, 0, cols)) : cols;
            const int64_t off = hh * w + (n - 1 - i + k0);
            const Row<T> row{tabs.lc.data() + off, tabs.invc.data() + off, in.lm2 + k0, bm2.data() + k0};
            T* gtab = dtabx + (n - 1 - i + k0);
            T* gm2 = hg.dlm2 + k0;
            const T li = lse[x * n + i], de = hg.delta[i];
            const T tk = over_lanes<T>(width, cols, T(0), add, [&](int j, auto lane, auto mask) {
              using L = decltype(lane);  // past width p = 0, and with it every gradient term
              const L tn = splat<L>(tiny), zero = splat<L>(T(0));
              const L bk = row.template beta_kappa<L>(j, tiny), s_ = load<L>(sr + j);
              const L p = keep(mask, flush(exp_lane(row.logit(j, s_, bk) - li), tn, zero), zero);
              const L ds = flush(p * (load<L>(dr + j) - de), tn, zero);
              const L ddot = flush(ds * bk, tn, zero);
              const L a = flush(ddot * (s_ - T(1)), tn, zero);  // the part through κ
              const L g = ds + a;                                // the total through log κ
              store(gm2 + j, load<L>(gm2 + j) + g);
              store(gtab + j, load<L>(gtab + j) - g);
              store(sr + j, p);
              store(dr + j, ddot);
              return a;
            });
            through_kappa += tk;
            std::fill(sr + width, sr + cols, T(0));
            std::fill(dr + width, dr + cols, T(0));
          }
          mm_atb<T>(cols, dv, rows, s.data(), cols, dob, hg.lddo, T(1), hg.dv + k0 * dv, dv);
          mm_ab<T>(rows, d, cols, dp.data(), cols, kb, in.ldk, T(1), hg.dq + q0 * d, d);
          mm_atb<T>(cols, d, rows, dp.data(), cols, qb, in.ldq, T(1), hg.dk + k0 * d, d);
        }
      }
      dbeta[x] = through_kappa / beta[hh];
      heads.finish(x, hg);
    }
  });
}

void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == dim, name,
              ": expected a contiguous CPU tensor with ", dim, " dims, got ", t.sizes());
}

// q, k, v, grad_out: (B, H, N, ·) with unit stride along the last axis (any other strides).
void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 4 && t.stride(3) == 1 && t.stride(2) >= t.size(3), name,
              ": expected a CPU tensor (B, H, N, D) with rows contiguous, got sizes ", t.sizes(),
              " strides ", t.strides());
}

// The per-head-instance gradients of the backward (dtab in reversed lag order) → the table's
// gradient (H, 2N − 1) in its own order (entry i − j + N − 1) and β's (H,), summed over the batch in
// a fixed order (plain loops: a handful of tensor operations here cost more than the sums at small N).
template <typename T>
std::pair<torch::Tensor, torch::Tensor> parameter_grads(const T* dtab, const T* dbeta, int64_t b, int64_t h,
                                                        int64_t n, const torch::TensorOptions& options) {
  const int64_t w = 2 * n - 1;
  auto table = torch::zeros({h, w}, options), beta = torch::zeros({h}, options);
  T* gt = table.data_ptr<T>();
  T* gb = beta.data_ptr<T>();
  for (int64_t bb = 0; bb < b; ++bb)
    for (int64_t hh = 0; hh < h; ++hh) {
      const T* row = dtab + (bb * h + hh) * w;
      for (int64_t e = 0; e < w; ++e) gt[hh * w + e] += row[w - 1 - e];
      gb[hh] += dbeta[bb * h + hh];
    }
  return {table, beta};
}

}  // namespace

// q, k (B, H, N, D), v (B, H, N, Dv), lm2 (B, H, N), table (H, 2N − 1), beta (H,) →
// (out (B, H, N, Dv), lse (B, H, N)).
inline std::vector<torch::Tensor> rt_lag_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                          torch::Tensor lm2, torch::Tensor table, torch::Tensor beta,
                                          bool causal, int64_t bq, int64_t bk) {
  check_rows(q, "q"), check_rows(k, "k"), check_rows(v, "v"), check(lm2, "log_m2", 3);
  check(table, "table", 2), check(beta, "beta", 1);
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), d = q.size(3), dv = v.size(3);
  TORCH_CHECK(table.size(0) == h && table.size(1) == 2 * n - 1, "table: expected (H, 2N - 1)");
  auto out = torch::empty({b, h, n, dv}, v.options());
  auto lse = torch::empty({b, h, n}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rt_lag_forward", [&] {
    const auto heads = stored_heads<scalar_t>(q, k, v, lm2);
    forward_impl<scalar_t>(heads, table.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                           lse.data_ptr<scalar_t>(), b * h, h, n, d, dv, causal, bq, bk);
  });
  return {out, lse};
}

// The backward from the forward's out and lse and grad_out (B, H, N, Dv) →
// (dq, dk, dv, d log_m2 (B, H, N), d table (H, 2N − 1), d beta (H,)).
inline std::vector<torch::Tensor> rt_lag_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                           torch::Tensor lm2, torch::Tensor table, torch::Tensor beta,
                                           torch::Tensor out, torch::Tensor lse, torch::Tensor grad_out,
                                           bool causal, int64_t bq, int64_t bk) {
  check_rows(q, "q"), check_rows(k, "k"), check_rows(v, "v"), check(lm2, "log_m2", 3);
  check(table, "table", 2), check(beta, "beta", 1), check(out, "out", 4), check(lse, "lse", 3);
  check_rows(grad_out, "grad_out");
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), d = q.size(3), dv = v.size(3);
  auto delta = (grad_out * out).sum(-1).contiguous();  // (B, H, N), rowsum(dO ⊙ O)
  // contiguous, whatever the inputs' strides (zeros_like would keep a token-major layout)
  auto dq = torch::zeros(q.sizes(), q.options()), dk = torch::zeros(k.sizes(), k.options());
  auto dvt = torch::zeros(v.sizes(), v.options());
  auto dlm2 = torch::zeros_like(lm2);
  auto dtab = torch::zeros({b * h, 2 * n - 1}, q.options());  // reversed lag order per head instance
  auto dbeta = torch::empty({b * h}, q.options());
  std::pair<torch::Tensor, torch::Tensor> param_grads;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "rt_lag_backward", [&] {
    auto heads = stored_heads<scalar_t>(q, k, v, lm2);
    heads.dout = rows_of<scalar_t>(grad_out), heads.delta = delta.data_ptr<scalar_t>();
    heads.dq = dq.data_ptr<scalar_t>(), heads.dk = dk.data_ptr<scalar_t>(), heads.dv = dvt.data_ptr<scalar_t>();
    heads.dlm2 = dlm2.data_ptr<scalar_t>();
    backward_impl<scalar_t>(heads, table.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                            dtab.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>(), b * h, h, n, d, dv, causal, bq,
                            bk);
    param_grads = parameter_grads(dtab.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>(), b, h, n, q.options());
  });
  return {dq, dk, dvt, dlm2, param_grads.first, param_grads.second};
}
