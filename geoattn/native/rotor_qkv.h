// Rotor attention's q, k and v from its projection, on the CPU: cut into head groups, each group's
// tensors laid out as the heads read them, and q and k moved by the rotor positional encoding's
// action, in one pass each way (geoattn.attention.rotor_qkv).
//
// In Python these are a split of (B, N, 3, H, C, D) into q, k and v, a batched (D × D) product per
// (head, position) for q and k (an einsum that copies its operand into the batch order and back), the
// permutes to (B, H, N, C, D) and a split per head group; backward, a concatenation for each split and
// a copy back into the projection's blade-by-blade order. Here, per token and head:
//
//     out_s[b, h, n, c, :] = A[b|0, h, n] · x[b, n, s, h, c, :]   (s = q, k; A the action, D × D)
//     out_v[b, h, n, c, :] = x[b, n, v, h, c, :]
//
// Layouts: x blade by blade, (D, B·N, 3, H, C) contiguous (geoattn.algebra.layout.blade_major: what the
// projection writes); A (1 or B, H, N, D, D) contiguous or empty (no positional encoding); the
// outputs, per group g of heads (`heads`: the heads of every group in turn, `sizes`: each group's
// count), q_g, k_g, v_g (B, H_g, N, C, D) contiguous. The backward writes ∂x in x's layout and ∂A.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "fpmode.h"
#include "multivector_lanes.h"

namespace rotor_qkv {

struct Shape {
  int64_t b, n, h, c, d;  // batch, tokens, heads, channels per head, blades
  int64_t actions;        // 0 (no action), 1 (shared by the batch) or b
};

// Where head h's rows go: its group and its slot in the group.
struct Place {
  int64_t group, slot, size;
};

inline std::vector<Place> places(const std::vector<int64_t>& heads, const std::vector<int64_t>& sizes,
                                 int64_t h) {
  std::vector<Place> at(h, Place{-1, 0, 0});
  int64_t k = 0;
  for (int64_t g = 0; g < static_cast<int64_t>(sizes.size()); ++g)
    for (int64_t j = 0; j < sizes[g]; ++j, ++k) at[heads[k]] = Place{g, j, sizes[g]};
  return at;
}

// the first number of out[b, slot, n, 0, 0] in a group of `size` heads
inline int64_t out_at(const Shape& sh, const Place& p, int64_t b, int64_t n) {
  return ((b * p.size + p.slot) * sh.n + n) * sh.c * sh.d;
}

// The action of one (batch row, head, position) as rows of Aᵀ (out = Σ_a in_a Aᵀ_a) and of A.
template <typename T, int D>
struct Action {
  mv_lanes::V<T, D> cols[D], rows[D];
  void load(const T* A) {
    T t[D * D];
    for (int e = 0; e < D; ++e)
      for (int a = 0; a < D; ++a) t[a * D + e] = A[e * D + a];
    for (int i = 0; i < D; ++i) cols[i] = mv_lanes::load<T, D>(t + i * D), rows[i] = mv_lanes::load<T, D>(A + i * D);
  }
};

// The work items: with an action shared by the batch, one per position (its heads' actions loaded once
// for every batch row, and ∂A[·, n] owned by it); otherwise one per token.
inline int64_t items(const Shape& sh) { return sh.actions == 1 ? sh.n : sh.b * sh.n; }

// Item `item` of `items`: its position and its batch rows [b0, b1).
inline void rows_of(const Shape& sh, int64_t item, int64_t& n, int64_t& b0, int64_t& b1) {
  if (sh.actions == 1) {
    n = item, b0 = 0, b1 = sh.b;
  } else {
    n = item % sh.n, b0 = item / sh.n, b1 = b0 + 1;
  }
}

// A token's numbers of x, blade by blade: D rows of 3·H·C, each contiguous in x (one read or write of
// each row, where a number at a time would go through D rows a whole plane apart, which share a cache
// set when the plane's size is a multiple of the page).
template <typename T, int D>
struct Tile {
  std::vector<T> rows;
  int64_t width, stride;
  Tile(const Shape& sh) : rows(D * 3 * sh.h * sh.c), width(3 * sh.h * sh.c), stride(sh.b * sh.n * width) {}
  void read(const T* x, int64_t m) {
    for (int a = 0; a < D; ++a) std::memcpy(&rows[a * width], x + a * stride + m * width, width * sizeof(T));
  }
  void write(T* x, int64_t m) const {
    for (int a = 0; a < D; ++a) std::memcpy(x + a * stride + m * width, &rows[a * width], width * sizeof(T));
  }
};

template <typename T, int D>
void forward_impl(const Shape& sh, const T* x, const T* action, const std::vector<Place>& at,
                  const std::vector<T*>& outs) {
  at::parallel_for(0, items(sh), sh.actions == 1 ? 1 : 16, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    std::vector<Action<T, D>> acts(sh.actions ? sh.h : 0);
    Tile<T, D> tile(sh);
    T in[D];
    for (int64_t item = begin; item < end; ++item) {
      int64_t n, b0, b1;
      rows_of(sh, item, n, b0, b1);
      for (int64_t head = 0; head < static_cast<int64_t>(acts.size()); ++head)
        acts[head].load(action + ((b0 * (sh.actions > 1) * sh.h + head) * sh.n + n) * D * D);
      for (int64_t b = b0; b < b1; ++b) {
        tile.read(x, b * sh.n + n);
        for (int64_t s = 0; s < 3; ++s)
          for (int64_t head = 0; head < sh.h; ++head) {
            const Place& p = at[head];
            T* out = outs[3 * p.group + s] + out_at(sh, p, b, n);
            const T* src = &tile.rows[(s * sh.h + head) * sh.c];
            for (int64_t ch = 0; ch < sh.c; ++ch, out += D) {
              for (int a = 0; a < D; ++a) in[a] = src[a * tile.width + ch];
              if (s < 2 && sh.actions)
                mv_lanes::store<T, D>(out, mv_lanes::combine<T, D>(in, acts[head].cols));  // out = A in
              else
                std::memcpy(out, in, sizeof(in));
            }
          }
      }
    }
  });
}

template <typename T, int D>
void backward_impl(const Shape& sh, const T* x, const T* action, const std::vector<Place>& at,
                   const std::vector<const T*>& grads, T* g_x, T* g_action) {
  at::parallel_for(0, items(sh), sh.actions == 1 ? 1 : 16, [&](int64_t begin, int64_t end) {
    const FlushSubnormals mode;
    const int64_t heads = sh.actions ? sh.h : 0;
    std::vector<Action<T, D>> acts(heads);
    std::vector<mv_lanes::V<T, D>> g_rows(heads * D);  // ∂A of each head, row by row
    Tile<T, D> tile(sh), g_tile(sh);
    T in[D], g[D], gin[D];
    for (int64_t item = begin; item < end; ++item) {
      int64_t n, b0, b1;
      rows_of(sh, item, n, b0, b1);
      const int64_t first = b0 * (sh.actions > 1) * sh.h * sh.n * D * D + n * D * D;  // head 0's action
      for (int64_t head = 0; head < heads; ++head) acts[head].load(action + first + head * sh.n * D * D);
      std::fill(g_rows.begin(), g_rows.end(), mv_lanes::V<T, D>{});
      for (int64_t b = b0; b < b1; ++b) {
        if (heads) tile.read(x, b * sh.n + n);
        for (int64_t s = 0; s < 3; ++s)
          for (int64_t head = 0; head < sh.h; ++head) {
            const Place& p = at[head];
            const T* go = grads[3 * p.group + s] + out_at(sh, p, b, n);
            const int64_t col = (s * sh.h + head) * sh.c;
            for (int64_t ch = 0; ch < sh.c; ++ch, go += D) {
              T* dst = &g_tile.rows[col + ch];
              if (s == 2 || !heads) {
                for (int a = 0; a < D; ++a) dst[a * tile.width] = go[a];
                continue;
              }
              std::memcpy(g, go, sizeof(g));
              mv_lanes::store<T, D>(gin, mv_lanes::combine<T, D>(g, acts[head].rows));  // ∂in = Aᵀ ∂out
              const T* src = &tile.rows[col + ch];
              for (int a = 0; a < D; ++a) in[a] = src[a * tile.width], dst[a * tile.width] = gin[a];
              const mv_lanes::V<T, D> in_v = mv_lanes::load<T, D>(in);
              for (int e = 0; e < D; ++e) g_rows[head * D + e] += in_v * g[e];  // ∂A[e, :] += ∂out_e in
            }
          }
        g_tile.write(g_x, b * sh.n + n);
      }
      for (int64_t head = 0; head < heads; ++head)
        for (int e = 0; e < D; ++e) mv_lanes::store<T, D>(g_action + first + head * sh.n * D * D + e * D, g_rows[head * D + e]);
    }
  });
}

inline Shape check(const torch::Tensor& x, const torch::Tensor& action, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& heads, const std::vector<int64_t>& sizes) {
  TORCH_CHECK(shape.size() == 5, "rotor_qkv: shape is (B, N, H, C, D)");
  Shape sh{shape[0], shape[1], shape[2], shape[3], shape[4], 0};
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.numel() == sh.d * sh.b * sh.n * 3 * sh.h * sh.c,
              "rotor_qkv: x must be contiguous (D, B·N, 3, H, C) on the CPU");
  TORCH_CHECK(sh.d == 8 || sh.d == 16, "rotor_qkv: D must be 8 or 16, got ", sh.d);
  if (action.numel()) {
    TORCH_CHECK(action.is_contiguous() && action.scalar_type() == x.scalar_type() && action.dim() == 5 &&
                    (action.size(0) == 1 || action.size(0) == sh.b) && action.size(1) == sh.h &&
                    action.size(2) == sh.n && action.size(3) == sh.d && action.size(4) == sh.d,
                "rotor_qkv: action (1 or B, H, N, D, D) contiguous, of x's dtype");
    sh.actions = action.size(0);
  }
  int64_t total = 0;
  for (auto size : sizes) total += size;
  TORCH_CHECK(total == sh.h && static_cast<int64_t>(heads.size()) == sh.h, "rotor_qkv: the groups must cover the heads");
  std::vector<bool> seen(sh.h, false);
  for (auto head : heads) {
    TORCH_CHECK(head >= 0 && head < sh.h && !seen[head], "rotor_qkv: each head in one group once");
    seen[head] = true;
  }
  return sh;
}

}  // namespace rotor_qkv

// x (D, B·N, 3, H, C), action (1|B, H, N, D, D) or empty, shape (B, N, H, C, D), the groups →
// [q_0, k_0, v_0, q_1, ...] (B, H_g, N, C, D) each
inline std::vector<torch::Tensor> rotor_qkv_forward(torch::Tensor x, torch::Tensor action, std::vector<int64_t> shape,
                                                    std::vector<int64_t> heads, std::vector<int64_t> sizes) {
  const auto sh = rotor_qkv::check(x, action, shape, heads, sizes);
  const auto at = rotor_qkv::places(heads, sizes, sh.h);
  std::vector<torch::Tensor> outs;
  for (auto size : sizes)
    for (int s = 0; s < 3; ++s) outs.push_back(torch::empty({sh.b, size, sh.n, sh.c, sh.d}, x.options()));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rotor_qkv_forward", [&] {
    std::vector<scalar_t*> ptrs;
    for (auto& t : outs) ptrs.push_back(t.data_ptr<scalar_t>());
    const scalar_t* A = sh.actions ? action.data_ptr<scalar_t>() : nullptr;
    if (sh.d == 8)
      rotor_qkv::forward_impl<scalar_t, 8>(sh, x.data_ptr<scalar_t>(), A, at, ptrs);
    else
      rotor_qkv::forward_impl<scalar_t, 16>(sh, x.data_ptr<scalar_t>(), A, at, ptrs);
  });
  return outs;
}

// … and the outputs' gradients (each contiguous, in the forward's order) → [∂x (x's layout), ∂action
// (action's shape; empty without one)]
inline std::vector<torch::Tensor> rotor_qkv_backward(torch::Tensor x, torch::Tensor action,
                                                     std::vector<torch::Tensor> grads, std::vector<int64_t> shape,
                                                     std::vector<int64_t> heads, std::vector<int64_t> sizes) {
  const auto sh = rotor_qkv::check(x, action, shape, heads, sizes);
  const auto at = rotor_qkv::places(heads, sizes, sh.h);
  TORCH_CHECK(grads.size() == 3 * sizes.size(), "rotor_qkv_backward: one gradient per output");
  for (size_t i = 0; i < grads.size(); ++i)
    TORCH_CHECK(grads[i].is_contiguous() && grads[i].scalar_type() == x.scalar_type() &&
                    grads[i].numel() == sh.b * sizes[i / 3] * sh.n * sh.c * sh.d,
                "rotor_qkv_backward: gradient ", i, " must be contiguous like its output");
  auto g_x = torch::empty_like(x);
  auto g_action = sh.actions ? torch::empty_like(action) : torch::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rotor_qkv_backward", [&] {
    std::vector<const scalar_t*> ptrs;
    for (auto& t : grads) ptrs.push_back(t.data_ptr<scalar_t>());
    const scalar_t* A = sh.actions ? action.data_ptr<scalar_t>() : nullptr;
    scalar_t* gA = sh.actions ? g_action.data_ptr<scalar_t>() : nullptr;
    if (sh.d == 8)
      rotor_qkv::backward_impl<scalar_t, 8>(sh, x.data_ptr<scalar_t>(), A, at, ptrs, g_x.data_ptr<scalar_t>(), gA);
    else
      rotor_qkv::backward_impl<scalar_t, 16>(sh, x.data_ptr<scalar_t>(), A, at, ptrs, g_x.data_ptr<scalar_t>(), gA);
  });
  return {g_x, g_action};
}
