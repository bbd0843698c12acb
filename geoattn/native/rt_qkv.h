// RT-Filter attention from the fused projection, on the CPU: the normalisation of q, k (through the
// learned metric) and v, the key magnitudes, the rotation into the common frame, the attention of
// rt_lag.h and the rotation of the output back into each query's frame, in one call each way.
//
// In Python (geoattn.attention.rt_kernel) these are separate passes over (B, N, 3, H, D) around the
// kernel: `_prepare` (normalise, rotate by −θ, lay out head-major), then `_rotate` (by +θ) of the
// output, forward and backward. Here each head instance's rows are normalised and turned when its
// work item starts, into a per-thread scratch that the attention then reads from cache, the output is
// turned as it is written, and the backward recomputes the units from qkv instead of keeping a copy.
//
// Per token i, head h, with y = x ⊙ metric for q and k (x for v), θ_ip = i·ω_hp:
//
//     log m²_i = log max(key_scale² |k_i|², tiny)       (0 without magnitudes)
//     û_i      = R(−θ_i) y_i / max(|y_i|, 1e-12)        (v as it is without normalize_values)
//     o_i      = R(+θ_i) Σ_j softmax_j(logit_ij) v̂_j     (rt_lag.h on the units)
//
// Layouts: qkv (B, N, 3, H, D) contiguous, metric (H, D) or empty, turns (H, N, D/2, 2) the (cos θ,
// sin θ) of every head, token and pair, or empty (no rotation); the filter parameters (H,) each, from
// which the lag table of rt_lag.h is computed here (`lag_table`).

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
  int64_t n, h, d;
  bool magnitudes, normalize_values;
  T key_scale2;

  const T* row(int64_t token, int part, int64_t head) const { return qkv + ((token * 3 + part) * h + head) * d; }
  const T* scale(int part, int64_t head) const { return metric && part < 2 ? metric + head * d : nullptr; }
  const T* turn(int64_t head, int64_t i) const { return turns ? turns + (head * n + i) * d : nullptr; }
  bool unit(int part) const { return part < 2 || normalize_values; }
};

// Rows are handled in lanes (rt_lag.h): kLanes float32s at a time where D is a multiple of kLanes,
// else one value at a time; a row's sums end in a tree of lane additions (`lane_reduce`).
template <typename L>
constexpr int64_t width_of = std::is_same_v<L, vf> ? kLanes : 1;

template <typename L>
inline auto lane_sum(L v) {
  if constexpr (std::is_same_v<L, vf>) {
    return lane_reduce(v, add);
  } else {
    return v;
  }
}

// The pair shuffles of `turn_row` on a vector of lanes: each pair's first value twice, its second
// value twice, the pair swapped, and the signs (−1, +1) repeated.
template <std::size_t... I>
inline vf pair_firsts(vf t, std::index_sequence<I...>) {
  return __builtin_shufflevector(t, t, (I & ~std::size_t(1))...);
}
template <std::size_t... I>
inline vf pair_seconds(vf t, std::index_sequence<I...>) {
  return __builtin_shufflevector(t, t, (I | std::size_t(1))...);
}
template <std::size_t... I>
inline vf pairs_swapped(vf v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (I ^ std::size_t(1))...);
}
template <std::size_t... I>
inline vf alternating_signs(std::index_sequence<I...>) {
  return vf{(I % 2 ? 1.0f : -1.0f)...};
}

// y = R(sign·θ) x on a row's pairs (turn_pairs), in place allowed; `turn` is the row's (cos, sin) pairs.
template <typename L, typename T>
inline void turn_row(const T* x, T* y, const T* turn, int64_t d, T sign) {
  if constexpr (std::is_same_v<L, vf>) {
    const vf alt = alternating_signs(Lanes{}) * sign;
    for (int64_t c = 0; c < d; c += kLanes) {
      const vf v = load<vf>(x + c), t = load<vf>(turn + c);
      const vf cos = pair_firsts(t, Lanes{}), sin = pair_seconds(t, Lanes{});
      store(y + c, cos * v + alt * sin * pairs_swapped(v, Lanes{}));
    }
  } else {
    turn_pairs(x, y, turn, d / 2, sign);
  }
}

// |y|² of a row with y = x ⊙ scale (or x).
template <typename L, typename T>
inline T row_norm2(const T* x, const T* scale, int64_t d) {
  L norm2 = splat<L>(T(0));
  for (int64_t c = 0; c < d; c += width_of<L>) {
    const L xv = load<L>(x + c), yv = scale ? xv * load<L>(scale + c) : xv;
    norm2 += yv * yv;
  }
  return lane_sum(norm2);
}

template <typename T>
inline T inverse_norm(T norm2, bool unit) {
  return unit ? T(1) / std::sqrt(std::max(norm2, static_cast<T>(kUnitEps2))) : T(1);
}

// The heads of the fused entry, for forward_impl and backward_impl (rt_lag.h): a head instance's rows
// are normalised and turned into the common frame when its work item starts, in a per-thread scratch
// that stays in cache for the attention, and its gradients go back through the normalisation into
// ∂qkv as soon as its backward is done: no (3, B, H, N, D) copy of the units, and one parallel
// region each way. Scratch (in values): units (3, N, D), log m² (N), m² (N), the rows' |y|² (3, N) and
// the keys' |x|² (N) (the backward reuses them), then for the backward ∂o in the common frame (N, D),
// δ (N), ∂units (3, N, D) and ∂log m² (N).
template <typename L, typename T>
struct QkvHeads {
  Qkv<T> s;
  const T* out = nullptr;  // (B, H, N, D) in the queries' frames, and ∂o's rows (backward)
  Rows<T> grad_out{};
  T *gqkv = nullptr, *gmetric = nullptr;  // ∂qkv (B, N, 3, H, D); ∂metric per head instance (B·H, D)

  // Where each part of a head's scratch starts, in values (the layout above)
  struct Layout {
    int64_t lm2, m2, norms2, raws2, gout, delta, gunits, glm2, end;
  };
  Layout layout() const {
    const int64_t n = s.n, nd = s.n * s.d, lm2 = 3 * nd, norms2 = lm2 + 2 * n, gout = norms2 + 4 * n;
    return {lm2,  lm2 + n,       norms2,           norms2 + 3 * n,          gout,
            gout + nd, gout + nd + n, gout + 4 * nd + n, gout + 4 * nd + 2 * n};
  }
  int64_t scratch() const { return out ? layout().end : layout().gout; }

  // q, k, v of head instance x as units in the common frame, m²_i = max(key_scale² |k_i|², tiny)
  // and its log (1 and 0 without magnitudes)
  HeadIn<T> inputs(int64_t x, T* scratch) const {
    const T tiny = std::numeric_limits<T>::min();
    const int64_t bb = x / s.h, hh = x % s.h, n = s.n, d = s.d;
    const Layout at = layout();
    T* units = scratch;
    T* lm2 = scratch + at.lm2;
    T* m2 = scratch + at.m2;
    T* norms2 = scratch + at.norms2;  // |y|² per part and row, only where the row is normalised
    T* raws2 = scratch + at.raws2;    // the keys' |x|², only with magnitudes
    for (int64_t i = 0; i < n; ++i)
      for (int part = 0; part < 3; ++part) {
        const T* row = s.row(bb * n + i, part, hh);
        const T* scale = s.scale(part, hh);
        const T norm2 = s.unit(part) ? row_norm2<L>(row, scale, d) : T(0);
        norms2[part * n + i] = norm2;
        if (part == 1) {
          const T* none = nullptr;
          const T raw2 = !s.magnitudes ? T(0) : scale ? row_norm2<L>(row, none, d) : norm2;
          raws2[i] = raw2;
          m2[i] = s.magnitudes ? std::max(raw2 * s.key_scale2, tiny) : T(1);
          lm2[i] = s.magnitudes ? std::log(m2[i]) : T(0);
        }
        const L inv = splat<L>(inverse_norm(norm2, s.unit(part)));
        T* u = units + (part * n + i) * d;
        for (int64_t c = 0; c < d; c += width_of<L>) {
          const L xv = load<L>(row + c);
          store(u + c, (scale ? xv * load<L>(scale + c) : xv) * inv);
        }
        if (s.turns) turn_row<L>(u, u, s.turn(hh, i), d, T(-1));
      }
    const int ld = static_cast<int>(d);
    return {units, units + n * d, units + 2 * n * d, lm2, ld, ld, ld, m2};
  }

  // ∂o of head instance x turned into the common frame, δ_i = ⟨∂o_i, o_i⟩ (the same in either frame)
  // and zeroed gradients
  HeadGrad<T> grads(int64_t x, T* scratch) const {
    const int64_t hh = x % s.h, n = s.n, d = s.d;
    const Layout at = layout();
    T* gout = scratch + at.gout;
    T* delta = scratch + at.delta;
    T* gunits = scratch + at.gunits;
    T* glm2 = scratch + at.glm2;
    for (int64_t i = 0; i < n; ++i) {
      const T* src = grad_out.at(x, i);
      const T* o = out + (x * n + i) * d;
      T* dst = gout + i * d;
      L dot = splat<L>(T(0));
      for (int64_t c = 0; c < d; c += width_of<L>) dot += load<L>(src + c) * load<L>(o + c);
      delta[i] = lane_sum(dot);
      if (s.turns)
        turn_row<L>(src, dst, s.turn(hh, i), d, T(-1));
      else
        std::copy(src, src + d, dst);
    }
    std::fill(gunits, gunits + 3 * n * d + n, T(0));
    const int ld = static_cast<int>(d);
    return {gout, delta, ld, gunits, gunits + n * d, gunits + 2 * n * d, glm2};
  }

  // The units' gradients → ∂qkv rows of head instance x, and its share of ∂metric. Per row, with
  // u = y/|y|: ∂y = (∂u − ⟨∂u, u⟩ u)/|y| (no radial part at the clamp), ∂x = ∂y ⊙ metric,
  // ∂metric += ∂y ⊙ x, and for keys ∂x += 2 ∂log m² x/|x|² (none where the magnitude sits at the clamp).
  void finish(int64_t x, const HeadGrad<T>& hg) const {
    const T tiny = std::numeric_limits<T>::min();
    const int64_t bb = x / s.h, hh = x % s.h, n = s.n, d = s.d;
    // the norms `inputs` measured for this head, in the same scratch as ∂o (`grads`)
    const Layout at = layout();
    const T* scratch = hg.dout - at.gout;
    const T* norms2 = scratch + at.norms2;
    const T* raws2 = scratch + at.raws2;
    T* acc = gmetric ? gmetric + x * d : nullptr;
    if (acc) std::fill(acc, acc + d, T(0));
    for (int64_t i = 0; i < n; ++i)
      for (int part = 0; part < 3; ++part) {
        const int64_t token = bb * n + i;
        const T* row = s.row(token, part, hh);
        const T* scale = s.scale(part, hh);
        T* gu = hg.dq + (part * n + i) * d;  // ∂units (3, N, D) start at ∂q
        if (s.turns) turn_row<L>(gu, gu, s.turn(hh, i), d, T(1));  // back into the token's own frame
        const T norm2 = norms2[part * n + i];
        const T inv = inverse_norm(norm2, s.unit(part));
        const bool radial = s.unit(part) && norm2 > static_cast<T>(kUnitEps2);
        T along_ = 0;
        if (radial) {
          L gy2 = splat<L>(T(0));
          for (int64_t c = 0; c < d; c += width_of<L>) {
            const L xv = load<L>(row + c), yv = scale ? xv * load<L>(scale + c) : xv;
            gy2 += load<L>(gu + c) * yv;
          }
          along_ = lane_sum(gy2) * inv * inv;
        }
        const L along = splat<L>(along_);  // ⟨∂u, u⟩/|y| on y = |y| u
        const T raw2 = part == 1 ? raws2[i] : T(0);
        const bool magnitude = part == 1 && s.magnitudes && raw2 * s.key_scale2 >= tiny;
        const L f = splat<L>(magnitude ? 2 * hg.dlm2[i] / raw2 : T(0));
        T* gx = gqkv + ((token * 3 + part) * s.h + hh) * d;
        T* acc_row = scale ? acc : nullptr;  // q and k only
        const L vinv = splat<L>(inv);
        for (int64_t c = 0; c < d; c += width_of<L>) {
          const L xv = load<L>(row + c), yv = scale ? xv * load<L>(scale + c) : xv;
          const L gy = (load<L>(gu + c) - along * yv) * vinv;
          store(gx + c, (scale ? gy * load<L>(scale + c) : gy) + f * xv);
          if (acc_row) store(acc_row + c, load<L>(acc_row + c) + gy * xv);
        }
      }
  }
};

// Runs f(heads) with the lanes that fit the rows: kLanes float32s at a time where D is a multiple of
// kLanes, else one value at a time.
template <typename T, typename F>
void with_qkv_heads(const Qkv<T>& s, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (s.d % kLanes == 0) return f(QkvHeads<vf, T>{s});
  }
  f(QkvHeads<T, T>{s});
}

// log c(ℓ) = log(η_t² + σ_t² ℓ E(2 μ_r ℓ)), E(x) = (e^x − 1)/x, for the lags ℓ = 0 … N − 1 of every
// head, with its derivatives by μ_r, σ_t² and η_t², in double: the quantity and the branches of
// rt_kernel.log_noise_variance (geoattn.rt.precision), so that the native entry needs no Python
// operations around it. Beyond x = 2 μ_r ℓ > `far` it is taken in log space,
// logaddexp(log η_t², log(σ_t² ℓ/x) + x + log(1 − e^{−x})), and σ_t² = 0 has no gradient there.
struct LagTable {
  int64_t h, n;
  std::vector<double> log_c, d_mu, d_sigma, d_eta;  // (H, N) each

  // (H, 2N − 1) in the kernel's order, entry i − j + N − 1
  template <typename T>
  std::vector<T> relative() const {
    std::vector<T> table(h * (2 * n - 1));
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t lag = 0; lag < n; ++lag) {
        const T v = static_cast<T>(log_c[hh * n + lag]);
        table[hh * (2 * n - 1) + n - 1 + lag] = table[hh * (2 * n - 1) + n - 1 - lag] = v;
      }
    return table;
  }
};

template <typename T>
LagTable lag_table(const T* mu_r, const T* sigma_t2, const T* eta_t2, int64_t h, int64_t n, double far) {
  LagTable t{h, n, std::vector<double>(h * n), std::vector<double>(h * n), std::vector<double>(h * n),
             std::vector<double>(h * n)};
  for (int64_t hh = 0; hh < h; ++hh) {
    const double mu = mu_r[hh], s2 = sigma_t2[hh], e2 = eta_t2[hh];
    for (int64_t lag = 0; lag < n; ++lag) {
      const int64_t e = hh * n + lag;
      const double l = static_cast<double>(lag), x = 2 * mu * l;
      if (x > far) {
        if (s2 > 0) {
          const double a = std::log(e2), g = std::log(s2 * l / x) + x + std::log1p(-std::exp(-x));
          const double top = std::max(a, g), lc = top + std::log(std::exp(a - top) + std::exp(g - top));
          const double wa = std::exp(a - lc), wg = std::exp(g - lc);
          t.log_c[e] = lc, t.d_eta[e] = wa / e2, t.d_sigma[e] = wg / s2;
          t.d_mu[e] = wg * (1 - 1 / x + 1 / std::expm1(x)) * 2 * l;  // d log E/dx · dx/dμ
        } else {
          t.log_c[e] = std::log(e2), t.d_eta[e] = 1 / e2, t.d_sigma[e] = 0, t.d_mu[e] = 0;
        }
        continue;
      }
      // E and E' = (x e^x − (e^x − 1))/x², the latter as its series where it would cancel
      const double ratio = x == 0 ? 1.0 : std::expm1(x) / x;
      const double slope = x < 1e-2 ? 0.5 + x * (1.0 / 3 + x * (1.0 / 8 + x * (1.0 / 30 + x * (1.0 / 144 + x * (1.0 / 840 + x / 5760)))))
                                    : (x * (std::expm1(x) + 1) - std::expm1(x)) / (x * x);
      const double c = e2 + s2 * l * ratio;
      t.log_c[e] = std::log(c), t.d_eta[e] = 1 / c, t.d_sigma[e] = l * ratio / c;
      t.d_mu[e] = s2 * l * slope * 2 * l / c;
    }
  }
  return t;
}

// ∂table (H, 2N − 1) → ∂μ_r, ∂σ_t², ∂η_t² (H,): each lag's two entries (±ℓ) through its derivatives,
// summed in double.
template <typename T>
std::vector<torch::Tensor> lag_table_grads(const LagTable& t, const torch::Tensor& d_table) {
  const T* g = d_table.data_ptr<T>();
  std::vector<torch::Tensor> grads;
  for (int which = 0; which < 3; ++which) grads.push_back(torch::empty({t.h}, d_table.options()));
  const int64_t n = t.n, w = 2 * n - 1;
  for (int64_t hh = 0; hh < t.h; ++hh) {
    double mu = 0, sigma = 0, eta = 0;
    for (int64_t lag = 0; lag < n; ++lag) {
      const double gl = static_cast<double>(g[hh * w + n - 1 + lag]) + (lag > 0 ? g[hh * w + n - 1 - lag] : 0.0);
      const int64_t e = hh * n + lag;
      mu += gl * t.d_mu[e], sigma += gl * t.d_sigma[e], eta += gl * t.d_eta[e];
    }
    grads[0].data_ptr<T>()[hh] = static_cast<T>(mu);
    grads[1].data_ptr<T>()[hh] = static_cast<T>(sigma);
    grads[2].data_ptr<T>()[hh] = static_cast<T>(eta);
  }
  return grads;
}

template <typename T>
Qkv<T> qkv_inputs(const torch::Tensor& qkv, const torch::Tensor& metric, const torch::Tensor& turns,
                  bool magnitudes, double key_scale, bool normalize_values) {
  return {qkv.data_ptr<T>(),
          metric.numel() ? metric.data_ptr<T>() : nullptr,
          turns.numel() ? turns.data_ptr<T>() : nullptr,
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

void check_params(const std::vector<torch::Tensor>& params, int64_t h) {
  TORCH_CHECK(params.size() == 4, "params: expected (mu_r, sigma_t2, eta_t2, beta)");
  for (const auto& p : params) {
    check(p, "a filter parameter", 1);
    TORCH_CHECK(p.size(0) == h, "params: expected (H,) each, got ", p.sizes());
  }
}

template <typename T>
LagTable lag_table_of(const std::vector<torch::Tensor>& params, int64_t n, double far) {
  return lag_table(params[0].data_ptr<T>(), params[1].data_ptr<T>(), params[2].data_ptr<T>(), params[0].size(0), n,
                   far);
}

}  // namespace

// qkv (B, N, 3, H, D), metric (H, D) | empty, turns (H, N, D/2, 2) | empty, the key scale (used when
// `magnitudes`), params (μ_r, σ_t², η_t², β) each (H,) and the log-space threshold of log c →
// (out (B, H, N, D) in each query's frame, lse (B, H, N)).
inline std::vector<torch::Tensor> rt_qkv_forward(torch::Tensor qkv, torch::Tensor metric, torch::Tensor turns,
                                                 bool magnitudes, double key_scale, bool normalize_values,
                                                 std::vector<torch::Tensor> params, double far, bool causal,
                                                 int64_t bq, int64_t bk) {
  check_qkv(qkv, metric, turns), check_params(params, qkv.size(3));
  const int64_t b = qkv.size(0), n = qkv.size(1), h = qkv.size(3), d = qkv.size(4);
  auto out = torch::empty({b, h, n, d}, qkv.options());
  auto lse = torch::empty({b, h, n}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "rt_qkv_forward", [&] {
    const auto s = qkv_inputs<scalar_t>(qkv, metric, turns, magnitudes, key_scale, normalize_values);
    const auto table = lag_table_of<scalar_t>(params, n, far).template relative<scalar_t>();
    with_qkv_heads(s, [&](const auto& heads) {
      forward_impl<scalar_t>(heads, table.data(), params[3].data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                             lse.data_ptr<scalar_t>(), b * h, h, n, d, d, causal, bq, bk, s.turns);
    });
  });
  return {out, lse};
}

// The backward from the forward's out and lse and grad_out (B, H, N, D, rows contiguous) →
// (∂qkv (B, N, 3, H, D), ∂metric (H, D) | empty, ∂μ_r, ∂σ_t², ∂η_t², ∂β (H,)).
inline std::vector<torch::Tensor> rt_qkv_backward(torch::Tensor qkv, torch::Tensor metric, torch::Tensor turns,
                                                  bool magnitudes, double key_scale, bool normalize_values,
                                                  std::vector<torch::Tensor> params, double far, torch::Tensor out,
                                                  torch::Tensor lse, torch::Tensor grad_out, bool causal,
                                                  int64_t bq, int64_t bk) {
  check_qkv(qkv, metric, turns), check_params(params, qkv.size(3));
  check(out, "out", 4), check(lse, "lse", 3), check_rows(grad_out, "grad_out");
  const int64_t b = qkv.size(0), n = qkv.size(1), h = qkv.size(3), d = qkv.size(4);
  auto gqkv = torch::empty(qkv.sizes(), qkv.options());
  auto dtab = torch::zeros({b * h, 2 * n - 1}, qkv.options());  // reversed lag order per head instance
  auto dbeta = torch::empty({b * h}, qkv.options());
  auto gmetric = metric.numel() ? torch::empty_like(metric) : torch::empty({0}, qkv.options());
  std::vector<torch::Tensor> param_grads;  // ∂μ_r, ∂σ_t², ∂η_t², ∂β
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "rt_qkv_backward", [&] {
    const auto s = qkv_inputs<scalar_t>(qkv, metric, turns, magnitudes, key_scale, normalize_values);
    const auto lags = lag_table_of<scalar_t>(params, n, far);
    const auto table = lags.template relative<scalar_t>();
    // ∂metric per head instance, summed over the batch below in a fixed order: no races, and the same
    // sums whatever the number of threads
    std::vector<scalar_t> partial(metric.numel() ? b * h * d : 0);
    with_qkv_heads(s, [&](auto heads) {
      heads.out = out.data_ptr<scalar_t>(), heads.grad_out = rows_of<scalar_t>(grad_out);
      heads.gqkv = gqkv.data_ptr<scalar_t>(), heads.gmetric = partial.empty() ? nullptr : partial.data();
      backward_impl<scalar_t>(heads, table.data(), params[3].data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                              dtab.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>(), b * h, h, n, d, d, causal,
                              bq, bk);
    });
    if (!partial.empty()) {
      scalar_t* gm = gmetric.data_ptr<scalar_t>();
      for (int64_t e = 0; e < h * d; ++e) {
        double total = 0;
        for (int64_t bb = 0; bb < b; ++bb) total += partial[bb * h * d + e];
        gm[e] = static_cast<scalar_t>(total);
      }
    }
    const auto [d_table, d_beta] = parameter_grads(dtab.data_ptr<scalar_t>(), dbeta.data_ptr<scalar_t>(), b, h, n,
                                                   qkv.options());
    param_grads = lag_table_grads<scalar_t>(lags, d_table);
    param_grads.push_back(d_beta);
  });
  return {gqkv, gmetric, param_grads[0], param_grads[1], param_grads[2], param_grads[3]};
}
