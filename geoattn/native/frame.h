// The frame head's per-token transform (docs/concepts/rotors.md#frame-transport): each token's
// multivectors moved by the rotation of its orthonormal frame, forward and backward in one pass over
// the tokens (the Python form is a dozen small tensor operations and a batched 8 × 8 matmul per token).
//
// Per token, from the vector parts c0, c1 of two channels (Gram–Schmidt, as rotor_kernel._frame_axes):
//
//     x = c0 / max(|c0|, ε),  y' = c1 − ⟨c1, x⟩ x,  y = y' / max(|y'|, ε),  z = x × y
//     M = T0 + Σ_a axes_a T_a            (axes = [x y z], T0 (8, 8), T (9, 64): the action table)
//     out_c = m_c M                      (each of the Cv multivectors m_c, row vectors of 8)
//
// Layouts: frames (P, C, 8), the tokens' multivectors whose channels 0 and 1 give c0 and c1 (their
// coordinates vec, vec + 1, vec + 2), m (P, Cv, 8), contiguous, P = B·H·N tokens; T0 (8, 8), T (9, 64).

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fpmode.h"
#include "multivector_lanes.h"

namespace frame {

// The frame of one token, in double whatever the tensors' dtype (see `axes`).
struct Axes {
  double x[3], y[3], z[3];  // the frame
  double nx, ny;            // max(|c0|, ε), max(|y'|, ε)
  bool rx, ry;              // whether each norm is |·| itself (not the clamp): its radial derivative
};

inline double dot3(const double* a, const double* b) {
  return a[0] * b[0] + a[1] * b[1] + a[2] * b[2];
}

inline void cross3(const double* a, const double* b, double* out) {
  out[0] = a[1] * b[2] - a[2] * b[1];
  out[1] = a[2] * b[0] - a[0] * b[2];
  out[2] = a[0] * b[1] - a[1] * b[0];
}

// The frame in double whatever T (a few dozen operations per token): M is then the correctly
// rounded action of the exact frame, so a float32 frame head breaks its symmetry by no more than
// the tensor form does.
template <typename T>
inline Axes axes(const T* c0_, const T* c1_, double eps) {
  const double c0[3] = {c0_[0], c0_[1], c0_[2]}, c1[3] = {c1_[0], c1_[1], c1_[2]};
  Axes f;
  const double n0 = std::sqrt(dot3(c0, c0));
  f.rx = n0 > eps;
  f.nx = f.rx ? n0 : eps;
  for (int i = 0; i < 3; ++i) f.x[i] = c0[i] / f.nx;
  const double s = dot3(c1, f.x);
  double yp[3];  // y' before its normalisation
  for (int i = 0; i < 3; ++i) yp[i] = c1[i] - s * f.x[i];
  const double n1 = std::sqrt(dot3(yp, yp));
  f.ry = n1 > eps;
  f.ny = f.ry ? n1 : eps;
  for (int i = 0; i < 3; ++i) f.y[i] = yp[i] / f.ny;
  cross3(f.x, f.y, f.z);
  return f;
}

// The action table's nonzero entries: each axis coordinate feeds two of M's 64 entries in Cl(3), so
// M is built from these lists; the products with M are dense 8 × 8 ones with fixed trip counts,
// which the compiler keeps in registers and vectorises.
template <typename T>
struct Sparse {
  std::vector<int> slot[9];  // per axis coordinate a: the entries e = 8 i + j of M it feeds …
  std::vector<T> weight[9];  // … and with which coefficient of T

  Sparse(const T* tab) {
    for (int a = 0; a < 9; ++a)
      for (int e = 0; e < 64; ++e)
        if (tab[a * 64 + e] != T(0)) {
          slot[a].push_back(e);
          weight[a].push_back(tab[a * 64 + e]);
        }
  }

  // M = T0 + Σ_a axes_a T_a, (8, 8) row-major, rounded once to T from the frame in double
  void action(const Axes& f, const T* t0, T* m) const {
    const double a[9] = {f.x[0], f.x[1], f.x[2], f.y[0], f.y[1], f.y[2], f.z[0], f.z[1], f.z[2]};
    double acc[64];
    for (int e = 0; e < 64; ++e) acc[e] = t0[e];
    for (int k = 0; k < 9; ++k)
      for (size_t u = 0; u < slot[k].size(); ++u) acc[slot[k][u]] += a[k] * weight[k][u];
    for (int e = 0; e < 64; ++e) m[e] = static_cast<T>(acc[e]);
  }
};

// g ← ∂/∂u of u / max(|u|, ε) applied to the upstream g (u/n the normalised vector, n its norm)
inline void unnormalise(const double* unit, double n, bool radial, double* g) {
  const double along = radial ? dot3(g, unit) : 0.0;
  for (int i = 0; i < 3; ++i) g[i] = (g[i] - along * unit[i]) / n;
}

template <typename T>
using Lanes8 = mv_lanes::V<T, 8>;

template <typename T>
void forward_impl(const T* frames, int64_t c, int64_t vec, const T* m, const T* t0, const Sparse<T>& sp, T* out,
                  int64_t p, int64_t cv, T eps) {
  at::parallel_for(0, p, 64, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    T mat[64];
    Lanes8<T> rows[8];
    for (int64_t t = begin; t < end; ++t) {
      const T* c0 = frames + t * c * 8 + vec;
      sp.action(axes(c0, c0 + 8, static_cast<double>(eps)), t0, mat);
      for (int i = 0; i < 8; ++i) rows[i] = mv_lanes::load<T, 8>(mat + 8 * i);
      for (int64_t ch = 0; ch < cv; ++ch)  // out_c = m_c M
        mv_lanes::store<T, 8>(out + (t * cv + ch) * 8, mv_lanes::combine<T, 8>(m + (t * cv + ch) * 8, rows));
    }
  });
}

template <typename T>
void backward_impl(const T* frames, int64_t c, int64_t vec, const T* m, const T* t0, const Sparse<T>& sp,
                   const T* g_out, T* g_frames, T* g_m, int64_t p, int64_t cv, T eps) {
  at::parallel_for(0, p, 64, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    T mat[64], mat_t[64], g_mat[64];
    Lanes8<T> cols[8], g_rows[8];
    for (int64_t t = begin; t < end; ++t) {
      const T* cc0 = frames + t * c * 8 + vec;
      const T* cc1 = cc0 + 8;
      const Axes f = axes(cc0, cc1, static_cast<double>(eps));
      sp.action(f, t0, mat);
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) mat_t[j * 8 + i] = mat[i * 8 + j];
      for (int j = 0; j < 8; ++j) cols[j] = mv_lanes::load<T, 8>(mat_t + 8 * j), g_rows[j] = Lanes8<T>{};
      for (int64_t ch = 0; ch < cv; ++ch) {  // ∂m_c = ∂out_c Mᵀ, ∂M = Σ_c m_cᵀ ∂out_c
        const T* row = m + (t * cv + ch) * 8;
        const T* go = g_out + (t * cv + ch) * 8;
        mv_lanes::store<T, 8>(g_m + (t * cv + ch) * 8, mv_lanes::combine<T, 8>(go, cols));
        const Lanes8<T> go8 = mv_lanes::load<T, 8>(go);
        for (int i = 0; i < 8; ++i) g_rows[i] += go8 * row[i];
      }
      for (int i = 0; i < 8; ++i) mv_lanes::store<T, 8>(g_mat + 8 * i, g_rows[i]);
      double ga[9];  // ∂axes_a = ⟨T_a, ∂M⟩, and the frame's backward in double like its forward
      for (int k = 0; k < 9; ++k) {
        double acc = 0;
        for (size_t u = 0; u < sp.slot[k].size(); ++u) acc += sp.weight[k][u] * g_mat[sp.slot[k][u]];
        ga[k] = acc;
      }
      double gx[3] = {ga[0], ga[1], ga[2]}, gy[3] = {ga[3], ga[4], ga[5]};
      const double* gz = ga + 6;
      double tmp[3];
      cross3(f.y, gz, tmp);  // z = x × y: ∂x += y × ∂z, ∂y += ∂z × x
      for (int i = 0; i < 3; ++i) gx[i] += tmp[i];
      cross3(gz, f.x, tmp);
      for (int i = 0; i < 3; ++i) gy[i] += tmp[i];
      unnormalise(f.y, f.ny, f.ry, gy);  // now ∂y'
      const double c1d[3] = {cc1[0], cc1[1], cc1[2]};
      const double s = dot3(c1d, f.x), xg = dot3(f.x, gy);
      T* gc0 = g_frames + t * c * 8 + vec;  // the rest of g_frames stays 0
      T* gc1 = gc0 + 8;
      for (int i = 0; i < 3; ++i) {  // y' = c1 − ⟨c1, x⟩ x
        gc1[i] = static_cast<T>(gy[i] - xg * f.x[i]);
        gx[i] -= xg * c1d[i] + s * gy[i];
      }
      unnormalise(f.x, f.nx, f.rx, gx);
      for (int i = 0; i < 3; ++i) gc0[i] = static_cast<T>(gx[i]);
    }
  });
}

inline void check_frame(const torch::Tensor& frames, const torch::Tensor& m, const torch::Tensor& t0,
                        const torch::Tensor& tab, int64_t vec) {
  for (const auto* t : {&frames, &m, &t0, &tab})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == m.scalar_type(),
                "frame_transform: expected contiguous CPU tensors of one dtype");
  TORCH_CHECK(frames.dim() == 3 && frames.size(1) >= 2 && frames.size(2) == 8 && vec >= 0 && vec + 3 <= 8,
              "frame_transform: frames (P, C >= 2, 8), vector coordinates vec … vec + 2");
  TORCH_CHECK(m.dim() == 3 && m.size(0) == frames.size(0) && m.size(2) == 8, "frame_transform: m (P, Cv, 8)");
  TORCH_CHECK(t0.numel() == 64 && tab.numel() == 9 * 64, "frame_transform: T0 (8, 8), T (9, 64)");
}

}  // namespace frame

// frames (P, C, 8), m (P, Cv, 8), T0 (8, 8), T (9, 64) → out (P, Cv, 8)
inline torch::Tensor frame_forward(torch::Tensor frames, torch::Tensor m, torch::Tensor t0, torch::Tensor tab,
                                   double eps, int64_t vec) {
  frame::check_frame(frames, m, t0, tab, vec);
  auto out = torch::empty_like(m);
  AT_DISPATCH_FLOATING_TYPES(m.scalar_type(), "frame_forward", [&] {
    const frame::Sparse<scalar_t> sp(tab.data_ptr<scalar_t>());
    frame::forward_impl<scalar_t>(frames.data_ptr<scalar_t>(), frames.size(1), vec, m.data_ptr<scalar_t>(),
                                  t0.data_ptr<scalar_t>(), sp, out.data_ptr<scalar_t>(), m.size(0), m.size(1),
                                  static_cast<scalar_t>(eps));
  });
  return out;
}

// … and grad_out (P, Cv, 8) → (∂frames (nonzero at the two channels' vector coordinates), ∂m)
inline std::vector<torch::Tensor> frame_backward(torch::Tensor frames, torch::Tensor m, torch::Tensor t0,
                                                 torch::Tensor tab, torch::Tensor grad_out, double eps,
                                                 int64_t vec) {
  frame::check_frame(frames, m, t0, tab, vec);
  TORCH_CHECK(grad_out.sizes() == m.sizes() && grad_out.is_contiguous(), "frame_backward: grad_out like m");
  auto g_frames = torch::zeros_like(frames), g_m = torch::empty_like(m);
  AT_DISPATCH_FLOATING_TYPES(m.scalar_type(), "frame_backward", [&] {
    const frame::Sparse<scalar_t> sp(tab.data_ptr<scalar_t>());
    frame::backward_impl<scalar_t>(frames.data_ptr<scalar_t>(), frames.size(1), vec, m.data_ptr<scalar_t>(),
                                   t0.data_ptr<scalar_t>(), sp, grad_out.data_ptr<scalar_t>(),
                                   g_frames.data_ptr<scalar_t>(), g_m.data_ptr<scalar_t>(), m.size(0), m.size(1),
                                   static_cast<scalar_t>(eps));
  });
  return {g_frames, g_m};
}
