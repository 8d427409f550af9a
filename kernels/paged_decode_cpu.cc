// Paged decode attention for the CPU backend, called through the XLA FFI
// (kernels/paged_decode_cpu.py builds, loads and documents it).
//
// One query token per sequence attends to its cached keys read in place from the page pool:
// no gathered copy of the pages, two passes per (sequence, kv head) row (scores over the keys,
// then the probability-weighted values), float32 arithmetic whatever the page dtype.
// Rows are spread over XLA's intra-op thread pool. Head dims of 32, 64 and 128 with pages of a
// multiple of 16 keys run on 16-float vectors (RowVec) where the CPU has AVX-512; other shapes
// and CPUs on scalar loops (Row).
//
// Shapes (B sequences, N query heads, K kv heads, G = N / K, H head dim, P pages, L page size,
// J block-table width; a leading dim of 1 in place of K means "the same for every kv head"):
//   q f32 [B, N, H]; k_pages, v_pages [P, L, K, H] f32 | bf16 | s8;
//   k_scales, v_scales f32 [P, K] (s8 pages; else a [1, 1] placeholder);
//   tables s32 [B, K or 1, J]; lengths s32 [B, K or 1]; kv_mask pred [B, K or 1, J * L]
//   (used iff use_mask);
//   out f32 [B, N, H]; lse f32 [B, N] (-inf and out 0 where no key is visible).
// Key t of a row (logical position, t = j * L + o for page slot j) is visible iff
//   max(0, length - window) <= t < length (window 0: no window) and kv_mask[t].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxGroup = 64;   // G
constexpr int64_t kMaxHeadDim = 512;  // H

struct Call {
  const float* q;
  const void* k;
  const void* v;
  const float* k_scales;  // null for float pages
  const float* v_scales;
  const int32_t* tables;
  const int32_t* lengths;
  const bool* mask;  // null: no key mask
  float* out;
  float* lse;
  int64_t B, N, H, P, L, K, J, G;
  int64_t tables_k, lengths_k, mask_k;  // K or 1
  int64_t window;
  float scale;
};

// exp(x) for x <= 0, 0 below -87 (-inf included): Cody-Waite range reduction and the classic
// degree-5 minimax polynomial (relative error about 1e-7); branch-free, so loops vectorise.
inline float ExpNonPositive(float x) {
  const bool under = !(x > -87.0f);
  x = under ? 0.0f : x;
  const float round = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to integer
  const float n = (x * 1.44269504088896341f + round) - round;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return under ? 0.0f : e * two_n;
}

template <typename T>
inline float Load(const T* x, int64_t i);
template <>
inline float Load<float>(const float* x, int64_t i) {
  return x[i];
}
template <>
inline float Load<int8_t>(const int8_t* x, int64_t i) {
  return static_cast<float>(x[i]);
}
template <>
inline float Load<uint16_t>(const uint16_t* x, int64_t i) {  // bfloat16 bits
  const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// s[i] = exp(s[i] - max) in place over n scores (max: their maximum, a NaN one included, or
// -inf: no shift then); returns their sum.
inline float ExpInPlace(float* s, int64_t n, float max) {
  const float shift = std::isfinite(max) ? max : 0.0f;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float e = ExpNonPositive(s[i] - shift);
    s[i] = e;
    sum += e;
  }
  return sum;
}

// Softmax numerators in place over each of G score rows of n_keys, their sums and the row
// maxima (NaN when a score is NaN: the row is then NaN, as in the reference).
inline void Softmax(float* scores, int64_t G, int64_t n_keys, float* row_max, float* denom) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n_keys;
    float m = -INFINITY;
    bool nan = false;
    for (int64_t i = 0; i < n_keys; ++i) {
      nan |= std::isnan(s[i]);
      m = std::max(m, s[i]);
    }
    if (nan) m = NAN;
    row_max[g] = m;
    denom[g] = ExpInPlace(s, n_keys, m);
  }
}

// Normalises the G weighted-value rows in out and writes their log-sum-exps.
inline void Finish(float* out, float* lse, int64_t G, int64_t H, const float* row_max,
                   const float* denom) {
  for (int64_t g = 0; g < G; ++g) {
    const bool nan = std::isnan(row_max[g]);
    const bool seen = denom[g] > 0.0f;
    const float inv = nan ? NAN : seen ? 1.0f / denom[g] : 0.0f;
    for (int64_t h = 0; h < H; ++h) out[g * H + h] *= inv;
    lse[g] = nan ? NAN : seen ? row_max[g] + std::log(denom[g]) : -INFINITY;
  }
}

// What a (sequence b, kv head kh) row reads and writes: its query heads, outputs, block table,
// key mask and the pages holding its visible keys (slots j0 .. j1 - 1, n_keys keys). kH: the
// head dim when the caller fixes it at compile time (0: the call's).
template <typename T, int64_t kH = 0>
struct RowView {
  const Call& c;
  const int64_t kh, G, H, L, K;
  const T* kp;
  const T* vp;
  const float* q;
  float* out;
  float* lse;
  int64_t len, lo, j0, j1, n_keys;
  const int32_t* table;
  const bool* mask;

  RowView(const Call& call, int64_t b, int64_t head)
      : c(call), kh(head), G(c.G), H(c.H), L(c.L), K(c.K), kp(static_cast<const T*>(c.k)),
        vp(static_cast<const T*>(c.v)), q(c.q + (b * c.N + kh * G) * H),
        out(c.out + (b * c.N + kh * G) * H), lse(c.lse + b * c.N + kh * G) {
    len = std::clamp<int64_t>(c.lengths[b * c.lengths_k + (c.lengths_k > 1 ? kh : 0)], 0,
                              c.J * L);
    lo = c.window > 0 ? std::max<int64_t>(0, len - c.window) : 0;
    table = c.tables + (b * c.tables_k + (c.tables_k > 1 ? kh : 0)) * c.J;
    mask = c.mask ? c.mask + (b * c.mask_k + (c.mask_k > 1 ? kh : 0)) * c.J * L : nullptr;
    j0 = lo / L, j1 = (len + L - 1) / L, n_keys = (j1 - j0) * L;
  }
  // No visible key: zero outputs, -inf log-sum-exps; true if so.
  bool Empty() const {
    if (n_keys > 0) return false;
    std::fill(out, out + G * H, 0.0f);
    std::fill(lse, lse + G, -INFINITY);
    return true;
  }
  int64_t page(int64_t j) const { return std::clamp<int64_t>(table[j], 0, c.P - 1); }
  int64_t row(int64_t p, int64_t o) const { return ((p * L + o) * K + kh) * (kH ? kH : H); }
  float k_scale(int64_t p) const {  // the scores' factor of page p (softmax scale, int8 scale)
    return c.k_scales ? c.k_scales[p * K + kh] * c.scale : c.scale;
  }
  float v_scale(int64_t p) const { return c.v_scales ? c.v_scales[p * K + kh] : 1.0f; }
  bool visible(int64_t t) const { return t >= lo && t < len && (!mask || mask[t]); }
  void prefetch(const T* pool, int64_t j) const {  // page j's rows of this head, ahead of use
    if (j >= j1) return;
    const int64_t p = page(j);
    const int64_t line = 64 / static_cast<int64_t>(sizeof(T));
    for (int64_t o = 0; o < L; ++o)
      for (int64_t h = 0; h < H; h += line) __builtin_prefetch(pool + row(p, o) + h);
  }
};

// One (sequence b, kv head kh) row: its G query heads against its visible keys.
template <typename T>
void Row(const Call& c, int64_t b, int64_t kh, std::vector<float>& scores) {
  const RowView<T> r(c, b, kh);
  if (r.Empty()) return;
  const int64_t G = r.G, H = r.H, L = r.L, j0 = r.j0, j1 = r.j1, n_keys = r.n_keys;
  const float* q = r.q;

  // pass 1: scaled scores of the visible keys (-inf elsewhere), per query head
  scores.resize(G * n_keys);
  for (int64_t j = j0; j < j1; ++j) {
    r.prefetch(r.kp, j + 2);
    const int64_t p = r.page(j);
    const float ks = r.k_scale(p);
    for (int64_t o = 0; o < L; ++o) {
      const int64_t t = j * L + o, i = t - j0 * L;
      const bool visible = r.visible(t);
      const T* key = r.kp + r.row(p, o);
      for (int64_t g = 0; g < G; ++g) {
        float d = 0.0f;
        if (visible) {
          const float* qg = q + g * H;
#pragma omp simd reduction(+ : d)
          for (int64_t h = 0; h < H; ++h) d += qg[h] * Load(key, h);
        }
        scores[g * n_keys + i] = visible ? d * ks : -INFINITY;
      }
    }
  }
  float row_max[kMaxGroup], denom[kMaxGroup];
  Softmax(scores.data(), G, n_keys, row_max, denom);
  // pass 2: probability-weighted values
  float acc[kMaxGroup * kMaxHeadDim];
  std::fill(acc, acc + G * H, 0.0f);
  for (int64_t j = j0; j < j1; ++j) {
    r.prefetch(r.vp, j + 2);
    const int64_t p = r.page(j);
    const float vs = r.v_scale(p);
    for (int64_t o = 0; o < L; ++o) {
      const int64_t i = j * L + o - j0 * L;
      const T* val = r.vp + r.row(p, o);
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[g * n_keys + i];
        if (w == 0.0f) continue;
        const float wv = w * vs;
        float* a = acc + g * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) a[h] += wv * Load(val, h);
      }
    }
  }
  std::copy(acc, acc + G * H, r.out);
  Finish(r.out, r.lse, G, H, row_max, denom);
}

// The same row with 16-float vectors (GCC/Clang vector extensions, one AVX-512 register each;
// PickRow uses it on AVX-512 CPUs only) for head dims of HC * 16 floats: pass 1 scores
// a page's keys 16 at a time per query head (LaneSums), the softmax takes its maxima in
// vectors, and pass 2 keeps a pair of query heads' output rows in registers across the keys.
typedef float F32x16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));
typedef int8_t I8x16 __attribute__((vector_size(16)));

template <typename T>
inline F32x16 LoadVec(const T* x);
template <>
inline F32x16 LoadVec<float>(const float* x) {
  F32x16 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
template <>
inline F32x16 LoadVec<uint16_t>(const uint16_t* x) {  // bfloat16 bits
  U16x16 u;
  std::memcpy(&u, x, sizeof(u));
  return reinterpret_cast<F32x16>(__builtin_convertvector(u, U32x16) << 16);
}
template <>
inline F32x16 LoadVec<int8_t>(const int8_t* x) {
  // GCC 12 scalarises __builtin_convertvector from 8-bit lanes: widen with the ISA's
  // sign-extending loads where there is one
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return reinterpret_cast<F32x16>(_mm512_cvtepi32_ps(w));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  F32x16 v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#else
  I8x16 u;
  std::memcpy(&u, x, sizeof(u));
  return __builtin_convertvector(u, F32x16);
#endif
}

#if defined(__clang__)
#define AGENTRL_SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define AGENTRL_SHUFFLE(x, y, ...) __builtin_shuffle(x, y, U32x16{__VA_ARGS__})
#endif

// Lane sums of 16 vectors, one per key: s[o] = sum of part[o]'s lanes, each by the tree
// (lane i + lane i+8), then (+ i+4), (+ i+2), (+ i+1), and all 16 in four rounds of shuffles
// (15 shuffle pairs instead of 16 separate reductions).
inline F32x16 LaneSums(F32x16* part) {
  for (int n = 8; n >= 1; n /= 2)  // n pairs of vectors -> n vectors
    for (int m = 0; m < n; ++m) {
      const F32x16 x = part[2 * m], y = part[2 * m + 1];
      F32x16 lo, hi;
      if (n == 8) {
        lo = AGENTRL_SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        hi = AGENTRL_SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
      } else if (n == 4) {
        lo = AGENTRL_SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
        hi = AGENTRL_SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
      } else if (n == 2) {
        lo = AGENTRL_SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
        hi = AGENTRL_SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
      } else {
        lo = AGENTRL_SHUFFLE(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        hi = AGENTRL_SHUFFLE(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
      }
      part[m] = lo + hi;
    }
  return part[0];
}

// Softmax for n_keys a multiple of 16: the row maxima and the NaN test in vectors; the same
// numbers as Softmax.
inline void SoftmaxVec(float* scores, int64_t G, int64_t n_keys, float* row_max, float* denom) {
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n_keys;
    F32x16 m = LoadVec(s), nan = m != m ? F32x16{} + 1.0f : F32x16{};
    for (int64_t i = 16; i < n_keys; i += 16) {
      const F32x16 v = LoadVec(s + i);
      m = v > m ? v : m;
      nan = v != v ? F32x16{} + 1.0f : nan;
    }
    float lanes[16], flags[16];
    std::memcpy(lanes, &m, sizeof(lanes));
    std::memcpy(flags, &nan, sizeof(flags));
    float mx = -INFINITY;
    bool any_nan = false;
    for (int i = 0; i < 16; ++i) {
      mx = std::max(mx, lanes[i]);
      any_nan |= flags[i] != 0.0f;
    }
    row_max[g] = any_nan ? NAN : mx;
    denom[g] = ExpInPlace(s, n_keys, mx);
  }
}

template <typename T, int HC>
void RowVec(const Call& c, int64_t b, int64_t kh, std::vector<float>& scores) {
  constexpr int64_t H = HC * 16;
  const RowView<T, H> r(c, b, kh);
  if (r.Empty()) return;
  const int64_t G = r.G, L = r.L, j0 = r.j0, j1 = r.j1, n_keys = r.n_keys;
  const float* q = r.q;

  // pass 1: scaled scores of the visible keys (-inf elsewhere), a page of keys at a time per
  // query head
  scores.resize(G * n_keys);
  for (int64_t j = j0; j < j1; ++j) {
    r.prefetch(r.kp, j + 2);
    const int64_t p = r.page(j);
    const float ks = r.k_scale(p);
    for (int64_t g = 0; g < G; ++g) {
      F32x16 qg[HC];
      for (int ch = 0; ch < HC; ++ch) qg[ch] = LoadVec(q + g * H + ch * 16);
      for (int64_t o0 = 0; o0 < L; o0 += 16) {  // L is a multiple of 16 here
        F32x16 part[16];
        for (int o = 0; o < 16; ++o) {
          const T* key = r.kp + r.row(p, o0 + o);
          F32x16 a = qg[0] * LoadVec(key);
          for (int ch = 1; ch < HC; ++ch) a += qg[ch] * LoadVec(key + ch * 16);
          part[o] = a;
        }
        const F32x16 sums = LaneSums(part) * ks;
        float* dst = scores.data() + g * n_keys + j * L + o0 - j0 * L;
        std::memcpy(dst, &sums, sizeof(sums));
      }
    }
    for (int64_t o = 0; o < L; ++o) {
      const int64_t t = j * L + o;
      if (!r.visible(t))
        for (int64_t g = 0; g < G; ++g) scores[g * n_keys + t - j0 * L] = -INFINITY;
    }
  }
  float row_max[kMaxGroup], denom[kMaxGroup];
  SoftmaxVec(scores.data(), G, n_keys, row_max, denom);
  // pass 2: probability-weighted values, a pair of output rows in registers
  for (int64_t g0 = 0; g0 < G; g0 += 2) {
    const int64_t g1 = std::min(g0 + 1, G - 1);
    const float* w0s = scores.data() + g0 * n_keys;
    const float* w1s = scores.data() + g1 * n_keys;
    F32x16 acc0[HC], acc1[HC];
    for (int ch = 0; ch < HC; ++ch) acc0[ch] = acc1[ch] = F32x16{};
    for (int64_t j = j0; j < j1; ++j) {
      r.prefetch(r.vp, j + 2);
      const int64_t p = r.page(j);
      const float vs = r.v_scale(p);
      for (int64_t o = 0; o < L; ++o) {
        const int64_t i = j * L + o - j0 * L;
        const float w0 = w0s[i], w1 = w1s[i];
        if (w0 == 0.0f && w1 == 0.0f) continue;
        const float v0 = w0 * vs, v1 = w1 * vs;
        for (int ch = 0; ch < HC; ++ch) {
          const F32x16 val = LoadVec(r.vp + r.row(p, o) + ch * 16);
          acc0[ch] += v0 * val;
          acc1[ch] += v1 * val;
        }
      }
    }
    for (int ch = 0; ch < HC; ++ch) {
      std::memcpy(r.out + g0 * H + ch * 16, &acc0[ch], sizeof(F32x16));
      std::memcpy(r.out + g1 * H + ch * 16, &acc1[ch], sizeof(F32x16));
    }
  }
  Finish(r.out, r.lse, G, H, row_max, denom);
}

using RowFn = void (*)(const Call&, int64_t, int64_t, std::vector<float>&);

// RowVec for head dims of 32, 64 and 128 and pages of a multiple of 16 keys, on CPUs with
// AVX-512; else Row. Built for AVX2 only, GCC 12 splits the 16-float vectors into slow code
// (a b32 call 3x slower than Row's, where clang's is faster): Row keeps those machines.
template <typename T>
RowFn PickRow(int64_t H, int64_t L) {
#if defined(__AVX512F__)
  if (L % 16 == 0) {
    if (H == 32) return &RowVec<T, 2>;
    if (H == 64) return &RowVec<T, 4>;
    if (H == 128) return &RowVec<T, 8>;
  }
#else
  (void)H, (void)L;
#endif
  return &Row<T>;
}

// Rows handed out by an atomic counter to the calling thread and to helpers on XLA's pool.
// The caller waits only for rows to finish, never for a helper to start (the pool may be busy
// with other ops that wait too), and the shared state outlives late helpers.
struct Work {
  Call call;
  RowFn row;
  int64_t rows;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void Run() {
    std::vector<float> scores;
    for (int64_t r; (r = next.fetch_add(1)) < rows;) {
      row(call, r / call.K, r % call.K, scores);
      if (done.fetch_add(1) + 1 == rows) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                       ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales,
                       ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> tables,
                       ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> kv_mask,
                       ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                       float scale, int64_t window, bool use_mask) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  const auto ld = lengths.dimensions(), md = kv_mask.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 3 || ld.size() != 2 || md.size() != 3)
    return ffi::Error::InvalidArgument("paged_decode_cpu: operand ranks differ from the contract");
  const auto dtype = k_pages.element_type();
  if (v_pages.element_type() != dtype)
    return ffi::Error::InvalidArgument("paged_decode_cpu: k and v pages differ in dtype");
  Call c{};
  c.q = q.typed_data();
  c.k = k_pages.untyped_data();
  c.v = v_pages.untyped_data();
  const bool int8 = dtype == ffi::DataType::S8;
  c.k_scales = int8 ? k_scales.typed_data() : nullptr;
  c.v_scales = int8 ? v_scales.typed_data() : nullptr;
  c.tables = tables.typed_data();
  c.lengths = lengths.typed_data();
  c.mask = use_mask ? kv_mask.typed_data() : nullptr;
  c.out = out->typed_data();
  c.lse = lse->typed_data();
  c.B = qd[0], c.N = qd[1], c.H = qd[2];
  c.P = kd[0], c.L = kd[1], c.K = kd[2];
  c.J = td[2], c.tables_k = td[1], c.lengths_k = ld[1], c.mask_k = md[1];
  c.G = c.N / c.K;
  c.window = window;
  c.scale = scale;
  if (c.G * c.K != c.N || c.G > kMaxGroup || c.H > kMaxHeadDim || kd[3] != c.H)
    return ffi::Error::InvalidArgument("paged_decode_cpu: unsupported head counts or head dim");

  auto work = std::make_shared<Work>();
  work->call = c;
  work->rows = c.B * c.K;
  if (dtype == ffi::DataType::F32) {
    work->row = PickRow<float>(c.H, c.L);
  } else if (dtype == ffi::DataType::BF16) {
    work->row = PickRow<uint16_t>(c.H, c.L);
  } else if (int8) {
    work->row = PickRow<int8_t>(c.H, c.L);
  } else {
    return ffi::Error::InvalidArgument("paged_decode_cpu: pages must be f32, bf16 or s8");
  }
  if (work->rows == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->rows) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == work->rows; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentrlPagedDecodeCpu, PagedDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // kv_mask
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("use_mask"));
