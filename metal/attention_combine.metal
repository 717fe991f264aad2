// KVarN decode attention, pass 2 of 2: merge the per-split softmax partials, then
// rotate the tile splits' part back and add the dense splits' part.
// Body for mx.fast.metal_kernel; header: kvarn_common.h.
//
// inputs:  o_part [BH, NS, R, D], m_part, l_part [BH, NS, R] (float32), params int32 (as pass 1)
// outputs: out [BH*R, D] T: o_dense + H(o_rot), where o_dense is the unrotated sink (split 0)
//          and tail (split NS-1) part, o_rot the rotated tile splits' part (H: the
//          normalized Sylvester Hadamard transform, as mx.hadamard_transform, when ROT;
//          else the identity), both divided by the total sum.
// constants (declared before the body by kernels._kernel): T (output dtype), D (a power of
//   two, <= 256), ROT (values stored rotated)
// grid (D, BH*R, 1), threadgroup (D, 1, 1): one threadgroup per query row.
//
// Thread -> data: thread (d, row) merges channel d of query row `row` (= bh*R + r) over all
// NS splits; the row's D threads then transform o_rot in threadgroup memory (log2 D
// butterfly stages).
threadgroup float rot[D];

const int R = params[6], NS = params[8];
const uint d = thread_position_in_grid.x;
const uint row = thread_position_in_grid.y;
const size_t bh = row / uint(R), r = row % uint(R);

float mstar = KVARN_NEG;
for (int s = 0; s < NS; s++) mstar = metal::max(mstar, m_part[(bh * NS + s) * R + r]);
float lsum = 0.0f, od = 0.0f, orot = 0.0f;
for (int s = 0; s < NS; s++) {
  const size_t i = (bh * NS + s) * R + r;
  const float l = l_part[i];
  if (l > 0.0f) {  // empty splits (no visible token) carry m = KVARN_NEG, l = 0
    const float w = metal::exp(m_part[i] - mstar);
    lsum += w * l;
    const float v = w * o_part[i * D + d];
    if (s == 0 || s == NS - 1) od += v; else orot += v;
  }
}
const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
float x = orot * inv;
if (ROT) {
  rot[d] = x;
  threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  for (uint h = 1; h < uint(D); h <<= 1) {
    const float a = rot[d], b = rot[d ^ h];
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    rot[d] = (d & h) ? b - a : a + b;
    threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  }
  x = rot[d] * metal::rsqrt(float(D));
}
out[size_t(row) * D + d] = T(od * inv + x);
