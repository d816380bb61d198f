// Drives the CPU top-k kernel (sparsecomm_jax/topk/topk_kernel.cc) over edge cases, built
// with AddressSanitizer and UndefinedBehaviorSanitizer by tests/test_hostkernel.py: any
// out-of-bounds access or undefined behaviour aborts with the sanitizer's report, and
// every selection is checked against a sort. Exit status 0 when all is well.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

extern "C" {
void sparsecomm_topk(const float* x, int64_t rows, int64_t n, int64_t k, float* vals,
                     int32_t* idx, float* resid);
void sparsecomm_topk_parts(const float* const* x, const int64_t* len, int64_t nseg,
                           int64_t rows, int64_t k, float* vals, int32_t* idx,
                           float* const* resid);
void sparsecomm_add_parts(float* const* x, const int64_t* len, int64_t nseg, const float* v,
                          const int32_t* idx, int64_t m);
void sparsecomm_merge(const float* va, const int32_t* ia, const float* vb, const int32_t* ib,
                      int64_t rows, int64_t n, int64_t k, float* kv, int32_t* ki, float* dv,
                      int32_t* di);
}

namespace {

int failures = 0;

void check(bool ok, const char* what, int64_t n, int64_t k) {
  if (!ok) {
    std::fprintf(stderr, "FAILED %s (n=%lld, k=%lld)\n", what, (long long)n, (long long)k);
    ++failures;
  }
}

// The k entries of largest magnitude, ties to the lower index (lax.top_k's), in index order.
std::vector<int32_t> reference(const std::vector<float>& x, int64_t k) {
  std::vector<int32_t> order(x.size());
  for (size_t i = 0; i < x.size(); ++i) order[i] = int32_t(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  order.resize(static_cast<size_t>(k));
  std::sort(order.begin(), order.end());
  return order;
}

std::vector<float> draw(std::mt19937& rng, int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  std::uniform_int_distribution<int> kind(0, 9);
  std::normal_distribution<float> normal;
  for (auto& v : x) {
    switch (kind(rng)) {
      case 0: case 1: case 2: v = 0.0f; break;          // many zeros
      case 3: v = float(int(normal(rng) * 2)); break;  // ties
      case 4: v = -0.0f; break;
      default: v = normal(rng);
    }
  }
  return x;
}

void one_row(std::mt19937& rng, int64_t n, int64_t k) {
  std::vector<float> x = draw(rng, n), resid(static_cast<size_t>(n)), vals(static_cast<size_t>(k));
  std::vector<int32_t> idx(static_cast<size_t>(k));
  sparsecomm_topk(x.data(), 1, n, k, vals.data(), idx.data(), resid.data());
  check(std::vector<int32_t>(idx) == reference(x, k), "topk indices", n, k);
  for (int64_t j = 0; j < k; ++j) check(resid[static_cast<size_t>(idx[j])] == 0.0f, "residual", n, k);
}

void parts(std::mt19937& rng, int64_t n, int64_t k) {
  std::vector<float> x = draw(rng, n);
  const int64_t cut = n / 3;  // three parts, the middle one possibly empty
  std::vector<int64_t> len = {cut, 0, n - cut};
  std::vector<const float*> xs = {x.data(), x.data() + cut, x.data() + cut};
  std::vector<float> r(x);
  std::vector<float*> rs = {r.data(), r.data() + cut, r.data() + cut};
  std::vector<float> vals(static_cast<size_t>(k));
  std::vector<int32_t> idx(static_cast<size_t>(k));
  sparsecomm_topk_parts(xs.data(), len.data(), 3, 1, k, vals.data(), idx.data(), rs.data());
  check(idx == reference(x, k), "topk_parts indices", n, k);
}

void add(std::mt19937& rng, int64_t n) {
  std::vector<float> x(static_cast<size_t>(n), 0.0f), want(static_cast<size_t>(n), 0.0f);
  std::vector<int64_t> len = {n / 2, n - n / 2};
  std::vector<float*> xs = {x.data(), x.data() + n / 2};
  std::uniform_int_distribution<int32_t> at(-2 * int32_t(n), 2 * int32_t(n));
  std::vector<float> v(64);
  std::vector<int32_t> idx(64);
  for (size_t j = 0; j < v.size(); ++j) v[j] = float(j + 1), idx[j] = at(rng);
  idx[0] = int32_t(n), idx[1] = std::numeric_limits<int32_t>::max(), idx[2] = -1;
  for (size_t j = 0; j < v.size(); ++j) {  // jax's rule: negative from the end, else dropped
    const int64_t i = idx[j] < 0 ? int64_t(idx[j]) + n : int64_t(idx[j]);
    if (i >= 0 && i < n) want[static_cast<size_t>(i)] += v[j];
  }
  sparsecomm_add_parts(xs.data(), len.data(), 2, v.data(), idx.data(), int64_t(v.size()));
  check(x == want, "add_parts", n, 0);
}

void merge(std::mt19937& rng, int64_t n, int64_t k) {
  std::vector<float> va(static_cast<size_t>(n)), vb(static_cast<size_t>(n)), kv(static_cast<size_t>(k)), dv(static_cast<size_t>(2 * n));
  std::vector<int32_t> ia(static_cast<size_t>(n)), ib(static_cast<size_t>(n)), ki(static_cast<size_t>(k)), di(static_cast<size_t>(2 * n));
  std::uniform_int_distribution<int32_t> at(0, int32_t(2 * n));
  std::normal_distribution<float> normal;
  for (int64_t j = 0; j < n; ++j) va[j] = normal(rng), vb[j] = normal(rng);
  for (int64_t j = 0; j < n; ++j) ia[j] = at(rng), ib[j] = at(rng);
  sparsecomm_merge(va.data(), ia.data(), vb.data(), ib.data(), 1, n, k, kv.data(), ki.data(),
                   dv.data(), di.data());
  float sum_in = 0, sum_out = 0;
  for (int64_t j = 0; j < n; ++j) sum_in += va[j] + vb[j];
  for (int64_t j = 0; j < k; ++j) sum_out += kv[j];
  for (int64_t j = 0; j < 2 * n; ++j) sum_out += dv[j];
  check(std::fabs(sum_in - sum_out) < 1e-3f * (1 + std::fabs(sum_in)), "merge sum", n, k);
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  for (int64_t n : {1, 2, 3, 7, 64, 65, 200, 5000, 20000}) {
    for (int64_t k : {int64_t(1), n / 2 + 1, n}) {
      one_row(rng, n, k);
      parts(rng, n, k);
      merge(rng, n, k);
    }
    add(rng, n);
    // a k no row can give: nothing is read or written past the buffers
    std::vector<float> x(static_cast<size_t>(n), 1.0f), vals(static_cast<size_t>(n + 1)), resid(static_cast<size_t>(n));
    std::vector<int32_t> idx(static_cast<size_t>(n + 1));
    sparsecomm_topk(x.data(), 1, n, n + 1, vals.data(), idx.data(), resid.data());
    sparsecomm_topk(x.data(), 1, n, 0, vals.data(), idx.data(), resid.data());
    check(resid == x, "k out of range leaves the residual whole", n, n + 1);
  }
  std::printf("%s\n", failures ? "failures" : "ok");
  return failures ? 1 : 0;
}
