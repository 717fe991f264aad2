// KVarN tile quantization: rotation + variance normalization + RTN + packing +
// absorbed scales for one tile per threadgroup (docs/algorithm.md: Rotation, Variance normalization,
// Rounding and packing, Absorbed scales).
// Body for mx.fast.metal_kernel; header: kvarn_common.h.
//
// inputs:  tiles [NT, G, D] (T: model dtype, tokens x channels, unrotated unless ROT == 0)
// outputs: KEYS: words [NT, D, G*BITS/32], a [NT, D], b [NT, D], col [NT, G]   (col = t)
//          else: words [NT, G, D*BITS/32], a [NT, G], b [NT, G], col [NT, D]   (col = c)
// constants (declared before the body by kernels._kernel): T, S (scale dtype), D, G, BITS,
//   ITERS, KEYS, ROT, NSG (simdgroups per threadgroup)
// grid (32*NSG, NT, 1), threadgroup (32*NSG, 1, 1).
//
// Thread -> data: simdgroup sg owns tokens [sg*RPS, sg*RPS+RPS), lane owns channels [lane*EPL, lane*EPL+EPL); x[r][e] (registers) = tile(token sg*RPS+r, channel lane*EPL+e).
//
// Orientation: the spec's matrix M is [D, G] for keys (rows = channels, cols =
// tokens) and [G, D] for values (rows = tokens, cols = channels); the registers
// hold the same numbers either way, only which factor is "column" changes.
// A per-token statistic (over channels) is a simd reduction; a per-channel
// statistic (over tokens) crosses simdgroups through threadgroup memory.
constexpr int EPL = D / 32;
constexpr int RPS = G / NSG;
constexpr int NTH = NSG * 32;
constexpr uint QMAX = (1u << BITS) - 1u;

threadgroup uint red[NSG * D];   // per-(simdgroup, channel) partials (float bits); codes as bytes when packing
threadgroup float chv[D];        // per-channel totals
threadgroup float gred[2 * NSG]; // per-simdgroup values for tile-wide max/min

const uint tile = threadgroup_position_in_grid.y;
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint tid = thread_index_in_threadgroup;

// ---- load, sanitize, rotate ------------------------------------------------
float x[RPS][EPL];
for (int r = 0; r < RPS; r++) {
  const size_t base = (size_t(tile) * G + sg * RPS + r) * D + lane * EPL;
  for (int e = 0; e < EPL; e++) x[r][e] = kvarn_sanitize(float(tiles[base + e]));
}
if (ROT) {
  // Fast Walsh-Hadamard transform along channels: strides < EPL inside the
  // lane, strides >= EPL across lanes (simd_shuffle_xor), scale 1/sqrt(D).
  const float hs = 1.0f / metal::precise::sqrt(float(D));
  for (int r = 0; r < RPS; r++) {
    for (int h = 1; h < EPL; h <<= 1) {
      for (int e = 0; e < EPL; e++) {
        if ((e & h) == 0) {
          float p = x[r][e], q = x[r][e + h];
          x[r][e] = p + q;
          x[r][e + h] = p - q;
        }
      }
    }
    for (uint m = 1; m < 32; m <<= 1) {
      const bool upper = (lane & m) != 0;
      for (int e = 0; e < EPL; e++) {
        float p = simd_shuffle_xor(x[r][e], m);
        x[r][e] = upper ? (p - x[r][e]) : (x[r][e] + p);
      }
    }
    for (int e = 0; e < EPL; e++) x[r][e] *= hs;
  }
}

// ---- variance normalization (spec section 2) ---------------------------------
// lt[r]: log factor of token sg*RPS+r; lc[e]: log factor of channel lane*EPL+e.
// cur = M / exp(log_col) / exp(log_row), divided in that order as the ops path.
float lt[RPS], lc[EPL], et[RPS], ec[EPL];
float best_lt[RPS], best_lc[EPL];
for (int r = 0; r < RPS; r++) { lt[r] = 0.0f; et[r] = 1.0f; best_lt[r] = 0.0f; }
for (int e = 0; e < EPL; e++) { lc[e] = 0.0f; ec[e] = 1.0f; best_lc[e] = 0.0f; }
float best = 0.0f;

for (int it = -1; it < ITERS; it++) {
  // it == -1 only measures the input's imbalance (the initial "best").
  for (int step = 0; step < 3; step++) {
    // step 0: std of the spec's columns and update log_c; step 1: rows and log_r;
    // step 2: both, for the imbalance. For keys columns are tokens, for values channels.
    if (it < 0 && step < 2) continue;
    const bool want_tok = step == 2 || (KEYS ? step == 0 : step == 1);
    const bool want_ch = step == 2 || (KEYS ? step == 1 : step == 0);
    float tstd[RPS];
    float cstd[EPL];
    if (want_tok) {
      for (int r = 0; r < RPS; r++) {
        float c[EPL];
        float s = 0.0f;
        for (int e = 0; e < EPL; e++) {
          c[e] = KEYS ? (x[r][e] / et[r]) / ec[e] : (x[r][e] / ec[e]) / et[r];
          s += c[e];
        }
        const float mean = simd_sum(s) / float(D);
        float q = 0.0f;
        for (int e = 0; e < EPL; e++) { const float dv = c[e] - mean; q += dv * dv; }
        tstd[r] = metal::precise::sqrt(simd_sum(q) / float(D - 1));
      }
    }
    if (want_ch) {
      float s[EPL];
      for (int e = 0; e < EPL; e++) {
        s[e] = 0.0f;
        for (int r = 0; r < RPS; r++) s[e] += KEYS ? (x[r][e] / et[r]) / ec[e] : (x[r][e] / ec[e]) / et[r];
      }
      kvarn_channel_reduce<D, EPL, NSG, 0>(s, red, chv, sg, lane, tid);
      float mean[EPL];
      for (int e = 0; e < EPL; e++) {
        mean[e] = s[e] / float(G);
        s[e] = 0.0f;
        for (int r = 0; r < RPS; r++) {
          const float dv = (KEYS ? (x[r][e] / et[r]) / ec[e] : (x[r][e] / ec[e]) / et[r]) - mean[e];
          s[e] += dv * dv;
        }
      }
      kvarn_channel_reduce<D, EPL, NSG, 0>(s, red, chv, sg, lane, tid);
      for (int e = 0; e < EPL; e++) cstd[e] = metal::precise::sqrt(s[e] / float(G - 1));
    }
    if (step < 2) {
      // log += log(clip(std, 1e-3, 1e3)), clipped to [-0.3, 10]
      if (want_tok) {
        for (int r = 0; r < RPS; r++) {
          lt[r] = metal::clamp(lt[r] + metal::precise::log(metal::clamp(tstd[r], 1e-3f, 1e3f)), -0.3f, 10.0f);
          et[r] = metal::precise::exp(lt[r]);
        }
      } else {
        for (int e = 0; e < EPL; e++) {
          lc[e] = metal::clamp(lc[e] + metal::precise::log(metal::clamp(cstd[e], 1e-3f, 1e3f)), -0.3f, 10.0f);
          ec[e] = metal::precise::exp(lc[e]);
        }
      }
    } else {
      // imbalance = max/max(min, 1e-8) of column stds + the same of row stds
      float thi = tstd[0], tlo = tstd[0];
      for (int r = 1; r < RPS; r++) { thi = metal::max(thi, tstd[r]); tlo = metal::min(tlo, tstd[r]); }
      kvarn_sg_maxmin<NSG>(thi, tlo, gred, sg, lane);
      float chi = cstd[0], clo = cstd[0];
      for (int e = 1; e < EPL; e++) { chi = metal::max(chi, cstd[e]); clo = metal::min(clo, cstd[e]); }
      chi = simd_max(chi);
      clo = simd_min(clo);
      const float imb = thi / metal::max(tlo, 1e-8f) + chi / metal::max(clo, 1e-8f);
      // Every thread computes the same imb from the same values: uniform branch.
      if (it < 0 || imb <= best) {
        best = imb;
        for (int r = 0; r < RPS; r++) best_lt[r] = lt[r];
        for (int e = 0; e < EPL; e++) best_lc[e] = lc[e];
      }
    }
  }
}

// ---- RTN per row of the balanced tile (spec section 3) ---------------------
for (int r = 0; r < RPS; r++) et[r] = metal::precise::exp(best_lt[r]);
for (int e = 0; e < EPL; e++) ec[e] = metal::precise::exp(best_lc[e]);
for (int r = 0; r < RPS; r++)
  for (int e = 0; e < EPL; e++) x[r][e] = KEYS ? (x[r][e] / et[r]) / ec[e] : (x[r][e] / ec[e]) / et[r];

// Row statistics: keys -> per channel (over tokens), values -> per token (over channels).
constexpr int NROW = EPL > RPS ? EPL : RPS;  // rows this thread owns: EPL (keys) or RPS (values)
float lo[NROW], scl[NROW], ra[NROW], rb[NROW];
if (KEYS) {
  float hi[EPL];
  for (int e = 0; e < EPL; e++) {
    lo[e] = x[0][e];
    hi[e] = x[0][e];
    for (int r = 1; r < RPS; r++) { lo[e] = metal::min(lo[e], x[r][e]); hi[e] = metal::max(hi[e], x[r][e]); }
  }
  kvarn_channel_reduce<D, EPL, NSG, 1>(lo, red, chv, sg, lane, tid);
  kvarn_channel_reduce<D, EPL, NSG, 2>(hi, red, chv, sg, lane, tid);
  for (int e = 0; e < EPL; e++) {
    scl[e] = metal::max((hi[e] - lo[e]) / float(QMAX), 1e-10f);
    ra[e] = ec[e] * scl[e];
    rb[e] = ec[e] * lo[e];
  }
} else {
  for (int r = 0; r < RPS; r++) {
    float l = x[r][0], h = x[r][0];
    for (int e = 1; e < EPL; e++) { l = metal::min(l, x[r][e]); h = metal::max(h, x[r][e]); }
    lo[r] = simd_min(l);
    const float hi = simd_max(h);
    scl[r] = metal::max((hi - lo[r]) / float(QMAX), 1e-10f);
    ra[r] = et[r] * scl[r];
    rb[r] = et[r] * lo[r];
  }
}

// ---- power-of-two split between row factors and column factors (quant.balance_exponents)
float row_max = 0.0f, col_max = 0.0f;
{
  float tmax = 0.0f, cmax = 0.0f;  // over this thread's tokens / channels
  if (KEYS) {
    for (int e = 0; e < EPL; e++) cmax = metal::max(cmax, metal::max(metal::abs(ra[e]), metal::abs(rb[e])));
    for (int r = 0; r < RPS; r++) tmax = metal::max(tmax, metal::abs(et[r]));
  } else {
    for (int r = 0; r < RPS; r++) tmax = metal::max(tmax, metal::max(metal::abs(ra[r]), metal::abs(rb[r])));
    for (int e = 0; e < EPL; e++) cmax = metal::max(cmax, metal::abs(ec[e]));
  }
  cmax = simd_max(cmax);
  float unused = 0.0f;
  kvarn_sg_maxmin<NSG>(tmax, unused, gred, sg, lane);
  row_max = KEYS ? cmax : tmax;
  col_max = KEYS ? tmax : cmax;
}
const float kexp = metal::rint((metal::precise::log2(metal::max(col_max, 1e-30f)) -
                               metal::precise::log2(metal::max(row_max, 1e-30f))) / 2.0f);
const float f = metal::precise::exp2(kexp);

// ---- outputs ---------------------------------------------------------------
if (KEYS) {
  if (sg == 0) {
    for (int e = 0; e < EPL; e++) {
      const size_t i = size_t(tile) * D + lane * EPL + e;
      a[i] = S(ra[e] * f);
      b[i] = S(rb[e] * f);
    }
  }
  if (lane == 0) {
    for (int r = 0; r < RPS; r++) col[size_t(tile) * G + sg * RPS + r] = S(et[r] / f);
  }
} else {
  if (lane == 0) {
    for (int r = 0; r < RPS; r++) {
      const size_t i = size_t(tile) * G + sg * RPS + r;
      a[i] = S(ra[r] * f);
      b[i] = S(rb[r] * f);
    }
  }
  if (sg == 0) {
    for (int e = 0; e < EPL; e++) col[size_t(tile) * D + lane * EPL + e] = S(ec[e] / f);
  }
}

// codes: clip(rint((balanced - lo) / scale), 0, qmax), packed as one LSB-first
// bitstream per row (keys: a channel's G tokens; values: a token's D channels);
// at 3, 5 and 6 bits a code may straddle two words. Codes of CH tokens at a time
// go through threadgroup memory as bytes (`red` is free: its last readers passed
// a barrier), then each thread assembles whole output words from them.
constexpr int CH = G < 4 * NSG ? G : 4 * NSG;  // tokens per pass: CH*D bytes fit in `red`
constexpr int WPR = KEYS ? G * BITS / 32 : D * BITS / 32;  // words per row
constexpr int CW = KEYS ? CH * BITS / 32 : WPR;            // words a pass completes per row
threadgroup uchar* cb = reinterpret_cast<threadgroup uchar*>(red);  // cb[token in pass * D + channel]
for (int t0 = 0; t0 < G; t0 += CH) {
  for (int r = 0; r < RPS; r++) {
    const int t = int(sg) * RPS + r - t0;
    if (t >= 0 && t < CH) {
      for (int e = 0; e < EPL; e++) {
        const float l = KEYS ? lo[e] : lo[r], sc = KEYS ? scl[e] : scl[r];
        const float u = metal::rint((x[r][e] - l) / sc);
        cb[t * D + lane * EPL + e] = uchar(metal::clamp(u, 0.0f, float(QMAX)));
      }
    }
  }
  // Barrier: the pass's codes are all in `cb` before any word is assembled.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  constexpr int ROWS = KEYS ? D : CH;  // rows with words in this pass
  for (int idx = tid; idx < ROWS * CW; idx += NTH) {
    const int row = idx / CW, w = idx % CW;
    uint word = 0;
    for (int i = (32 * w) / BITS; i <= (32 * w + 31) / BITS; i++) {  // codes touching bits [32w, 32w+32)
      const uint c = KEYS ? cb[i * D + row] : cb[row * D + i];
      const int sh = i * BITS - 32 * w;
      word |= sh >= 0 ? c << sh : c >> -sh;
    }
    if (KEYS) words[(size_t(tile) * D + row) * WPR + t0 * BITS / 32 + w] = word;
    else words[(size_t(tile) * G + t0 + row) * WPR + w] = word;
  }
  // Barrier: every word of the pass is read from `cb` before the next pass rewrites it.
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
