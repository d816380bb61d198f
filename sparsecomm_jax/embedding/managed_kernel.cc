// Host kernel of the managed tables (embedding/managed.py): one batch's ids mapped to
// slots, admitted and evicted, in one pass in place of numpy's many small calls.
//
// The policy is embedding/managed.py's, to the slot and the tie (its module doc):
// owners by splitmix64, admission after `threshold` reads, LRU or LFU eviction with
// ties to the lower slot and the slots read by the batch left out, `compete`, and at
// most N waiting ids (the most read, ties to the lower id). The id -> slot index is an
// open-addressing table (linear probing, backward-shift deletion) whose arrays belong
// to the caller, so that a saved mapping is plain arrays.
//
// Build: c++ -O3 -std=c++17 -shared -fPIC managed_kernel.cc -o managed_kernel.so

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

namespace {

uint64_t splitmix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Where an id's probe starts: the hash's high bits (the owner is the hash modulo G).
inline int64_t home(int64_t id, int64_t mask) {
  return static_cast<int64_t>(splitmix(static_cast<uint64_t>(id)) >> 20) & mask;
}

struct Index {
  int64_t* keys;   // int64[H]
  int64_t* slots;  // int64[H], -1 where empty
  int64_t mask;    // H - 1, H a power of two

  int64_t find(int64_t id) const {
    for (int64_t i = home(id, mask);; i = (i + 1) & mask) {
      if (slots[i] < 0) return -1;
      if (keys[i] == id) return slots[i];
    }
  }
  void put(int64_t id, int64_t slot) {
    int64_t i = home(id, mask);
    while (slots[i] >= 0 && keys[i] != id) i = (i + 1) & mask;
    keys[i] = id;
    slots[i] = slot;
  }
  void erase(int64_t id) {
    int64_t i = home(id, mask);
    while (slots[i] >= 0 && keys[i] != id) i = (i + 1) & mask;
    if (slots[i] < 0) return;
    for (int64_t j = i;;) {  // shift later entries of the run back over the hole
      j = (j + 1) & mask;
      if (slots[j] < 0) break;
      int64_t k = home(keys[j], mask);
      bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (stays) continue;
      keys[i] = keys[j];
      slots[i] = slots[j];
      i = j;
    }
    slots[i] = -1;
  }
};

struct Config {
  int64_t slots, workers, size;  // N, G, B = ceil(N / G)
  int64_t lfu, threshold, compete, step, score_cap;
};

// The unique ids of a batch, in order of first read, with their reads and, per read,
// the position of its id among them.
void unique(const int64_t* ids, int64_t n, std::vector<int64_t>& uniq,
            std::vector<int64_t>& reads, std::vector<int64_t>& inverse) {
  int64_t size = 16;
  while (size < 2 * n) size <<= 1;
  std::vector<int64_t> table(size, -1);
  inverse.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    int64_t i = home(ids[r], size - 1);
    while (table[i] >= 0 && uniq[table[i]] != ids[r]) i = (i + 1) & (size - 1);
    if (table[i] < 0) {
      table[i] = static_cast<int64_t>(uniq.size());
      uniq.push_back(ids[r]);
      reads.push_back(0);
    }
    reads[table[i]] += 1;
    inverse[r] = table[i];
  }
}

// Where `id` waits in `pending` (ascending), or -1.
int64_t waiting_at(const int64_t* pending, int64_t count, int64_t id) {
  const int64_t* at = std::lower_bound(pending, pending + count, id);
  return (at != pending + count && *at == id) ? at - pending : -1;
}

// The first `wanted` slots of worker w's block in the order new ids take them: free
// ones first, then by score (lowest first), ties to the lower slot, the zero row and the
// slots read by this batch (the `nread` of `read`) left out.
void candidates(const Config& c, int64_t w, int64_t wanted, const uint8_t* used,
                const int64_t* score, const int64_t* read, int64_t nread, int64_t* filled,
                std::vector<int64_t>& out) {
  int64_t lo = w * c.size + 1, hi = std::min((w + 1) * c.size, c.slots);
  out.clear();
  if (wanted <= hi - lo - filled[w]) {  // a slot once taken stays taken: free ones follow
    for (int64_t s = lo + filled[w]; s < lo + filled[w] + wanted; ++s) out.push_back(s);
    filled[w] += wanted;
    return;
  }
  std::vector<uint8_t> skip(hi - lo, 0);
  for (int64_t r = 0; r < nread; ++r) {
    if (lo <= read[r] && read[r] < hi) skip[read[r] - lo] = 1;
  }
  filled[w] = hi - lo;
  // the `wanted` lowest ranks (distinct): a max-heap of them, one comparison for most
  // slots (wanted is far below B where the block is full)
  std::vector<int64_t> rank;
  rank.reserve(wanted);
  for (int64_t s = lo; s < hi; ++s) {
    if (skip[s - lo]) continue;
    int64_t key = (used[s] ? std::min(score[s], c.score_cap) + 1 : 0) * c.size + (s - lo);
    if (static_cast<int64_t>(rank.size()) < wanted) {
      rank.push_back(key);
      std::push_heap(rank.begin(), rank.end());
    } else if (key < rank.front()) {
      std::pop_heap(rank.begin(), rank.end());
      rank.back() = key;
      std::push_heap(rank.begin(), rank.end());
    }
  }
  std::sort_heap(rank.begin(), rank.end());
  int64_t take = rank.size();
  for (int64_t k = 0; k < take; ++k) out.push_back(lo + rank[k] % c.size);
}

// Keeps, of `m` waiting ids (ascending) and their reads, the `cap` most read (ties to
// the lower id), in place and still ascending; returns `cap`. T, the reads of the
// cap-th id in that order, is found from the counts of each read count (or by
// selection where the counts run high): every id read more than T stays, and of those
// read T times the first in id order, as many as are left.
int64_t keep_most_read(int64_t* pending, int64_t* seen, int64_t m, int64_t cap) {
  auto [least, most] = std::minmax_element(seen, seen + m);
  int64_t t = 0, above = 0;
  if (*least >= 0 && *most <= 4 * m) {
    std::vector<int64_t> count(*most + 1, 0);
    for (int64_t k = 0; k < m; ++k) count[seen[k]] += 1;
    for (t = *most; above + count[t] < cap; --t) above += count[t];
  } else {
    std::vector<int64_t> values(seen, seen + m);
    std::nth_element(values.begin(), values.begin() + (cap - 1), values.end(),
                     std::greater<int64_t>());
    t = values[cap - 1];
    for (int64_t k = 0; k < m; ++k) above += seen[k] > t;
  }
  int64_t ties = cap - above, out = 0;
  for (int64_t k = 0; k < m; ++k) {
    if (seen[k] > t || (seen[k] == t && ties-- > 0)) {
      pending[out] = pending[k];
      seen[out++] = seen[k];
    }
  }
  return out;
}

}  // namespace

extern "C" {

// Slots of `n` ids (-1 where an id holds none).
void sparsecomm_vocab_find(int64_t* keys, int64_t* slots, int64_t mask, const int64_t* ids,
                           int64_t n, int64_t* out) {
  Index index{keys, slots, mask};
  for (int64_t r = 0; r < n; ++r) out[r] = index.find(ids[r]);
}

// The rows `n` ids start from (managed.initial_rows): float32[n, dim], uniform in
// [-scale, scale) from splitmix64 of (the id's hash + golden ratio x (column + 1)).
void sparsecomm_vocab_rows(const int64_t* ids, int64_t n, int64_t dim, float scale,
                           float* out) {
  for (int64_t r = 0; r < n; ++r) {
    uint64_t h = splitmix(static_cast<uint64_t>(ids[r]));
    for (int64_t c = 0; c < dim; ++c) {
      uint64_t key = h + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(c + 1);
      float unit = static_cast<float>(splitmix(key) >> 40) * 0x1p-23f - 1.0f;  // exact
      out[r * dim + c] = unit * scale;
    }
  }
}

// Adds `n` (id, slot) pairs to the index.
void sparsecomm_vocab_put(int64_t* keys, int64_t* slots, int64_t mask, const int64_t* ids,
                          const int64_t* values, int64_t n) {
  Index index{keys, slots, mask};
  for (int64_t r = 0; r < n; ++r) index.put(ids[r], values[r]);
}

// Maps one batch of `n` ids (managed.Vocabulary.map), changing the state in place.
//
// config: N, G, B, lfu, threshold, compete, the step number this batch gets, the cap
//   on scores (SCORE_LIMIT // B - 2).
// state: ids[N], used[N], score[N], filled[G] (taken slots per block), the index.
// pending/seen/npending: the waiting ids (ascending) and their reads.
// Outputs (capacities: n, n, n + npending):
//   mapped[n]: each read's slot (a waiting id its owner's zero row);
//   read_slots, read_scores: the held slots read and their scores before (count [0]);
//   taken_slots, taken_ids, taken_old_ids, taken_old_used, taken_old_score: the slots
//     new ids took, in order (by owner, then most read and lowest id), the ids they took
//     and what the slots held before (count [1]);
//   pending_out, seen_out: the waiting ids after, ascending (count [2]);
//   counts[3]: the ids evicted.
void sparsecomm_vocab_map(const int64_t* config, int64_t* ids_s, uint8_t* used,
                          int64_t* score, int64_t* filled, int64_t* keys, int64_t* slots,
                          int64_t mask, const int64_t* pending, const int64_t* seen,
                          int64_t npending, const int64_t* ids, int64_t n, int32_t* mapped,
                          int64_t* read_slots, int64_t* read_scores, int64_t* taken_slots,
                          int64_t* taken_ids, int64_t* taken_old_ids,
                          uint8_t* taken_old_used, int64_t* taken_old_score,
                          int64_t* pending_out, int64_t* seen_out, int64_t* counts) {
  Config c{config[0], config[1], config[2], config[3],
           config[4], config[5], config[6], config[7]};
  Index index{keys, slots, mask};
  std::vector<int64_t> uniq, reads, inverse;
  unique(ids, n, uniq, reads, inverse);
  int64_t u = uniq.size();
  std::vector<int64_t> slot(u);
  int64_t nread = 0;
  for (int64_t k = 0; k < u; ++k) {  // held ids: their scores
    slot[k] = index.find(uniq[k]);
    if (slot[k] < 0) continue;
    int64_t s = slot[k];
    read_slots[nread] = s;
    read_scores[nread++] = score[s];
    score[s] = c.lfu ? score[s] + reads[k] : c.step;
  }
  // new ids: their total reads, grouped by owner, most read then lowest id first
  std::vector<int64_t> total(u, 0);
  std::vector<uint8_t> now(npending, 0);  // waiting ids read now: admitted, or counted anew
  std::vector<std::vector<int64_t>> ready(c.workers);
  for (int64_t k = 0; k < u; ++k) {
    if (slot[k] >= 0) continue;
    int64_t at = waiting_at(pending, npending, uniq[k]);
    total[k] = reads[k] + (at >= 0 ? seen[at] : 0);
    if (at >= 0) now[at] = 1;
    if (total[k] >= c.threshold) {
      ready[splitmix(static_cast<uint64_t>(uniq[k])) % c.workers].push_back(k);
    }
  }
  int64_t ntaken = 0, evicted = 0;
  std::vector<int64_t> free;
  for (int64_t w = 0; w < c.workers; ++w) {
    std::vector<int64_t>& mine = ready[w];
    if (mine.empty()) continue;
    std::sort(mine.begin(), mine.end(), [&](int64_t a, int64_t b) {
      return total[a] != total[b] ? total[a] > total[b] : uniq[a] < uniq[b];
    });
    candidates(c, w, mine.size(), used, score, read_slots, nread, filled, free);
    for (size_t j = 0; j < free.size(); ++j) {
      int64_t k = mine[j], s = free[j];
      if (c.compete && used[s] && total[k] <= score[s]) break;  // it and all later wait
      taken_slots[ntaken] = s;
      taken_ids[ntaken] = uniq[k];
      taken_old_ids[ntaken] = ids_s[s];
      taken_old_used[ntaken] = used[s];
      taken_old_score[ntaken++] = score[s];
      if (used[s]) {
        index.erase(ids_s[s]);
        evicted += 1;
      }
      index.put(uniq[k], s);
      ids_s[s] = uniq[k];
      used[s] = 1;
      score[s] = c.lfu ? total[k] : c.step;
      slot[k] = s;
    }
  }
  // the waiting ids: those before not read now, and the new ones not admitted
  std::vector<std::pair<int64_t, int64_t>> wait;
  wait.reserve(npending + u);
  for (int64_t k = 0; k < u; ++k) {
    if (slot[k] < 0) wait.emplace_back(uniq[k], total[k]);
  }
  std::sort(wait.begin(), wait.end());
  int64_t m = 0;  // merged, ascending, into the outputs
  size_t j = 0;
  for (int64_t p = 0; p < npending; ++p) {
    for (; j < wait.size() && wait[j].first < pending[p]; ++j, ++m) {
      pending_out[m] = wait[j].first;
      seen_out[m] = wait[j].second;
    }
    if (!now[p]) {
      pending_out[m] = pending[p];
      seen_out[m++] = seen[p];
    }
  }
  for (; j < wait.size(); ++j, ++m) {
    pending_out[m] = wait[j].first;
    seen_out[m] = wait[j].second;
  }
  if (m > c.slots) m = keep_most_read(pending_out, seen_out, m, c.slots);
  for (int64_t r = 0; r < n; ++r) {
    int64_t k = inverse[r];
    int64_t s = slot[k] >= 0
                    ? slot[k]
                    : (splitmix(static_cast<uint64_t>(uniq[k])) % c.workers) * c.size;
    mapped[r] = static_cast<int32_t>(s);
  }
  counts[0] = nread;
  counts[1] = ntaken;
  counts[2] = m;
  counts[3] = evicted;
}

}  // extern "C"
