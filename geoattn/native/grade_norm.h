// GradeLayerNorm on the CPU (geoattn.layers.multivector.GradeLayerNorm): each token's multivector
// channels scaled grade by grade by the inverse of their invariant norm, forward and backward in one
// pass over the tokens (in torch a dozen small operators each way, most of them over every number).
//
// Per token, with C channels and m_g = (1/C) Σ_c Σ_{b ∈ g} metric_b x_cb² (GATr's inner product):
//
//     per grade:  s_g = gain_g / sqrt(|m_g| + eps)    (gain_g alone where grade g has no normable blade)
//     joint:      s_g = gain_g / sqrt(Σ_h |m_h| + eps)
//     y_cb = s_{grade(b)} x_cb
//
// Layouts: x, y, ∂y and ∂x are (M, C, dim) with any strides (blade by blade or blades innermost); the
// tables grade (dim) and metric (dim), normable (G); the gain (G). The backward gives ∂x and each
// token's share of ∂gain, (M, G), which the caller sums.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fpmode.h"

namespace grade_norm {

constexpr int kMaxGrades = 8;  // n ≤ 7

struct Strided {
  int64_t token, channel, blade;
};

inline Strided strides_of(const torch::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

struct Tables {
  std::vector<int64_t> grade;  // per blade
  std::vector<double> metric;  // per blade
  std::vector<bool> normable;  // per grade
  int64_t grades;
  bool per_grade;
  double eps;
};

// Per token: m_g, and the factors r_g = 1 / sqrt(…) (1 for a grade that is not normed).
// (kUnit: every channel stride is 1, as blade by blade: the channel loops run over contiguous numbers)
template <typename T, bool kUnit>
inline void factors(const Tables& tb, const T* x, const Strided& s, int64_t c, int64_t dim, double* m, double* r) {
  const int64_t sc = kUnit ? 1 : s.channel;
  for (int64_t g = 0; g < tb.grades; ++g) m[g] = 0;
  for (int64_t b = 0; b < dim; ++b) {
    if (tb.metric[b] == 0) continue;
    T acc = 0;
    const T* col = x + b * s.blade;
    for (int64_t ch = 0; ch < c; ++ch) acc += col[ch * sc] * col[ch * sc];
    m[tb.grade[b]] += tb.metric[b] * acc;
  }
  double total = 0;
  for (int64_t g = 0; g < tb.grades; ++g) m[g] /= c, total += std::fabs(m[g]);
  for (int64_t g = 0; g < tb.grades; ++g)
    r[g] = tb.per_grade ? (tb.normable[g] ? 1.0 / std::sqrt(std::fabs(m[g]) + tb.eps) : 1.0)
                        : 1.0 / std::sqrt(total + tb.eps);
}

template <typename T, bool kUnit>
void forward_impl(const Tables& tb, const T* x, Strided sx, const T* gain, T* y, Strided sy, int64_t tokens,
                  int64_t c, int64_t dim) {
  if (kUnit) sx.channel = sy.channel = 1;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    double m[kMaxGrades], r[kMaxGrades];
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * sx.token;
      T* yt = y + t * sy.token;
      factors<T, kUnit>(tb, xt, sx, c, dim, m, r);
      for (int64_t b = 0; b < dim; ++b) {
        const T scale = static_cast<T>(gain[tb.grade[b]] * r[tb.grade[b]]);
        const T* xb = xt + b * sx.blade;
        T* yb = yt + b * sy.blade;
        if (kUnit)
          for (int64_t ch = 0; ch < c; ++ch) yb[ch] = xb[ch] * scale;
        else
          for (int64_t ch = 0; ch < c; ++ch) yb[ch * sy.channel] = xb[ch * sx.channel] * scale;
      }
    }
  });
}

template <typename T, bool kUnit>
void backward_impl(const Tables& tb, const T* x, Strided sx, const T* gain, const T* gy, Strided sg, T* gx,
                   Strided so, T* g_gain, int64_t tokens, int64_t c, int64_t dim) {
  if (kUnit) sx.channel = sg.channel = so.channel = 1;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    double m[kMaxGrades], r[kMaxGrades], dot[kMaxGrades], k[kMaxGrades];
    for (int64_t t = begin; t < end; ++t) {
      const T* xt = x + t * sx.token;
      const T* gt = gy + t * sg.token;
      T* ot = gx + t * so.token;
      factors<T, kUnit>(tb, xt, sx, c, dim, m, r);
      for (int64_t g = 0; g < tb.grades; ++g) dot[g] = 0;
      for (int64_t b = 0; b < dim; ++b) {
        T acc = 0;
        const T *gb = gt + b * sg.blade, *xb = xt + b * sx.blade;
        for (int64_t ch = 0; ch < c; ++ch) acc += gb[ch * (kUnit ? 1 : sg.channel)] * xb[ch * (kUnit ? 1 : sx.channel)];
        dot[tb.grade[b]] += acc;  // t_g = Σ ∂y x over the grade
      }
      // ∂L/∂|m_g| (per grade), or ∂L/∂(Σ|m_h|) shared by every grade (joint): −½ r³ Σ gain t
      double shared = 0;
      for (int64_t g = 0; g < tb.grades; ++g) {
        g_gain[t * tb.grades + g] = static_cast<T>(dot[g] * r[g]);
        const double d = -0.5 * gain[g] * dot[g] * r[g] * r[g] * r[g];
        if (tb.per_grade)
          k[g] = tb.normable[g] ? d : 0.0;
        else
          shared += d;
      }
      // and through |m_g| = |(1/C) Σ metric x²| to x: sign(m_g) · 2 metric_b x / C
      for (int64_t g = 0; g < tb.grades; ++g) {
        const double sign = m[g] > 0 ? 1.0 : (m[g] < 0 ? -1.0 : 0.0);
        k[g] = (tb.per_grade ? k[g] : shared) * sign * 2.0 / c;
      }
      for (int64_t b = 0; b < dim; ++b) {
        const int64_t g = tb.grade[b];
        const T scale = static_cast<T>(gain[g] * r[g]), along = static_cast<T>(k[g] * tb.metric[b]);
        const T *gb = gt + b * sg.blade, *xb = xt + b * sx.blade;
        T* ob = ot + b * so.blade;
        if (kUnit)
          for (int64_t ch = 0; ch < c; ++ch) ob[ch] = gb[ch] * scale + xb[ch] * along;
        else
          for (int64_t ch = 0; ch < c; ++ch) ob[ch * so.channel] = gb[ch * sg.channel] * scale + xb[ch * sx.channel] * along;
      }
    }
  });
}

inline Tables tables(const torch::Tensor& grade, const torch::Tensor& metric, const torch::Tensor& normable,
                     bool per_grade, double eps) {
  TORCH_CHECK(grade.dtype() == torch::kInt64 && metric.dtype() == torch::kFloat64 && normable.dtype() == torch::kBool,
              "grade_norm: grade (int64), metric (float64), normable (bool)");
  TORCH_CHECK(grade.numel() == metric.numel() && normable.numel() <= kMaxGrades, "grade_norm: bad tables");
  Tables tb;
  auto g = grade.contiguous(), mt = metric.contiguous(), nm = normable.contiguous();
  tb.grade.assign(g.data_ptr<int64_t>(), g.data_ptr<int64_t>() + g.numel());
  tb.metric.assign(mt.data_ptr<double>(), mt.data_ptr<double>() + mt.numel());
  for (int64_t i = 0; i < nm.numel(); ++i) tb.normable.push_back(nm.data_ptr<bool>()[i]);
  tb.grades = nm.numel(), tb.per_grade = per_grade, tb.eps = eps;
  for (auto v : tb.grade) TORCH_CHECK(v >= 0 && v < tb.grades, "grade_norm: a blade's grade is out of range");
  return tb;
}

inline void check_x(const torch::Tensor& x, const torch::Tensor& gain, const Tables& tb) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.size(2) == static_cast<int64_t>(tb.grade.size()),
              "grade_norm: x (M, C, dim) on the CPU");
  TORCH_CHECK(gain.is_contiguous() && gain.numel() == tb.grades && gain.scalar_type() == x.scalar_type(),
              "grade_norm: gain (G,) of x's dtype");
}

}  // namespace grade_norm

// x (M, C, dim), gain (G,), the tables → y laid out as x
inline torch::Tensor grade_norm_forward(torch::Tensor x, torch::Tensor gain, torch::Tensor grade, torch::Tensor metric,
                                        torch::Tensor normable, bool per_grade, double eps) {
  const auto tb = grade_norm::tables(grade, metric, normable, per_grade, eps);
  grade_norm::check_x(x, gain, tb);
  auto y = torch::empty_like(x);  // x's strides where x is dense (both memory orders)
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "grade_norm_forward", [&] {
    auto run = [&](auto unit) {
      grade_norm::forward_impl<scalar_t, decltype(unit)::value>(
          tb, x.data_ptr<scalar_t>(), grade_norm::strides_of(x), gain.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
          grade_norm::strides_of(y), x.size(0), x.size(1), x.size(2));
    };
    if (x.stride(1) == 1 && y.stride(1) == 1)
      run(std::true_type{});
    else
      run(std::false_type{});
  });
  return y;
}

// … and ∂y (M, C, dim), any strides → [∂x laid out as x, each token's ∂gain (M, G)]
inline std::vector<torch::Tensor> grade_norm_backward(torch::Tensor x, torch::Tensor gain, torch::Tensor grad,
                                                      torch::Tensor grade, torch::Tensor metric,
                                                      torch::Tensor normable, bool per_grade, double eps) {
  const auto tb = grade_norm::tables(grade, metric, normable, per_grade, eps);
  grade_norm::check_x(x, gain, tb);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(), "grade_norm: grad like x");
  auto gx = torch::empty_like(x);
  auto g_gain = torch::empty({x.size(0), tb.grades}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "grade_norm_backward", [&] {
    auto run = [&](auto unit) {
      grade_norm::backward_impl<scalar_t, decltype(unit)::value>(
          tb, x.data_ptr<scalar_t>(), grade_norm::strides_of(x), gain.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(),
          grade_norm::strides_of(grad), gx.data_ptr<scalar_t>(), grade_norm::strides_of(gx),
          g_gain.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2));
    };
    if (x.stride(1) == 1 && grad.stride(1) == 1 && gx.stride(1) == 1)
      run(std::true_type{});
    else
      run(std::false_type{});
  });
  return {gx, g_gain};
}
