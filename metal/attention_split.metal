// KVarN decode attention over packed tiles, pass 1 of 2 (flash decoding).
// Body for mx.fast.metal_kernel; header: kvarn_common.h.
//
// One threadgroup = one (batch*kv head, row chunk of RC query rows, split).
// Query rows of a kv head: r = rep*L + i (GQA head kv*n_rep+rep, query i), so
// all its GQA heads share each read of a tile. Split 0 is the sink and split
// NS-1 the tail (model dtype, unrotated, scored with the unrotated query and
// accumulated unrotated); splits 1..NS-2 each take `tiles_per_split` packed tiles
// (scored with the rotated query, accumulated in the rotated space). Each split
// writes its own running max m, sum l and unnormalized output o (float32);
// attention_combine.metal merges them.
//
// inputs:  q [BH*R, D] (the queries, any float dtype); rot_k int32 [BH]: whether the keys
//          of (batch row, kv head) bh are stored rotated (the tile splits then score with
//          the rotated query, H q / sqrt(D), made here: no rotated copy in device memory)
//          sink_k, sink_v [BH, S, D] T; tail_k, tail_v [BH, Tn, D] T
//          tile storage, tile-major (tiles [0, n_tiles) are read; the rest is room):
//          k_words [NCAP, BH, D, G*KB/32] uint32; k_a, k_b [NCAP, BH, D] SC; k_t [NCAP, BH, G] SC
//          v_words [NCAP, BH, G, D*VB/32] uint32; v_a, v_b [NCAP, BH, G] SC; v_c [NCAP, BH, D] SC
//          (SC: a float type, or uint8 holding e4m3 scales: kvarn_scale reads either)
//          params int32 [n_tiles, BH, S, Tn, tiles_per_split, L, R, causal, NS, n_rc, Hkv, n_rows]
//          row_lens int32 [n_rows, 3]: per batch row (bh / Hkv; the last for rows beyond),
//            its own tiles, sink and tail tokens (<= n_tiles, S, Tn: the arrays' widths;
//            a batch pads shorter rows, and these leave the padding unread)
//          scale float32 [1]
// outputs: o_part [BH, NS, R, D], m_part [BH, NS, R], l_part [BH, NS, R] (float32)
// constants (declared before the body by kernels._kernel): T, SC, D, G, KB, VB, RC
// grid (256, NS, BH*n_rc), threadgroup (256, 1, 1).
//
// Thread -> data (scores): thread t scores token g = t/CP with channel part cp = t%CP (channels cp*DPC..+DPC) for all RC rows; (values): lane = cl*TL + tl, token lane tl takes tokens tl, tl+TL, ..., channels d0 = (sg*CL + cl)*4 .. d0+3, o[RC][4] in registers.
constexpr int NTH = 256;
constexpr int NSG = 8;
constexpr int CP = NTH / G;          // channel parts per token (score phase)
constexpr int DPC = D / CP;          // channels per part
constexpr int CPT = 4;               // channels per thread (value phase)
constexpr int CL = D / (CPT * NSG);  // channel lanes per simdgroup
constexpr int TL = 32 / CL;          // token lanes per simdgroup
// Codes are one LSB-first bitstream per row: a K row is a channel's G tokens, a V
// row a token's D channels. At 3, 5 and 6 bits a code may straddle two words.
constexpr int KW = G * KB / 32;      // words per channel row of a K tile
constexpr int VW = D * VB / 32;      // words per token row of a V tile
constexpr uint KMASK = (1u << KB) - 1u, VMASK = (1u << VB) - 1u;

threadgroup float QR[RC * D];  // tile splits: the query rows as the tiles' keys are stored
threadgroup float QA[RC * D];  // query rows with the tile's per-channel scale a_k folded in
threadgroup float QB[RC];      // sum_d q[d] * b_k[d]
threadgroup float SS[RC * G];  // scores of the current block
threadgroup float PA[RC * G];  // p * a_v (value scale folded into the probability)
threadgroup float PB[RC * G];  // p * b_v
threadgroup float CORR[RC];    // exp(m_old - m_new) per row

const int n_tiles = params[0], BH = params[1], S = params[2], Tn = params[3];
const int tps = params[4], L = params[5], R = params[6], causal = params[7], NS = params[8], n_rc = params[9];
const float sm_scale = scale[0];

const uint tid = thread_index_in_threadgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const int split = int(threadgroup_position_in_grid.y);
const int bh = int(threadgroup_position_in_grid.z) / n_rc;
const int rc = int(threadgroup_position_in_grid.z) % n_rc;
const int row0 = rc * RC;
const int Hkv = params[10], n_rows = params[11];
const int rb = metal::min(bh / Hkv, n_rows - 1);
const int n_own = row_lens[rb * 3], S_own = row_lens[rb * 3 + 1], Tn_own = row_lens[rb * 3 + 2];
const int total = S_own + n_own * G + Tn_own;

// score-phase coordinates
const int gs = int(tid) / CP, cp = int(tid) % CP;
// value-phase coordinates
const int tl = int(lane) % TL, cl = int(lane) / TL;
const int d0 = (int(sg) * CL + cl) * CPT;

// this split's blocks: dense (sink / tail) blocks of up to G tokens, or tiles
const bool dense = split == 0 || split == NS - 1;
const bool is_sink = split == 0;
const int dlen = is_sink ? S : Tn;  // width of this split's dense array (per kv head)
const int down = is_sink ? S_own : Tn_own;  // the row's own tokens in it
int nblk, first;
if (dense) { nblk = (down + G - 1) / G; first = 0; }
else {
  first = (split - 1) * tps;
  nblk = metal::max(0, metal::min(n_own, first + tps) - first);
}

float m_run = KVARN_NEG, l_run = 0.0f;  // meaningful in simdgroup sg < RC (row sg)
float o[RC][CPT];
for (int r = 0; r < RC; r++)
  for (int j = 0; j < CPT; j++) o[r][j] = 0.0f;

// ---- tile splits: the query rows in the keys' space, rotated when bh's keys are
// (the normalized Sylvester Hadamard transform, as mx.hadamard_transform; log2 D
// in-place butterfly stages, one pair (lo, lo + h) per thread per step)
if (!dense) {
  for (int idx = tid; idx < RC * D; idx += NTH) {
    const int row = row0 + idx / D;
    QR[idx] = row < R ? float(q[(size_t(bh) * R + row) * D + idx % D]) : 0.0f;
  }
  if (rot_k[bh]) {
    for (int h = 1; h < D; h <<= 1) {
      // Barrier: the load (or the previous stage) is complete before this stage reads.
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int p = tid; p < RC * D / 2; p += NTH) {
        const int j = p % (D / 2);
        const int lo = (p / (D / 2)) * D + (j / h) * 2 * h + j % h;
        const float a = QR[lo], b = QR[lo + h];
        QR[lo] = a + b;
        QR[lo + h] = a - b;
      }
    }
    // Barrier: the last stage is complete before the rows are scaled.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int idx = tid; idx < RC * D; idx += NTH) QR[idx] *= metal::rsqrt(float(D));
  }
  // Barrier: QR is complete before any thread reads it (block A below).
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int blk = 0; blk < nblk; blk++) {
  // block geometry: tile index n (packed) or dense rows [base, base+cnt)
  const int n = first + blk;
  const size_t tb = size_t(n) * BH + bh;  // packed tile index
  const int cnt = dense ? metal::min(G, down - blk * G) : G;
  const int pos0 = dense ? (is_sink ? 0 : S_own + n_own * G) + blk * G : S_own + n * G;
  const size_t dbase = (size_t(bh) * dlen + blk * G) * D;  // first row of a dense block

  // ---- A: fold the key scales into the query rows
  for (int idx = tid; idx < RC * D; idx += NTH) {
    const int r = idx / D, d = idx % D;
    const int row = row0 + r;
    if (dense) QA[idx] = row < R ? float(q[(size_t(bh) * R + row) * D + d]) : 0.0f;
    else QA[idx] = QR[idx] * kvarn_scale(k_a[tb * D + d]);
  }
  if (int(sg) < RC) {
    const int row = row0 + int(sg);
    float s = 0.0f;
    if (!dense && row < R)
      for (int d = lane; d < D; d += 32) s += QR[sg * D + d] * kvarn_scale(k_b[tb * D + d]);
    s = simd_sum(s);
    if (lane == 0) QB[sg] = s;
  }
  // Barrier: QA/QB complete before scoring; also every thread has finished the
  // previous block's value phase, so PA/PB/CORR may be rewritten below.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // ---- B: scores for token gs, channel part cp
  {
    float acc[RC];
    for (int r = 0; r < RC; r++) acc[r] = 0.0f;
    if (dense) {
      if (gs < cnt) {
        for (int j = 0; j < DPC; j++) {
          const int d = cp * DPC + j;
          // if/else, not ?: -- a 1-element placeholder buffer is `constant`, the other `device`
          float kv;
          if (is_sink) kv = float(sink_k[dbase + size_t(gs) * D + d]);
          else kv = float(tail_k[dbase + size_t(gs) * D + d]);
          for (int r = 0; r < RC; r++) acc[r] += QA[r * D + d] * kv;
        }
      }
    } else {
      const int bit = KB * gs, sh = bit % 32;
      const bool straddles = sh + KB > 32;  // only at 3, 5, 6 bits
      const size_t wb = tb * D * KW + bit / 32;
      for (int j = 0; j < DPC; j++) {
        const int d = cp * DPC + j;
        uint c = k_words[wb + size_t(d) * KW] >> sh;
        if (straddles) c |= k_words[wb + size_t(d) * KW + 1] << (32 - sh);
        const float code = float(c & KMASK);
        for (int r = 0; r < RC; r++) acc[r] += QA[r * D + d] * code;
      }
    }
    for (uint m = 1; m < uint(CP); m <<= 1)
      for (int r = 0; r < RC; r++) acc[r] += simd_shuffle_xor(acc[r], m);
    if (cp == 0) {
      const float tg = dense ? 1.0f : kvarn_scale(k_t[tb * G + gs]);
      const int pos = pos0 + gs;
      for (int r = 0; r < RC; r++) {
        const int i = (row0 + r) % L;
        const bool vis = gs < cnt && (causal == 0 || pos <= total - L + i);
        SS[r * G + gs] = vis ? sm_scale * tg * (acc[r] + QB[r]) : KVARN_NEG;
      }
    }
  }
  // Barrier: all scores of the block are in SS before the softmax reads them.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // ---- C: online softmax, one simdgroup per row
  if (int(sg) < RC) {
    const int r = sg;
    float mloc = KVARN_NEG;
    for (int g = lane; g < G; g += 32) mloc = metal::max(mloc, SS[r * G + g]);
    const float m_new = metal::max(m_run, simd_max(mloc));
    const float corr = metal::exp(m_run - m_new);
    float lsum = 0.0f;
    for (int g = lane; g < G; g += 32) {
      const float s = SS[r * G + g];
      const float p = s > 0.5f * KVARN_NEG ? metal::exp(s - m_new) : 0.0f;
      const float av = dense ? 1.0f : kvarn_scale(v_a[tb * G + g]);
      const float bv = dense ? 0.0f : kvarn_scale(v_b[tb * G + g]);
      PA[r * G + g] = p * av;
      PB[r * G + g] = p * bv;
      lsum += p;
    }
    l_run = l_run * corr + simd_sum(lsum);
    m_run = m_new;
    if (lane == 0) CORR[r] = corr;
  }
  // Barrier: PA/PB/CORR complete before the value phase reads them.
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // ---- D: values, o[r][j] = o*corr + c[d] * sum_g (pa*code + pb)
  {
    float cj[CPT];
    for (int r = 0; r < RC; r++) {
      const float cr = CORR[r];
      for (int j = 0; j < CPT; j++) o[r][j] *= cr;
    }
    for (int j = 0; j < CPT; j++) cj[j] = dense ? 1.0f : kvarn_scale(v_c[tb * D + d0 + j]);
    for (int g = tl; g < G; g += TL) {
      float val[CPT];
      if (dense) {
        for (int j = 0; j < CPT; j++) {
          val[j] = 0.0f;
          if (g < cnt) {
            if (is_sink) val[j] = float(sink_v[dbase + size_t(g) * D + d0 + j]);
            else val[j] = float(tail_v[dbase + size_t(g) * D + d0 + j]);
          }
        }
      } else {
        // The CPT codes of channels d0.. take CPT*VB <= 32 bits from bit d0*VB on: one word, or two.
        const size_t wi = (tb * G + g) * VW + d0 * VB / 32;
        const int sh = d0 * VB % 32;
        ulong w = v_words[wi];
        if (sh + CPT * VB > 32) w |= ulong(v_words[wi + 1]) << 32;
        w >>= sh;
        for (int j = 0; j < CPT; j++) val[j] = float(uint(w >> (VB * j)) & VMASK);
      }
      for (int r = 0; r < RC; r++) {
        const float pa = PA[r * G + g], pb = PB[r * G + g];
        for (int j = 0; j < CPT; j++) o[r][j] += cj[j] * (pa * val[j] + pb);
      }
    }
  }
}

// ---- write this split's partial results (sum over token lanes first)
for (uint m = 1; m < uint(TL); m <<= 1)
  for (int r = 0; r < RC; r++)
    for (int j = 0; j < CPT; j++) o[r][j] += simd_shuffle_xor(o[r][j], m);
if (tl == 0) {
  for (int r = 0; r < RC; r++) {
    const int row = row0 + r;
    if (row < R)
      for (int j = 0; j < CPT; j++) o_part[((size_t(bh) * NS + split) * R + row) * D + d0 + j] = o[r][j];
  }
}
if (int(sg) < RC && lane == 0 && row0 + int(sg) < R) {
  const size_t i = (size_t(bh) * NS + split) * R + row0 + sg;
  m_part[i] = m_run;
  l_part[i] = l_run;
}
