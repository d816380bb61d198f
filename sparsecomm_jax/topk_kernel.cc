// Exact top-k by magnitude in a few passes over a float32 vector (host kernel).
//
// Same entries as lax.top_k(abs(x), k): magnitudes are ordered through the bit pattern
// of |x| (uint32 orders like the floats, NaN above inf), and among entries of equal
// magnitude the lower index wins. Results come in index order.
//
// Per row: (1) a strided sample gives a band [lo, hi] that holds the k-th largest
// magnitude with high probability; zeros are never candidates (lo >= the smallest positive
// magnitude), so a sparse row costs its nonzeros, not its length; (2) one pass over the
// row compacts the indices of the candidates (magnitude >= lo) and counts the entries
// above hi; (3) nth_element on the band's magnitudes finds the k-th magnitude v; (4) one
// pass over the candidates writes every entry above v and, in index order, as many equal
// to v as make k (and, when asked, the residual: x with the taken entries zeroed, in
// place when it is x's buffer). When the band misses (fewer than k at or above lo, or k
// or more above hi) every nonzero entry is a candidate: still exact, one pass slower.
// When a row has fewer than k nonzero entries the k-th magnitude is 0: every nonzero
// entry is taken, and the first zeros in index order make k.
//
// sparsecomm_merge is gTop-k's merge: two (value, index) lists summed (a merge when both
// come in index order, as the selection writes them), then the same exact top-k on the
// sums; the rest of the sum is returned as the dropped list.
//
// References: Lin et al., "Deep Gradient Compression", ICLR 2018 (sampled threshold).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace {

inline uint32_t key(const float* x, int64_t i) {
  uint32_t b;
  std::memcpy(&b, x + i, 4);
  return b & 0x7fffffffu;
}

// The band [lo, hi] from a strided sample: hi is taken a few standard deviations above
// the sample's estimate of the k-th magnitude and lo as many below.
void sample_band(const float* x, int64_t n, int64_t k, uint32_t* lo, uint32_t* hi) {
  const int64_t s = std::min<int64_t>(n, 16384);
  const int64_t stride = n / s;
  std::vector<uint32_t> sample(s);
  for (int64_t j = 0; j < s; ++j) sample[j] = key(x, j * stride);
  const double r = double(k) * s / n;  // expected rank of the k-th magnitude, from the top
  const double m = 4.0 * std::sqrt(r * (1.0 - r / s)) + 8.0;
  const int64_t r_hi = int64_t(r - m), r_lo = int64_t(std::ceil(r + m));
  *hi = 0xffffffffu;  // nothing above
  *lo = 0;            // everything at or above
  if (r_hi >= 1) {
    std::nth_element(sample.begin(), sample.begin() + (s - r_hi), sample.end());
    *hi = sample[s - r_hi];
  }
  if (r_lo <= s) {
    std::nth_element(sample.begin(), sample.begin() + (s - r_lo), sample.end());
    *lo = sample[s - r_lo];
  }
}

// Compacts the indices of entries at or above lo into cand (index order, branch-free);
// returns their number and counts the entries above hi into *above.
int64_t scan(const float* x, int64_t n, uint32_t lo, uint32_t hi, int32_t* cand,
             int64_t* above) {
  int64_t c = 0, a_hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = key(x, i);
    cand[c] = int32_t(i);
    c += a >= lo;
    a_hi += a > hi;
  }
  *above = a_hi;
  return c;
}

// Magnitudes of the candidates within the band (at most hi).
std::vector<uint32_t> band_keys(const float* x, const int32_t* cand, int64_t c, uint32_t hi,
                                int64_t above) {
  std::vector<uint32_t> keys;
  keys.reserve(size_t(c - std::min(c, above)));
  for (int64_t j = 0; j < c; ++j) {
    const uint32_t a = key(x, cand[j]);
    if (a <= hi) keys.push_back(a);
  }
  return keys;
}

// Fewer than k nonzero entries: all of them and the first k - nonzeros zeros, in index
// order (the tie rule of lax.top_k at magnitude 0).
void take_with_zeros(const float* x, int64_t n, int64_t k, int64_t nonzeros, float* vals,
                     int32_t* idx) {
  int64_t zeros = k - nonzeros, out = 0;
  for (int64_t i = 0; i < n && out < k; ++i) {
    if (key(x, i) > 0 || zeros-- > 0) {
      vals[out] = x[i];
      idx[out++] = int32_t(i);
    }
  }
}

// Every candidate above v and, in index order, the first `ties` equal to v.
void take(const float* x, const int32_t* cand, int64_t c, uint32_t v, int64_t ties,
          float* vals, int32_t* idx) {
  int64_t out = 0;
  for (int64_t j = 0; j < c; ++j) {
    const int32_t i = cand[j];
    const uint32_t a = key(x, i);
    if (a > v || (a == v && ties-- > 0)) {
      vals[out] = x[i];
      idx[out++] = i;
    }
  }
}

void topk_row(const float* x, int64_t n, int64_t k, float* vals, int32_t* idx,
              float* resid) {
  uint32_t lo, hi;
  sample_band(x, n, k, &lo, &hi);
  lo = std::max(lo, 1u);  // zeros are not candidates
  if (hi < lo) hi = 0xffffffffu;
  std::unique_ptr<int32_t[]> cand(new int32_t[n]);  // pages touched only as written
  int64_t above;
  int64_t c = scan(x, n, lo, hi, cand.get(), &above);
  std::vector<uint32_t> keys = band_keys(x, cand.get(), c, hi, above);
  int64_t need = k - above;  // entries the band must give
  const bool missed = need < 1 || (need > int64_t(keys.size()) && lo > 1);
  if (missed) {  // every nonzero entry is a candidate
    c = scan(x, n, 1, 0xffffffffu, cand.get(), &above);
    keys = band_keys(x, cand.get(), c, 0xffffffffu, 0);
    need = k;
  }
  if (need > int64_t(keys.size())) {  // here every nonzero entry is a candidate
    take_with_zeros(x, n, k, c, vals, idx);
  } else {
    std::nth_element(keys.begin(), keys.begin() + (keys.size() - need), keys.end());
    const uint32_t v = keys[keys.size() - need];  // the k-th largest magnitude
    int64_t ties = need;  // entries equal to v: need minus the band's ones above v
    for (size_t j = keys.size() - need; j < keys.size(); ++j) ties -= keys[j] > v;
    take(x, cand.get(), c, v, ties, vals, idx);
  }
  if (resid) {
    if (resid != x) std::memcpy(resid, x, size_t(n) * sizeof(float));
    for (int64_t j = 0; j < k; ++j) resid[idx[j]] = 0.0f;
  }
}

// (index, value) pairs of a and b, sorted by index (a's first among equal indices).
std::vector<std::pair<int32_t, float>> sorted_pairs(const float* va, const int32_t* ia,
                                                    const float* vb, const int32_t* ib,
                                                    int64_t n) {
  std::vector<std::pair<int32_t, float>> p(size_t(2 * n));
  for (int64_t j = 0; j < n; ++j) p[j] = {ia[j], va[j]};
  for (int64_t j = 0; j < n; ++j) p[n + j] = {ib[j], vb[j]};
  auto by_index = [](const auto& u, const auto& w) { return u.first < w.first; };
  auto a_end = p.begin() + n;
  if (!std::is_sorted(p.begin(), a_end, by_index)) std::stable_sort(p.begin(), a_end, by_index);
  if (!std::is_sorted(a_end, p.end(), by_index)) std::stable_sort(a_end, p.end(), by_index);
  std::inplace_merge(p.begin(), a_end, p.end(), by_index);  // stable: a before b
  return p;
}

// a + b (n entries each, any order, repeated indices summed): its k entries of largest
// magnitude (ties: lower index) into kv/ki, the other entries into dv/di (2n slots), both
// in index order; unused slots are padding (value 0 at index 0).
void merge_row(const float* va, const int32_t* ia, const float* vb, const int32_t* ib,
               int64_t n, int64_t k, float* kv, int32_t* ki, float* dv, int32_t* di) {
  auto p = sorted_pairs(va, ia, vb, ib, n);
  size_t m = 0;  // distinct indices, summed in place
  for (size_t j = 0; j < p.size(); ++j) {
    if (m && p[m - 1].first == p[j].first) {
      p[m - 1].second += p[j].second;
    } else {
      p[m++] = p[j];
    }
  }
  std::vector<uint32_t> keys(m);
  for (size_t j = 0; j < m; ++j) keys[j] = key(&p[j].second, 0);
  const int64_t need = std::min<int64_t>(k, int64_t(m));
  uint32_t v = 0;
  int64_t ties = need;
  if (need > 0) {
    std::nth_element(keys.begin(), keys.begin() + (m - need), keys.end());
    v = keys[m - need];
    for (size_t j = m - need; j < m; ++j) ties -= keys[j] > v;
  }
  std::fill(kv, kv + k, 0.0f);
  std::fill(ki, ki + k, 0);
  std::fill(dv, dv + 2 * n, 0.0f);
  std::fill(di, di + 2 * n, 0);
  int64_t kept = 0, left = 0;
  for (size_t j = 0; j < m; ++j) {
    const uint32_t a = key(&p[j].second, 0);
    if (a > v || (a == v && ties-- > 0)) {
      kv[kept] = p[j].second;
      ki[kept++] = p[j].first;
    } else {
      dv[left] = p[j].second;
      di[left++] = p[j].first;
    }
  }
}

}  // namespace

extern "C" {

// rows x n floats -> rows x k (values, int32 indices); resid (rows x n) may be null.
void sparsecomm_topk(const float* x, int64_t rows, int64_t n, int64_t k, float* vals,
                     int32_t* idx, float* resid) {
  for (int64_t r = 0; r < rows; ++r) {
    topk_row(x + r * n, n, k, vals + r * k, idx + r * k, resid ? resid + r * n : nullptr);
  }
}

// rows x n pairs of a and of b -> rows x k kept, rows x 2n dropped (see merge_row).
void sparsecomm_merge(const float* va, const int32_t* ia, const float* vb, const int32_t* ib,
                      int64_t rows, int64_t n, int64_t k, float* kv, int32_t* ki, float* dv,
                      int32_t* di) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = r * n;
    merge_row(va + o, ia + o, vb + o, ib + o, n, k, kv + r * k, ki + r * k, dv + 2 * o,
              di + 2 * o);
  }
}
}
