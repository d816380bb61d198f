// Drives the managed tables' host kernel (sparsecomm_jax/embedding/managed_kernel.cc)
// over skewed streams, built with AddressSanitizer and UndefinedBehaviorSanitizer by
// tests/test_managed.py: any out-of-bounds access or undefined behaviour aborts with the
// sanitizer's report. After every batch the index must agree with the slots (each held
// id found at its slot, no id held twice, absent ids not found) and every read's slot
// must hold its id or be its owner's zero row. Exit status 0 when all is well.

#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <vector>

extern "C" {
void sparsecomm_vocab_find(int64_t* keys, int64_t* slots, int64_t mask, const int64_t* ids,
                           int64_t n, int64_t* out);
void sparsecomm_vocab_map(const int64_t* config, int64_t* ids_s, uint8_t* used,
                          int64_t* score, int64_t* filled, int64_t* keys, int64_t* slots,
                          int64_t mask, const int64_t* pending, const int64_t* seen,
                          int64_t npending, const int64_t* ids, int64_t n, int32_t* mapped,
                          int64_t* read_slots, int64_t* read_scores, int64_t* taken_slots,
                          int64_t* taken_ids, int64_t* taken_old_ids,
                          uint8_t* taken_old_used, int64_t* taken_old_score,
                          int64_t* pending_out, int64_t* seen_out, int64_t* counts);
}

namespace {

int failures = 0;

void check(bool ok, const char* what, int64_t step) {
  if (!ok && failures++ < 10) std::fprintf(stderr, "FAILED %s at batch %lld\n", what, (long long)step);
}

// One table of `n_slots` slots on `workers` workers, fed `steps` batches of `batch` ids
// drawn from `distinct` values (extremes included) with Zipf-like skew.
void run(int64_t n_slots, int64_t workers, int64_t lfu, int64_t threshold, int64_t compete,
         int64_t batch, int64_t distinct, int64_t steps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> values(distinct);
  for (auto& v : values) v = static_cast<int64_t>(rng());
  values[0] = 0;
  values[1] = std::numeric_limits<int64_t>::max();
  values[2] = std::numeric_limits<int64_t>::min();
  values[3] = -1;
  int64_t size = (n_slots + workers - 1) / workers, h = 16;
  while (h < 2 * n_slots) h *= 2;
  std::vector<int64_t> ids_s(n_slots, 0), score(n_slots, 0), filled(workers, 0);
  std::vector<uint8_t> used(n_slots, 0);
  std::vector<int64_t> keys(h, 0), slots(h, -1), pending, seen;
  std::geometric_distribution<int64_t> pick(0.02);
  for (int64_t step = 1; step <= steps; ++step) {
    std::vector<int64_t> ids(batch);
    for (auto& i : ids) i = values[pick(rng) % distinct];
    int64_t config[8] = {n_slots, workers, size,   lfu,
                         threshold, compete, step, (int64_t(1) << 62) / size - 2};
    int64_t w = pending.size();
    std::vector<int32_t> mapped(batch);
    std::vector<int64_t> a(batch), b(batch), c(batch), d(batch), e(batch), f(batch);
    std::vector<uint8_t> g(batch);
    std::vector<int64_t> p_out(batch + w), s_out(batch + w), counts(4);
    sparsecomm_vocab_map(config, ids_s.data(), used.data(), score.data(), filled.data(),
                         keys.data(), slots.data(), h - 1, pending.data(), seen.data(), w,
                         ids.data(), batch, mapped.data(), a.data(), b.data(), c.data(),
                         d.data(), e.data(), g.data(), f.data(), p_out.data(), s_out.data(),
                         counts.data());
    pending.assign(p_out.begin(), p_out.begin() + counts[2]);
    seen.assign(s_out.begin(), s_out.begin() + counts[2]);
    check(counts[2] <= n_slots, "at most N ids wait", step);
    std::set<int64_t> held;
    for (int64_t s = 0; s < n_slots; ++s) {
      if (!used[s]) continue;
      check(s % size != 0, "a zero row holds no id", step);
      check(held.insert(ids_s[s]).second, "no id is held twice", step);
      int64_t found = -1;
      sparsecomm_vocab_find(keys.data(), slots.data(), h - 1, &ids_s[s], 1, &found);
      check(found == s, "the index finds each held id at its slot", step);
    }
    for (int64_t r = 0; r < batch; ++r) {
      int64_t s = mapped[r];
      check(0 <= s && s < n_slots, "a read's slot is in the table", step);
      if (s % size == 0) {
        check(held.count(ids[r]) == 0, "a held id reads its own slot", step);
      } else {
        check(used[s] && ids_s[s] == ids[r], "a read's slot holds its id", step);
      }
    }
    int64_t absent = static_cast<int64_t>(rng()), found = 0;
    sparsecomm_vocab_find(keys.data(), slots.data(), h - 1, &absent, 1, &found);
    check(found == -1 || held.count(absent), "an absent id is not found", step);
  }
}

}  // namespace

int main() {
  for (int64_t lfu = 0; lfu < 2; ++lfu) {
    for (int64_t threshold : {1, 3}) {
      run(40, 4, lfu, threshold, 0, 64, 500, 200, 1 + lfu + threshold);
      run(9, 1, lfu, threshold, 0, 50, 100, 100, 7 + lfu);
      run(1003, 8, lfu, threshold, 0, 300, 20000, 100, 11 + threshold);
    }
  }
  run(40, 4, 1, 1, 1, 64, 500, 200, 5);
  run(40, 4, 1, 2, 1, 0, 500, 3, 6);  // empty batches
  if (failures) return 1;
  std::printf("ok\n");
  return 0;
}
