// The hypersphere block's residual update (geoattn.layers.sphere.sphere_update, step "retraction"),
// forward and backward, one row of C channels at a time while it is in cache:
//
//     ô  = o / max(|o|, 1e-12)                           (F.normalize)
//     d  = ô − ⟨ô, h⟩ h   (tangent correction)   or   ô − h
//     x  = h + α ⊙ d
//     h' = x / |x|   (the fixed direction (1, …, 1)/√C where |x| ≤ tiny: to_sphere)
//
// The backward recomputes ô, d and x from h and o (cheaper than keeping them) and follows
// sphere._SphereRetraction's derivatives. Layouts: h, o, out, grad (R, C) contiguous, alpha (C,).

#pragma once

#include "rt_lag.h"

namespace {

struct SphereRow {
  double o_norm, along, x_norm;  // |o|, ⟨ô, h⟩, |x|
};

// ô and d of one row into `unit` and `dir` (C each), and |o|, ⟨ô, h⟩, |x|; `x` gets h + α ⊙ d.
template <typename L, typename T>
inline SphereRow sphere_row(const T* h, const T* o, const T* alpha, bool tangent, int64_t c, T* unit, T* dir,
                            T* x) {
  constexpr int64_t w = width_of<L>;
  L o2 = splat<L>(T(0)), oh = splat<L>(T(0));
  for (int64_t j = 0; j < c; j += w) {
    const L ov = load<L>(o + j);
    o2 += ov * ov;
    oh += ov * load<L>(h + j);
  }
  const T o_norm = std::sqrt(lane_sum(o2)), inv = T(1) / std::max(o_norm, T(1e-12));
  const T along = lane_sum(oh) * inv;
  L x2 = splat<L>(T(0));
  for (int64_t j = 0; j < c; j += w) {
    const L hv = load<L>(h + j), u = load<L>(o + j) * inv;
    const L d = tangent ? u - along * hv : u - hv;
    const L xv = hv + load<L>(alpha + j) * d;
    store(unit + j, u), store(dir + j, d), store(x + j, xv);
    x2 += xv * xv;
  }
  return {o_norm, along, std::sqrt(lane_sum(x2))};
}

template <typename L, typename T>
void sphere_forward_lanes(const T* h, const T* o, const T* alpha, bool tangent, int64_t rows, int64_t c, T* out) {
  constexpr int64_t w = width_of<L>;
  const T tiny = std::numeric_limits<T>::min(), fixed = T(1) / std::sqrt(static_cast<T>(c));
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> unit(c), dir(c);
    for (int64_t r = begin; r < end; ++r) {
      T* x = out + r * c;
      const auto s = sphere_row<L>(h + r * c, o + r * c, alpha, tangent, c, unit.data(), dir.data(), x);
      const L inv = splat<L>(s.x_norm > tiny ? T(1) / std::max(static_cast<T>(s.x_norm), tiny) : T(0));
      for (int64_t j = 0; j < c; j += w) store(x + j, s.x_norm > tiny ? load<L>(x + j) * inv : splat<L>(fixed));
    }
  });
}

// ∂h' (R, C) → ∂h, ∂o (R, C) and per-chunk sums of ∂α (chunks, C).
template <typename L, typename T>
void sphere_backward_lanes(const T* h, const T* o, const T* alpha, const T* out, const T* grad, bool tangent,
                           int64_t rows, int64_t c, T* gh, T* go, T* partial, int64_t chunks) {
  constexpr int64_t w = width_of<L>;
  const T tiny = std::numeric_limits<T>::min();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> unit(c), dir(c), x(c), gd(c);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      T* acc = partial + chunk * c;
      for (int64_t r = chunk * rows / chunks; r < (chunk + 1) * rows / chunks; ++r) {
        const T *hr = h + r * c, *g = grad + r * c, *y = out + r * c;
        const auto s = sphere_row<L>(hr, o + r * c, alpha, tangent, c, unit.data(), dir.data(), x.data());
        L radial = splat<L>(T(0));
        for (int64_t j = 0; j < c; j += w) radial += load<L>(g + j) * load<L>(y + j);
        // ∂x = (g − ⟨g, h'⟩ h') / |x|, none where h' is the fixed direction
        const bool moving = s.x_norm > tiny;
        const L rad = splat<L>(lane_sum(radial)), inv_x = splat<L>(moving ? T(1) / static_cast<T>(s.x_norm) : T(0));
        L on_h = splat<L>(T(0));
        T* ghr = gh + r * c;
        for (int64_t j = 0; j < c; j += w) {
          const L gx = (load<L>(g + j) - rad * load<L>(y + j)) * inv_x;
          store(acc + j, load<L>(acc + j) + gx * load<L>(dir.data() + j));
          const L gdv = gx * load<L>(alpha + j);
          store(gd.data() + j, gdv), store(ghr + j, gx);
          on_h += gdv * load<L>(hr + j);
        }
        const L along = splat<L>(static_cast<T>(s.along)), onh = splat<L>(lane_sum(on_h));
        L on_unit = splat<L>(T(0));
        for (int64_t j = 0; j < c; j += w) {  // ∂ô into gd, ∂h into gh
          const L gdv = load<L>(gd.data() + j), u = load<L>(unit.data() + j);
          if (tangent) {
            const L gu = gdv - onh * load<L>(hr + j);
            store(ghr + j, load<L>(ghr + j) - along * gdv - onh * u);
            store(gd.data() + j, gu);
            on_unit += gu * u;
          } else {
            store(ghr + j, load<L>(ghr + j) - gdv);
            on_unit += gdv * u;
          }
        }
        // ∂o = (∂ô − ⟨∂ô, ô⟩ ô) / max(|o|, 1e-12); F.normalize below its eps divides by the constant
        const L onu = splat<L>(s.o_norm > 1e-12 ? lane_sum(on_unit) : T(0));
        const L inv_o = splat<L>(T(1) / std::max(static_cast<T>(s.o_norm), T(1e-12)));
        T* gor = go + r * c;
        for (int64_t j = 0; j < c; j += w)
          store(gor + j, (load<L>(gd.data() + j) - onu * load<L>(unit.data() + j)) * inv_o);
      }
    }
  });
}

void check_sphere(const torch::Tensor& h, const torch::Tensor& o, const torch::Tensor& alpha) {
  check(h, "h", 2), check(o, "o", 2), check(alpha, "alpha", 1);
  TORCH_CHECK(o.sizes() == h.sizes() && alpha.size(0) == h.size(1), "sphere: expected h, o (R, C) and alpha (C,)");
}

}  // namespace

// h, o (R, C), alpha (C,) → h' (R, C).
inline torch::Tensor sphere_forward(torch::Tensor h, torch::Tensor o, torch::Tensor alpha, bool tangent) {
  check_sphere(h, o, alpha);
  auto out = torch::empty_like(h);
  const int64_t rows = h.size(0), c = h.size(1);
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "sphere_forward", [&] {
    const auto args = std::make_tuple(h.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(), alpha.data_ptr<scalar_t>());
    bool done = false;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (c % kLanes == 0) {
        sphere_forward_lanes<vf>(std::get<0>(args), std::get<1>(args), std::get<2>(args), tangent, rows, c,
                                 out.data_ptr<scalar_t>());
        done = true;
      }
    }
    if (!done)
      sphere_forward_lanes<scalar_t>(std::get<0>(args), std::get<1>(args), std::get<2>(args), tangent, rows, c,
                                     out.data_ptr<scalar_t>());
  });
  return out;
}

// The forward's inputs and output and ∂h' (R, C) → (∂h, ∂o (R, C), ∂α (C,)).
inline std::vector<torch::Tensor> sphere_backward(torch::Tensor h, torch::Tensor o, torch::Tensor alpha,
                                                  torch::Tensor out, torch::Tensor grad, bool tangent) {
  check_sphere(h, o, alpha), check(out, "out", 2), check(grad, "grad", 2);
  const int64_t rows = h.size(0), c = h.size(1), chunks = std::max<int64_t>(1, std::min<int64_t>(rows, 64));
  auto gh = torch::empty_like(h), go = torch::empty_like(o);
  auto partial = torch::zeros({chunks, c}, h.options());  // ∂α per fixed chunk of rows: no races
  AT_DISPATCH_FLOATING_TYPES(h.scalar_type(), "sphere_backward", [&] {
    const scalar_t *hp = h.data_ptr<scalar_t>(), *op = o.data_ptr<scalar_t>(), *ap = alpha.data_ptr<scalar_t>();
    const scalar_t *yp = out.data_ptr<scalar_t>(), *gp = grad.data_ptr<scalar_t>();
    scalar_t *ghp = gh.data_ptr<scalar_t>(), *gop = go.data_ptr<scalar_t>(), *pp = partial.data_ptr<scalar_t>();
    bool done = false;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (c % kLanes == 0) {
        sphere_backward_lanes<vf>(hp, op, ap, yp, gp, tangent, rows, c, ghp, gop, pp, chunks);
        done = true;
      }
    }
    if (!done) sphere_backward_lanes<scalar_t>(hp, op, ap, yp, gp, tangent, rows, c, ghp, gop, pp, chunks);
  });
  return {gh, go, partial.sum({0}, false, torch::kDouble).to(h.scalar_type())};
}
