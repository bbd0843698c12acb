// One multivector's D coordinates (8: Cl(3), 16: PGA and Cl(4)) as one SIMD value, for the kernels that
// move multivectors by small D × D matrices (frame.h, rotor_qkv.h): a row vector times a matrix given
// by its rows is then D broadcast multiply-adds, Σ_i x_i rows_i, which the compiler keeps in registers.

#pragma once

#include <cstring>

namespace mv_lanes {

// (per type: GCC ignores vector_size on a dependent alias)
template <typename T, int D>
struct Vec;
template <>
struct Vec<float, 8> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct Vec<float, 16> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct Vec<double, 8> {
  typedef double type __attribute__((vector_size(64)));
};
template <>
struct Vec<double, 16> {
  typedef double type __attribute__((vector_size(128)));
};

template <typename T, int D>
using V = typename Vec<T, D>::type;

template <typename T, int D>
inline V<T, D> load(const T* p) {
  V<T, D> x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <typename T, int D>
inline void store(T* p, V<T, D> x) {
  std::memcpy(p, &x, sizeof(x));
}

// Σ_i w_i rows_i: the row vector w times the matrix of those rows
template <typename T, int D>
inline V<T, D> combine(const T* w, const V<T, D>* rows) {
  V<T, D> acc = rows[0] * w[0];
  for (int i = 1; i < D; ++i) acc += rows[i] * w[i];
  return acc;
}

}  // namespace mv_lanes
