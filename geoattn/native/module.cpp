// The native CPU kernels as one Python module (built by geoattn.attention.native: `geoattn native
// build`, or the first use). Besides the kernels it reports what the build targets: `lanes` (float32s
// per vector), `isa` (the vector instructions the -march gave) and `flushes_subnormals()` (whether the
// calling thread flushes now; the kernels set their own mode and restore the caller's).

#include "frame.h"
#include "grade_norm.h"
#include "products.h"
#include "rotor_qkv.h"
#include "rt_lag.h"
#include "rt_qkv.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rt_lag_forward", &rt_lag_forward, "RT-Filter attention with a lag table, forward");
  m.def("rt_lag_backward", &rt_lag_backward, "RT-Filter attention with a lag table, backward");
  m.def("rt_qkv_forward", &rt_qkv_forward, "RT-Filter attention from the fused projection, forward");
  m.def("rt_qkv_backward", &rt_qkv_backward, "RT-Filter attention from the fused projection, backward");
  m.def("frame_forward", &frame_forward, "the frame head's per-token transform, forward");
  m.def("frame_backward", &frame_backward, "the frame head's per-token transform, backward");
  m.def("grade_norm_forward", &grade_norm_forward, "GradeLayerNorm, forward");
  m.def("grade_norm_backward", &grade_norm_backward, "GradeLayerNorm, backward");
  m.def("rotor_qkv_forward", &rotor_qkv_forward, "rotor attention's q, k, v per head group, positions applied");
  m.def("rotor_qkv_backward", &rotor_qkv_backward, "the same, backward");
  m.def("bilinear_product", &bilinear_product, "a sparse bilinear product of multivectors (a Cayley table)");
  m.def("bilinear_product_into", &bilinear_product_into, "the same, blade by blade, into given runs");
  m.attr("lanes") = kLanes;
  m.attr("isa") = kIsa;
  m.def("flushes_subnormals", &FlushSubnormals::active, "whether the calling thread flushes subnormals");
}
