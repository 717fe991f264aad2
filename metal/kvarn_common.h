// kvarn_common.h: helpers shared by the KVarN kernels (passed as `header` to
// mx.fast.metal_kernel). Pure functions of their arguments; the threadgroup
// buffers they use are declared in the kernel bodies and passed in.

// Inputs are clamped to +/-KVARN_LIMIT and NaN -> 0 before quantizing, exactly
// as quant._prepare (nan_to_num then clip; +/-inf land on the clip bounds).
#define KVARN_LIMIT 16777216.0f  // 2^24
// Finite "minus infinity" for masked scores: keeps exp() and max() free of inf/NaN
// even under fast math.
#define KVARN_NEG (-1.0e30f)

inline float kvarn_sanitize(float v) {
  // NaN test on the bits: isnan() may be folded away under fast math.
  if ((as_type<uint>(v) & 0x7fffffffu) > 0x7f800000u) return 0.0f;
  return v > KVARN_LIMIT ? KVARN_LIMIT : (v < -KVARN_LIMIT ? -KVARN_LIMIT : v);
}

// A stored scale as float: float types cast, uint8 read as an e4m3 byte (fp8 scales:
// sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff, NaN, are never stored).
// Built from the bits, so exact under fast math.
inline float kvarn_scale(uchar u) {
  const uint e = (uint(u) >> 3) & 15u, m = uint(u) & 7u;
  const float x = e ? as_type<float>(((e + 120u) << 23) | (m << 20)) : float(m) * 0.001953125f;  // m * 2^-9
  return (u & 128u) ? -x : x;
}
template <typename T>
inline float kvarn_scale(T v) { return float(v); }

// Sum over the G tokens of a tile for every channel: each thread holds one
// partial per channel it owns (EPL channels lane*EPL+e, summed over its tokens);
// simdgroups hold disjoint token ranges, so partials are combined through
// threadgroup memory. On return v[e] holds the tile-wide total for channel
// lane*EPL+e. Deterministic: simdgroup partials are added in index order.
// OP 0 = sum, 1 = min, 2 = max.
template <int D, int EPL, int NSG, int OP>
inline void kvarn_channel_reduce(thread float* v, threadgroup uint* red, threadgroup float* chv,
                                 uint sg, uint lane, uint tid) {
  for (int e = 0; e < EPL; e++) red[sg * D + lane * EPL + e] = as_type<uint>(v[e]);
  // Barrier: every simdgroup's partials must be in `red` before they are combined.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < uint(D)) {
    float t = as_type<float>(red[tid]);
    for (int s = 1; s < NSG; s++) {
      float u = as_type<float>(red[s * D + tid]);
      t = OP == 0 ? t + u : (OP == 1 ? metal::min(t, u) : metal::max(t, u));
    }
    chv[tid] = t;
  }
  // Barrier: totals in `chv` must be complete before they are read, and all reads
  // of `red` above must finish before the next call overwrites it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = 0; e < EPL; e++) v[e] = chv[lane * EPL + e];
}

// Tile-wide max of `hi` and min of `lo` where each simdgroup already holds its
// own value (uniform across its lanes), e.g. a statistic over its tokens.
template <int NSG>
inline void kvarn_sg_maxmin(thread float& hi, thread float& lo, threadgroup float* gred,
                            uint sg, uint lane) {
  if (lane == 0) {
    gred[sg] = hi;
    gred[NSG + sg] = lo;
  }
  // Barrier: all simdgroups' values must be in `gred` before anyone reads them.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float h = gred[0], l = gred[NSG];
  for (int s = 1; s < NSG; s++) {
    h = metal::max(h, gred[s]);
    l = metal::min(l, gred[NSG + s]);
  }
  hi = h;
  lo = l;
  // Barrier: every thread has read `gred` before the next call rewrites it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
