// Exact top-k by magnitude in a few passes over a float32 vector (host kernel).
//
// Same entries as lax.top_k(abs(x), k): magnitudes are ordered through the bit pattern
// of |x| (int32 orders like the floats, NaN above inf), and among entries of equal
// magnitude the lower index wins. Results come in index order. A row may be split over
// several buffers (the leaves of a fusion bucket), read as their concatenation.
//
// Per row: (1) a strided sample gives a band [lo, hi] that holds the k-th largest
// magnitude with high probability; zeros are never candidates (lo >= the smallest positive
// magnitude), so a sparse row costs its nonzeros, not its length; (2) one pass over the
// row compacts the candidates (magnitude >= lo; blocks without one are skipped after a
// vectorised test) and counts the entries above hi; (3) nth_element on the band's
// magnitudes finds the k-th magnitude v; (4) one pass over the candidates takes every
// entry above v and, in index order, as many equal to v as make k; the residual (x with
// the taken entries zeroed) is written over x's buffers when they are the same. When the
// band misses (fewer than k at or above lo, or k or more above hi) every nonzero entry is
// a candidate: still exact, one pass slower. When a row has fewer than k nonzero entries
// the k-th magnitude is 0: every nonzero entry is taken, and the first zeros in index
// order make k.
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

constexpr int32_t kNoBound = 0x7fffffff;  // hi of "nothing above": no magnitude exceeds it

inline int32_t key(float f) {
  int32_t b;
  std::memcpy(&b, &f, 4);
  return b & 0x7fffffff;
}

// A row split over nseg buffers, read as their concatenation (n entries in all).
struct Row {
  const float* const* x;
  const int64_t* len;
  int64_t nseg;
  int64_t n;
};

// Entries of a row read at increasing positions, one buffer after the other.
struct Cursor {
  const Row& row;
  int64_t seg = 0, off = 0;
  const float& at(int64_t i) {
    while (i >= off + row.len[seg]) off += row.len[seg++];
    return row.x[seg][i - off];
  }
};

struct Cand {
  int32_t i;
  float v;
};

// The band [lo, hi] from a strided sample: hi is taken a few standard deviations above
// the sample's estimate of the k-th magnitude and lo as many below (lo >= 1: zeros are
// not candidates).
void sample_band(const Row& row, int64_t k, int32_t* lo, int32_t* hi) {
  const int64_t n = row.n, s = std::min<int64_t>(n, 16384), stride = n / s;
  std::vector<int32_t> sample(s);
  Cursor cur{row};
  for (int64_t j = 0; j < s; ++j) sample[j] = key(cur.at(j * stride));
  const double r = double(k) * s / n;  // expected rank of the k-th magnitude, from the top
  const double m = 4.0 * std::sqrt(r * (1.0 - r / s)) + 8.0;
  const int64_t r_hi = int64_t(r - m), r_lo = int64_t(std::ceil(r + m));
  *hi = kNoBound;
  *lo = 1;
  if (r_hi >= 1) {
    std::nth_element(sample.begin(), sample.begin() + (s - r_hi), sample.end());
    *hi = sample[s - r_hi];
  }
  if (r_lo <= s) {
    std::nth_element(sample.begin(), sample.begin() + (s - r_lo), sample.end());
    *lo = std::max(sample[s - r_lo], 1);
  }
  if (*hi < *lo) *hi = kNoBound;
}

// Appends the entries of x[0, len) at or above lo to cand (index order, global indices
// from off); returns their number and adds the entries above hi to *above. Blocks of 64
// are tested first (a loop the compiler vectorises) and compacted only when they hold a
// candidate.
int64_t scan(const float* x, int64_t len, int64_t off, int32_t lo, int32_t hi, Cand* cand,
             int64_t* above) {
  constexpr int64_t B = 64;
  int64_t c = 0, a_hi = 0, i = 0;
  for (; i < len; i += B) {
    const int64_t end = std::min(len, i + B);
    int32_t any = 0, count = 0;
    for (int64_t j = i; j < end; ++j) {
      const int32_t a = key(x[j]);
      any |= a >= lo;
      count += a > hi;
    }
    a_hi += count;
    if (!any) continue;
    for (int64_t j = i; j < end; ++j) {
      cand[c] = {int32_t(off + j), x[j]};
      c += key(x[j]) >= lo;
    }
  }
  *above += a_hi;
  return c;
}

int64_t scan_row(const Row& row, int32_t lo, int32_t hi, Cand* cand, int64_t* above) {
  int64_t c = 0, off = 0;
  *above = 0;
  for (int64_t s = 0; s < row.nseg; off += row.len[s++]) {
    c += scan(row.x[s], row.len[s], off, lo, hi, cand + c, above);
  }
  return c;
}

// Magnitudes of the candidates within the band (at most hi).
std::vector<int32_t> band_keys(const Cand* cand, int64_t c, int32_t hi, int64_t above) {
  std::vector<int32_t> keys;
  keys.reserve(size_t(c - std::min(c, above)));
  for (int64_t j = 0; j < c; ++j) {
    const int32_t a = key(cand[j].v);
    if (a <= hi) keys.push_back(a);
  }
  return keys;
}

// Fewer than k nonzero entries, all candidates: them and the first k - c zeros, merged in
// index order (the tie rule of lax.top_k at magnitude 0).
void take_with_zeros(const Row& row, const Cand* cand, int64_t c, int64_t k, float* vals,
                     int32_t* idx) {
  Cursor cur{row};
  int64_t zeros = k - c, j = 0, out = 0;
  for (int64_t i = 0; out < k; ++i) {
    if (j < c && cand[j].i == i) {
      vals[out] = cand[j++].v;
    } else if (zeros-- > 0) {
      vals[out] = cur.at(i);
    } else {  // no zero is left to take: jump to the next candidate
      i = cand[j].i - 1;
      continue;
    }
    idx[out++] = int32_t(i);
  }
}

// Every candidate above v and, in index order, the first `ties` equal to v.
void take(const Cand* cand, int64_t c, int32_t v, int64_t ties, float* vals, int32_t* idx) {
  int64_t out = 0;
  for (int64_t j = 0; j < c; ++j) {
    const int32_t a = key(cand[j].v);
    if (a > v || (a == v && ties-- > 0)) {
      vals[out] = cand[j].v;
      idx[out++] = cand[j].i;
    }
  }
}

// x with the taken entries (idx, increasing) zeroed, into resid (x's buffers or copies).
void write_residual(const Row& row, float* const* resid, const int32_t* idx, int64_t k) {
  for (int64_t s = 0; s < row.nseg; ++s) {
    if (resid[s] != row.x[s]) std::memcpy(resid[s], row.x[s], size_t(row.len[s]) * 4);
  }
  int64_t seg = 0, off = 0;
  for (int64_t j = 0; j < k; ++j) {
    while (idx[j] >= off + row.len[seg]) off += row.len[seg++];
    resid[seg][idx[j] - off] = 0.0f;
  }
}

void topk_row(const Row& row, int64_t k, float* vals, int32_t* idx, float* const* resid) {
  int32_t lo, hi;
  sample_band(row, k, &lo, &hi);
  std::unique_ptr<Cand[]> cand(new Cand[row.n]);  // pages touched only as written
  int64_t above;
  int64_t c = scan_row(row, lo, hi, cand.get(), &above);
  std::vector<int32_t> keys = band_keys(cand.get(), c, hi, above);
  int64_t need = k - above;  // entries the band must give
  if (need < 1 || (need > int64_t(keys.size()) && lo > 1)) {  // missed: take every nonzero
    c = scan_row(row, 1, kNoBound, cand.get(), &above);
    keys = band_keys(cand.get(), c, kNoBound, 0);
    need = k;
  }
  if (need > int64_t(keys.size())) {  // here every nonzero entry is a candidate
    take_with_zeros(row, cand.get(), c, k, vals, idx);
  } else {
    std::nth_element(keys.begin(), keys.begin() + (keys.size() - need), keys.end());
    const int32_t v = keys[keys.size() - need];  // the k-th largest magnitude
    int64_t ties = need;  // entries equal to v: need minus the band's ones above v
    for (size_t j = keys.size() - need; j < keys.size(); ++j) ties -= keys[j] > v;
    take(cand.get(), c, v, ties, vals, idx);
  }
  if (resid) write_residual(row, resid, idx, k);
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
  std::vector<int32_t> keys(m);
  for (size_t j = 0; j < m; ++j) keys[j] = key(p[j].second);
  const int64_t need = std::min<int64_t>(k, int64_t(m));
  int32_t v = 0;
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
    const int32_t a = key(p[j].second);
    if (a > v || (a == v && ties-- > 0)) {
      kv[kept] = p[j].second;
      ki[kept++] = p[j].first;
    } else {
      dv[left] = p[j].second;
      di[left++] = p[j].first;
    }
  }
}

// A k no row can give (outside [1, n]): nothing is taken, the k slots are padding and the
// residual is the input (the Python side refuses such a k before any call; this keeps
// the kernel's memory safe whatever it is handed).
void take_nothing(int64_t rows, int64_t k, float* vals, int32_t* idx, const float* const* x,
                  const int64_t* len, int64_t nseg, float* const* resid) {
  if (k > 0) {
    std::fill(vals, vals + rows * k, 0.0f);
    std::fill(idx, idx + rows * k, 0);
  }
  for (int64_t s = 0; resid && s < nseg; ++s) {
    if (resid[s] != x[s]) std::memcpy(resid[s], x[s], size_t(len[s]) * 4);
  }
}

}  // namespace

extern "C" {

// rows x n floats -> rows x k (values, int32 indices); resid (rows x n) may be null.
void sparsecomm_topk(const float* x, int64_t rows, int64_t n, int64_t k, float* vals,
                     int32_t* idx, float* resid) {
  if (rows < 1 || n < 1) return;
  if (k < 1 || k > n) {
    const int64_t total = rows * n;
    take_nothing(rows, k, vals, idx, &x, &total, 1, resid ? &resid : nullptr);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* rr = resid ? resid + r * n : nullptr;
    topk_row(Row{&xr, &n, 1, n}, k, vals + r * k, idx + r * k, resid ? &rr : nullptr);
  }
}

// The concatenation of nseg buffers x[s] of len[s] floats, cut into `rows` rows of equal
// length -> rows x k (values, int32 indices within the row); resid (nseg buffers shaped
// like x) may be null.
void sparsecomm_topk_parts(const float* const* x, const int64_t* len, int64_t nseg,
                           int64_t rows, int64_t k, float* vals, int32_t* idx,
                           float* const* resid) {
  int64_t total = 0;
  for (int64_t s = 0; s < nseg; ++s) total += len[s];
  if (rows < 1 || total % rows) return;  // rows must cut the concatenation evenly
  const int64_t n = total / rows;
  if (n < 1 || k < 1 || k > n) {
    take_nothing(rows, k, vals, idx, x, len, nseg, resid);
    return;
  }
  std::vector<const float*> xs;
  std::vector<float*> rs;
  std::vector<int64_t> lens;
  int64_t s = 0, used = 0;  // buffer s, of which `used` floats went to earlier rows
  for (int64_t r = 0; r < rows; ++r) {
    xs.clear(), rs.clear(), lens.clear();
    for (int64_t left = n; left > 0;) {
      while (used == len[s]) ++s, used = 0;
      const int64_t take = std::min(left, len[s] - used);
      xs.push_back(x[s] + used);
      rs.push_back(resid ? resid[s] + used : nullptr);
      lens.push_back(take);
      used += take, left -= take;
    }
    const Row row{xs.data(), lens.data(), int64_t(lens.size()), n};
    topk_row(row, k, vals + r * k, idx + r * k, resid ? rs.data() : nullptr);
  }
}

// x (one row split over nseg buffers, updated in place) += the m (value, index) pairs,
// indices into the concatenation (repeated ones add up). As jax's scatter-add: a negative
// index counts from the end, an index outside the row after that is dropped.
void sparsecomm_add_parts(float* const* x, const int64_t* len, int64_t nseg, const float* v,
                          const int32_t* idx, int64_t m) {
  std::vector<int64_t> start(size_t(nseg) + 1, 0);
  for (int64_t s = 0; s < nseg; ++s) start[s + 1] = start[s] + len[s];
  const int64_t total = start[nseg];
  for (int64_t j = 0; j < m; ++j) {
    const int64_t i = idx[j] < 0 ? int64_t(idx[j]) + total : int64_t(idx[j]);
    if (i < 0 || i >= total) continue;
    const int64_t s = std::upper_bound(start.begin(), start.end(), i) - start.begin() - 1;
    x[s][i - start[s]] += v[j];
  }
}

// rows x n pairs of a and of b -> rows x k kept, rows x 2n dropped (see merge_row).
void sparsecomm_merge(const float* va, const int32_t* ia, const float* vb, const int32_t* ib,
                      int64_t rows, int64_t n, int64_t k, float* kv, int32_t* ki, float* dv,
                      int32_t* di) {
  if (k < 1 || n < 0) return;  // refused by the Python side before any call
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = r * n;
    merge_row(va + o, ia + o, vb + o, ib + o, n, k, kv + r * k, ki + r * k, dv + 2 * o,
              di + 2 * o);
  }
}
}
