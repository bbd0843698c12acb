// The frame head's per-token transform (rotor attention, SPEC §2.4): each token's multivectors moved
// by the rotation of its orthonormal frame, forward and backward in one pass over the tokens (the
// Python form is a dozen small tensor operations and a batched 8 × 8 matmul per token).
//
// Per token, from the vector parts c0, c1 of two channels (Gram–Schmidt, as rotor_kernel._frame_axes):
//
//     x = c0 / max(|c0|, ε),  y' = c1 − ⟨c1, x⟩ x,  y = y' / max(|y'|, ε),  z = x × y
//     M = T0 + Σ_a axes_a T_a            (axes = [x y z], T0 (8, 8), T (9, 64): the action table)
//     out_c = m_c M                      (each of the Cv multivectors m_c, row vectors of 8)
//
// Layouts: c0, c1 (P, 3), m (P, Cv, 8), contiguous, P = B·H·N tokens; T0 (8, 8), T (9, 64).

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace frame {

template <typename T>
struct Axes {
  T x[3], y[3], z[3];  // the frame
  T yp[3];             // y' before its normalisation
  T nx, ny;            // max(|c0|, ε), max(|y'|, ε)
  bool rx, ry;         // whether each norm is |·| itself (not the clamp): its radial derivative
};

template <typename T>
inline T dot3(const T* a, const T* b) {
  return a[0] * b[0] + a[1] * b[1] + a[2] * b[2];
}

template <typename T>
inline void cross3(const T* a, const T* b, T* out) {
  out[0] = a[1] * b[2] - a[2] * b[1];
  out[1] = a[2] * b[0] - a[0] * b[2];
  out[2] = a[0] * b[1] - a[1] * b[0];
}

template <typename T>
inline Axes<T> axes(const T* c0, const T* c1, T eps) {
  Axes<T> f;
  const T n0 = std::sqrt(dot3(c0, c0));
  f.rx = n0 > eps;
  f.nx = f.rx ? n0 : eps;
  for (int i = 0; i < 3; ++i) f.x[i] = c0[i] / f.nx;
  const T s = dot3(c1, f.x);
  for (int i = 0; i < 3; ++i) f.yp[i] = c1[i] - s * f.x[i];
  const T n1 = std::sqrt(dot3(f.yp, f.yp));
  f.ry = n1 > eps;
  f.ny = f.ry ? n1 : eps;
  for (int i = 0; i < 3; ++i) f.y[i] = f.yp[i] / f.ny;
  cross3(f.x, f.y, f.z);
  return f;
}

// M = T0 + Σ_a axes_a T_a, (8, 8) row-major
template <typename T>
inline void action(const Axes<T>& f, const T* t0, const T* tab, T* m) {
  const T a[9] = {f.x[0], f.x[1], f.x[2], f.y[0], f.y[1], f.y[2], f.z[0], f.z[1], f.z[2]};
  for (int e = 0; e < 64; ++e) m[e] = t0[e];
  for (int k = 0; k < 9; ++k)
    for (int e = 0; e < 64; ++e) m[e] += a[k] * tab[k * 64 + e];
}

// g ← ∂/∂u of u / max(|u|, ε) applied to the upstream g (u/n the normalised vector, n its norm)
template <typename T>
inline void unnormalise(const T* unit, T n, bool radial, T* g) {
  const T along = radial ? dot3(g, unit) : T(0);
  for (int i = 0; i < 3; ++i) g[i] = (g[i] - along * unit[i]) / n;
}

template <typename T>
void forward_impl(const T* c0, const T* c1, const T* m, const T* t0, const T* tab, T* out, int64_t p,
                  int64_t cv, T eps) {
  at::parallel_for(0, p, 64, [&](int64_t begin, int64_t end) {
    T mat[64];
    for (int64_t t = begin; t < end; ++t) {
      action(axes(c0 + 3 * t, c1 + 3 * t, eps), t0, tab, mat);
      for (int64_t c = 0; c < cv; ++c) {
        const T* row = m + (t * cv + c) * 8;
        T* o = out + (t * cv + c) * 8;
        for (int j = 0; j < 8; ++j) o[j] = 0;
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 8; ++j) o[j] += row[i] * mat[i * 8 + j];
      }
    }
  });
}

template <typename T>
void backward_impl(const T* c0, const T* c1, const T* m, const T* t0, const T* tab, const T* g_out,
                   T* g_c0, T* g_c1, T* g_m, int64_t p, int64_t cv, T eps) {
  at::parallel_for(0, p, 64, [&](int64_t begin, int64_t end) {
    T mat[64], g_mat[64];
    for (int64_t t = begin; t < end; ++t) {
      const Axes<T> f = axes(c0 + 3 * t, c1 + 3 * t, eps);
      action(f, t0, tab, mat);
      for (int e = 0; e < 64; ++e) g_mat[e] = 0;
      for (int64_t c = 0; c < cv; ++c) {  // ∂m_c = ∂out_c Mᵀ, ∂M = Σ_c m_cᵀ ∂out_c
        const T* row = m + (t * cv + c) * 8;
        const T* go = g_out + (t * cv + c) * 8;
        T* gm = g_m + (t * cv + c) * 8;
        for (int i = 0; i < 8; ++i) {
          T acc = 0;
          for (int j = 0; j < 8; ++j) {
            acc += go[j] * mat[i * 8 + j];
            g_mat[i * 8 + j] += row[i] * go[j];
          }
          gm[i] = acc;
        }
      }
      T ga[9];  // ∂axes_a = ⟨T_a, ∂M⟩
      for (int k = 0; k < 9; ++k) {
        T acc = 0;
        for (int e = 0; e < 64; ++e) acc += tab[k * 64 + e] * g_mat[e];
        ga[k] = acc;
      }
      T gx[3] = {ga[0], ga[1], ga[2]}, gy[3] = {ga[3], ga[4], ga[5]};
      const T* gz = ga + 6;
      T tmp[3];
      cross3(f.y, gz, tmp);  // z = x × y: ∂x += y × ∂z, ∂y += ∂z × x
      for (int i = 0; i < 3; ++i) gx[i] += tmp[i];
      cross3(gz, f.x, tmp);
      for (int i = 0; i < 3; ++i) gy[i] += tmp[i];
      unnormalise(f.y, f.ny, f.ry, gy);  // now ∂y'
      const T* cc1 = c1 + 3 * t;
      const T s = dot3(cc1, f.x), xg = dot3(f.x, gy);
      T* gc1 = g_c1 + 3 * t;
      for (int i = 0; i < 3; ++i) {  // y' = c1 − ⟨c1, x⟩ x
        gc1[i] = gy[i] - xg * f.x[i];
        gx[i] -= xg * cc1[i] + s * gy[i];
      }
      unnormalise(f.x, f.nx, f.rx, gx);
      for (int i = 0; i < 3; ++i) g_c0[3 * t + i] = gx[i];
    }
  });
}

inline void check_frame(const torch::Tensor& c0, const torch::Tensor& c1, const torch::Tensor& m,
                        const torch::Tensor& t0, const torch::Tensor& tab) {
  for (const auto* t : {&c0, &c1, &m, &t0, &tab})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == c0.scalar_type(),
                "frame_transform: expected contiguous CPU tensors of one dtype");
  TORCH_CHECK(c0.dim() == 2 && c0.size(1) == 3 && c1.sizes() == c0.sizes(), "frame_transform: c0, c1 (P, 3)");
  TORCH_CHECK(m.dim() == 3 && m.size(0) == c0.size(0) && m.size(2) == 8, "frame_transform: m (P, Cv, 8)");
  TORCH_CHECK(t0.numel() == 64 && tab.numel() == 9 * 64, "frame_transform: T0 (8, 8), T (9, 64)");
}

}  // namespace frame

// c0, c1 (P, 3), m (P, Cv, 8), T0 (8, 8), T (9, 64) → out (P, Cv, 8)
inline torch::Tensor frame_forward(torch::Tensor c0, torch::Tensor c1, torch::Tensor m, torch::Tensor t0,
                                   torch::Tensor tab, double eps) {
  frame::check_frame(c0, c1, m, t0, tab);
  auto out = torch::empty_like(m);
  AT_DISPATCH_FLOATING_TYPES(m.scalar_type(), "frame_forward", [&] {
    frame::forward_impl<scalar_t>(c0.data_ptr<scalar_t>(), c1.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                                  t0.data_ptr<scalar_t>(), tab.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  m.size(0), m.size(1), static_cast<scalar_t>(eps));
  });
  return out;
}

// … and grad_out (P, Cv, 8) → (∂c0, ∂c1, ∂m)
inline std::vector<torch::Tensor> frame_backward(torch::Tensor c0, torch::Tensor c1, torch::Tensor m,
                                                 torch::Tensor t0, torch::Tensor tab, torch::Tensor grad_out,
                                                 double eps) {
  frame::check_frame(c0, c1, m, t0, tab);
  TORCH_CHECK(grad_out.sizes() == m.sizes() && grad_out.is_contiguous(), "frame_backward: grad_out like m");
  auto g_c0 = torch::empty_like(c0), g_c1 = torch::empty_like(c1), g_m = torch::empty_like(m);
  AT_DISPATCH_FLOATING_TYPES(m.scalar_type(), "frame_backward", [&] {
    frame::backward_impl<scalar_t>(c0.data_ptr<scalar_t>(), c1.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                                   t0.data_ptr<scalar_t>(), tab.data_ptr<scalar_t>(),
                                   grad_out.data_ptr<scalar_t>(), g_c0.data_ptr<scalar_t>(),
                                   g_c1.data_ptr<scalar_t>(), g_m.data_ptr<scalar_t>(), m.size(0), m.size(1),
                                   static_cast<scalar_t>(eps));
  });
  return {g_c0, g_c1, g_m};
}
