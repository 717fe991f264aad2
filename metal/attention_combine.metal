// KVarN decode attention, pass 2 of 2: merge the per-split softmax partials.
// Body for mx.fast.metal_kernel; header: kvarn_common.h.
//
// inputs:  o_part [BH, NS, R, D], m_part, l_part [BH, NS, R] (float32), params int32 (as pass 1)
// outputs: o_dense [BH*R, D] (unrotated: sink split 0 and tail split NS-1),
//          o_rot [BH*R, D] (rotated: the tile splits), both already divided by the total sum.
// template: D
// grid (D, BH*R, 1), threadgroup (min(D, 256), 1, 1).
//
// Thread -> data: thread (d, row) merges channel d of query row `row` (= bh*R + r) over all NS splits.
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
o_dense[size_t(row) * D + d] = od * inv;
o_rot[size_t(row) * D + d] = orot * inv;
