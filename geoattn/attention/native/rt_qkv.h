// RT-Filter attention from the fused projection, on the CPU: the normalisation of q, k (through the
// learned metric) and v, the key magnitudes, the rotation into the common frame, the attention of
// rt_lag.h and the rotation of the output back into each query's frame, in one call each way.
//
// In Python (geoattn.attention.rt_kernel) these are separate passes over (B, N, 3, H, D) around the
// kernel: `_prepare` (normalise, rotate by −θ, lay out head-major), then `_rotate` (by +θ) of the
// output, forward and backward. Here a token's three rows are normalised and turned while in cache,
// the output is turned as it is written, and the backward recomputes the units from qkv instead of
// keeping a second copy of it.
//
// Per token i, head h, with y = x ⊙ metric for q and k (x for v), θ_ip = i·ω_hp:
//
//     log m²_i = log max(key_scale² |k_i|², tiny)       (0 without magnitudes)
//     û_i      = R(−θ_i) y_i / max(|y_i|, 1e-12)        (v as it is without normalize_values)
//     o_i      = R(+θ_i) Σ_j softmax_j(logit_ij) v̂_j     (rt_lag.h on the units)
//
// Layouts: qkv (B, N, 3, H, D) contiguous, metric (H, D) or empty, turns (H, N, D/2, 2) the (cos θ,
// sin θ) of every head, token and pair, or empty (no rotation); the lag table (H, 2N − 1) and beta
// (H,) as in rt_lag.h.

#pragma once

#include "rt_lag.h"

namespace {

constexpr double kUnitEps2 = 1e-24;  // |y|² below this counts as 1e-24 (rt_kernel._EPS2)

// What the forward and the backward share: shapes, switches and the read-only inputs.
template <typename T>
struct Qkv {
  const T* qkv;
  const T* metric;  // (H, D) or null
  const T* turns;   // (H, N, D/2, 2) or null (no rotation)
  int64_t b, n, h, d;
  bool magnitudes, normalize_values;
  T key_scale2;

  const T* row(int64_t token, int part, int64_t head) const { return qkv + ((token * 3 + part) * h + head) * d; }
  const T* scale(int part, int64_t head) const { return metric && part < 2 ? metric + head * d : nullptr; }
  const T* turn(int64_t head, int64_t i) const { return turns ? turns + (head * n + i) * d : nullptr; }
  bool unit(int part) const { return part < 2 || normalize_values; }
  // unit-layout offset of (part, batch, head, token): (3, B, H, N, D)
  int64_t at(int part, int64_t bb, int64_t head, int64_t i) const {
    return (((part * b + bb) * h + head) * n + i) * d;
  }
  Rows<T> rows(const T* units, int part) const { return {units + part * b * h * n * d, h, h * n * d, n * d, d}; }
};

// y = x ⊙ scale (or x) into `y`; returns (|y|², |x|²).
template <typename T>
inline std::pair<T, T> scaled(const T* __restrict__ x, const T* __restrict__ scale, T* __restrict__ y, int64_t d) {
  T norm2 = 0, raw2 = 0;
  if (scale) {
#pragma omp simd reduction(+ : norm2, raw2)
    for (int64_t c = 0; c < d; ++c) {
      const T v = x[c] * scale[c];
      y[c] = v;
      norm2 += v * v;
      raw2 += x[c] * x[c];
    }
    return {norm2, raw2};
  }
#pragma omp simd reduction(+ : norm2)
  for (int64_t c = 0; c < d; ++c) {
    y[c] = x[c];
    norm2 += x[c] * x[c];
  }
  return {norm2, norm2};
}

template <typename T>
inline T inverse_norm(T norm2, bool unit) {
  return unit ? T(1) / std::sqrt(std::max(norm2, static_cast<T>(kUnitEps2))) : T(1);
}

// qkv → units (3, B, H, N, D) in the common frame and log m² (B, H, N).
template <typename T>
void prepare_forward(const Qkv<T>& s, T* units, T* lm2) {
  const T tiny = std::numeric_limits<T>::min();
  at::parallel_for(0, s.b * s.n, 8, [&](int64_t begin, int64_t end) {
    std::vector<T> y(s.d);
    for (int64_t token = begin; token < end; ++token) {
      const int64_t bb = token / s.n, i = token % s.n;
      for (int part = 0; part < 3; ++part)
        for (int64_t hh = 0; hh < s.h; ++hh) {
          const auto [norm2, raw2] = scaled(s.row(token, part, hh), s.scale(part, hh), y.data(), s.d);
          if (part == 1)
            lm2[(bb * s.h + hh) * s.n + i] = s.magnitudes ? std::log(std::max(raw2 * s.key_scale2, tiny)) : T(0);
          const T inv = inverse_norm(norm2, s.unit(part));
#pragma omp simd
          for (int64_t c = 0; c < s.d; ++c) y[c] *= inv;
          T* u = units + s.at(part, bb, hh, i);
          if (s.turns)
            turn_pairs(y.data(), u, s.turn(hh, i), s.d / 2, T(-1));
          else
            std::copy(y.begin(), y.end(), u);
        }
    }
  });
}

// The gradients of the units (3, B, H, N, D, common frame) and of log m² (B, H, N, or null) →
// ∂qkv (B, N, 3, H, D) and, with a metric, ∂metric (H, D). Per row, with u = y/|y|:
// ∂y = (∂u − ⟨∂u, u⟩ u)/|y| (no radial part at the clamp), ∂x = ∂y ⊙ metric, ∂metric += ∂y ⊙ x, and
// for keys ∂x += 2 ∂log m² x/|x|² (none where the magnitude sits at the clamp).
template <typename T>
void prepare_backward(const Qkv<T>& s, const T* gunits, const T* glm2, T* gqkv, T* gmetric) {
  const T tiny = std::numeric_limits<T>::min();
  const int64_t tokens = s.b * s.n, hd = s.h * s.d;
  // ∂metric summed per fixed chunk of tokens, then over the chunks: no races, and the same sums
  // whatever the number of threads
  const int64_t chunks = gmetric ? std::min<int64_t>(tokens, 64) : 1;
  std::vector<T> partial(gmetric ? chunks * hd : 0, T(0));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> y(s.d), g(s.d);
    for (int64_t chunk = begin; chunk < end; ++chunk)
      for (int64_t token = chunk * tokens / chunks; token < (chunk + 1) * tokens / chunks; ++token) {
        const int64_t bb = token / s.n, i = token % s.n;
        for (int part = 0; part < 3; ++part)
          for (int64_t hh = 0; hh < s.h; ++hh) {
            const T* __restrict__ x = s.row(token, part, hh);
            const T* __restrict__ scale = s.scale(part, hh);
            const auto [norm2, raw2] = scaled(x, scale, y.data(), s.d);
            const T inv = inverse_norm(norm2, s.unit(part));
            const T* gu = gunits + s.at(part, bb, hh, i);
            if (s.turns)
              turn_pairs(gu, g.data(), s.turn(hh, i), s.d / 2, T(1));
            else
              std::copy(gu, gu + s.d, g.data());
            const T* __restrict__ yr = y.data();
            const T* __restrict__ gr = g.data();
            T along = 0;
            if (s.unit(part) && norm2 > static_cast<T>(kUnitEps2)) {
#pragma omp simd reduction(+ : along)
              for (int64_t c = 0; c < s.d; ++c) along += gr[c] * yr[c];
            }
            along *= inv * inv;  // ⟨∂u, u⟩ / |y|, applied to y = |y| u
            T* __restrict__ gx = gqkv + ((token * 3 + part) * s.h + hh) * s.d;
            if (scale) {
              T* __restrict__ acc = partial.data() + chunk * hd + hh * s.d;
#pragma omp simd
              for (int64_t c = 0; c < s.d; ++c) {
                const T gy = (gr[c] - along * yr[c]) * inv;
                gx[c] = gy * scale[c];
                acc[c] += gy * x[c];
              }
            } else {
#pragma omp simd
              for (int64_t c = 0; c < s.d; ++c) gx[c] = (gr[c] - along * yr[c]) * inv;
            }
            if (part == 1 && glm2 && raw2 * s.key_scale2 >= tiny) {
              const T f = 2 * glm2[(bb * s.h + hh) * s.n + i] / raw2;
#pragma omp simd
              for (int64_t c = 0; c < s.d; ++c) gx[c] += f * x[c];
            }
          }
      }
  });
  if (gmetric)
    for (int64_t e = 0; e < hd; ++e) {
      double total = 0;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) total += partial[chunk * hd + e];
      gmetric[e] = static_cast<T>(total);
    }
}

template <typename T>
Qkv<T> qkv_inputs(const torch::Tensor& qkv, const torch::Tensor& metric, const torch::Tensor& turns,
                  bool magnitudes, double key_scale, bool normalize_values) {
  return {qkv.data_ptr<T>(),
          metric.numel() ? metric.data_ptr<T>() : nullptr,
          turns.numel() ? turns.data_ptr<T>() : nullptr,
          qkv.size(0),
          qkv.size(1),
          qkv.size(3),
          qkv.size(4),
          magnitudes,
          normalize_values,
          static_cast<T>(key_scale * key_scale)};
}

void check_qkv(const torch::Tensor& qkv, const torch::Tensor& metric, const torch::Tensor& turns) {
  check(qkv, "qkv", 5);
  TORCH_CHECK(qkv.size(2) == 3 && qkv.size(4) % 2 == 0, "qkv: expected (B, N, 3, H, D) with D even, got ",
              qkv.sizes());
  const int64_t n = qkv.size(1), h = qkv.size(3), d = qkv.size(4);
  TORCH_CHECK(metric.numel() == 0 || (metric.is_contiguous() && metric.sizes() == torch::IntArrayRef({h, d})),
              "metric: expected a contiguous (H, D) tensor or an empty one, got ", metric.sizes());
  TORCH_CHECK(turns.numel() == 0 || (turns.is_contiguous() && turns.sizes() == torch::IntArrayRef({h, n, d / 2, 2})),
              "turns: expected a contiguous (H, N, D/2, 2) tensor or an empty one, got ", turns.sizes());
}

}  // namespace

// qkv (B, N, 3, H, D), metric (H, D) | empty, turns (H, N, D/2, 2) | empty, the key scale (used when
// `magnitudes`), the lag table (H, 2N − 1) and beta (H,) → (out (B, H, N, D) in each query's frame,
// lse (B, H, N)).
inline std::vector<torch::Tensor> rt_qkv_forward(torch::Tensor qkv, torch::Tensor metric, torch::Tensor turns,
                                                 bool magnitudes, double key_scale, bool normalize_values,
                                                 torch::Tensor table, torch::Tensor beta, bool causal, int64_t bq,
                                                 int64_t bk) {
  check_qkv(qkv, metric, turns), check(table, "table", 2), check(beta, "beta", 1);
  const int64_t b = qkv.size(0), n = qkv.size(1), h = qkv.size(3), d = qkv.size(4);
  TORCH_CHECK(table.size(0) == h && table.size(1) == 2 * n - 1, "table: expected (H, 2N - 1)");
  auto units = torch::empty({3, b, h, n, d}, qkv.options());
  auto lm2 = torch::empty({b, h, n}, qkv.options());
  auto out = torch::empty({b, h, n, d}, qkv.options());
  auto lse = torch::empty({b, h, n}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "rt_qkv_forward", [&] {
    const auto s = qkv_inputs<scalar_t>(qkv, metric, turns, magnitudes, key_scale, normalize_values);
    scalar_t* u = units.data_ptr<scalar_t>();
    prepare_forward(s, u, lm2.data_ptr<scalar_t>());
    forward_impl<scalar_t>(s.rows(u, 0), s.rows(u, 1), s.rows(u, 2), lm2.data_ptr<scalar_t>(),
                           table.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                           lse.data_ptr<scalar_t>(), b * h, h, n, d, d, causal, bq, bk, s.turns);
  });
  return {out, lse};
}

// The backward from the forward's out and lse and grad_out (B, H, N, D, rows contiguous) →
// (∂qkv (B, N, 3, H, D), ∂metric (H, D) | empty, ∂table (H, 2N − 1), ∂beta (H,)).
inline std::vector<torch::Tensor> rt_qkv_backward(torch::Tensor qkv, torch::Tensor metric, torch::Tensor turns,
                                                  bool magnitudes, double key_scale, bool normalize_values,
                                                  torch::Tensor table, torch::Tensor beta, torch::Tensor out,
                                                  torch::Tensor lse, torch::Tensor grad_out, bool causal,
                                                  int64_t bq, int64_t bk) {
  check_qkv(qkv, metric, turns), check(table, "table", 2), check(beta, "beta", 1);
  check(out, "out", 4), check(lse, "lse", 3), check_rows(grad_out, "grad_out");
  const int64_t b = qkv.size(0), n = qkv.size(1), h = qkv.size(3), d = qkv.size(4);
  // rowsum(dO ⊙ O) is the same in the query's frame as in the common one
  auto delta = (grad_out * out).sum(-1).contiguous();
  auto units = torch::empty({3, b, h, n, d}, qkv.options());
  auto lm2 = torch::empty({b, h, n}, qkv.options());
  auto gout = torch::empty({b, h, n, d}, qkv.options());
  auto gunits = torch::zeros({3, b, h, n, d}, qkv.options());
  auto dlm2 = torch::zeros({b, h, n}, qkv.options());
  auto dtab = torch::zeros({b * h, 2 * n - 1}, qkv.options());
  auto dbeta = torch::zeros({b * h}, qkv.options());
  auto gqkv = torch::empty_like(qkv);
  auto gmetric = metric.numel() ? torch::empty_like(metric) : torch::empty({0}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "rt_qkv_backward", [&] {
    const auto s = qkv_inputs<scalar_t>(qkv, metric, turns, magnitudes, key_scale, normalize_values);
    scalar_t* u = units.data_ptr<scalar_t>();
    prepare_forward(s, u, lm2.data_ptr<scalar_t>());
    const auto go = rows_of<scalar_t>(grad_out);
    scalar_t* g = gout.data_ptr<scalar_t>();
    at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {  // ∂o into the common frame
      for (int64_t x = begin; x < end; ++x)
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* src = go.at(x, i);
          scalar_t* dst = g + (x * n + i) * d;
          if (s.turns)
            turn_pairs(src, dst, s.turn(x % h, i), d / 2, scalar_t(-1));
          else
            std::copy(src, src + d, dst);
        }
    });
    scalar_t* gu = gunits.data_ptr<scalar_t>();
    const int64_t part = b * h * n * d;
    backward_impl<scalar_t>(s.rows(u, 0), s.rows(u, 1), s.rows(u, 2), lm2.data_ptr<scalar_t>(),
                            table.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                            delta.data_ptr<scalar_t>(), rows_of<scalar_t>(gout), gu, gu + part, gu + 2 * part,
                            dlm2.data_ptr<scalar_t>(), dtab.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>(),
                            b * h, h, n, d, d, causal, bq, bk);
    prepare_backward(s, gu, magnitudes ? dlm2.data_ptr<scalar_t>() : nullptr, gqkv.data_ptr<scalar_t>(),
                     metric.numel() ? gmetric.data_ptr<scalar_t>() : nullptr);
  });
  auto [d_table, d_beta] = parameter_grads(dtab, dbeta, b, h, n);
  return {gqkv, gmetric, d_table, d_beta};
}
