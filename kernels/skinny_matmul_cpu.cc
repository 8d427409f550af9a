// A matmul of a few rows against a weight packed in column panels, for the one-row decode on
// the CPU backend (see skinny_matmul_cpu.py).
//
// y[G, M, n] = x[G, M, K] @ w[G], with each of the G weights given as panels [Np, K, P]
// (panel p holds columns p*P .. p*P+P-1 of the [K, n] weight, row after row, zero-padded past
// n): G = 1 for a plain matmul, the experts for a MoE layer's batched one. At a few rows a
// matmul is a stream over its weight; the panels make that stream contiguous. Each panel's
// K x P block is read once for all rows (in blocks of kRows rows, accumulated in registers),
// the next rows prefetched kAhead rows ahead; panels are handed out to the calling thread and
// to helpers on XLA's intra-op pool. Arithmetic is float32, summed over k in order, with
// fused multiply-adds where the target has them.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;  // P: columns per panel (PANEL of skinny_matmul_cpu.py)
constexpr int kRows = 8;        // rows per register block
constexpr int64_t kAhead = 32;  // rows of a panel prefetched ahead of use
// below this many weight bytes one thread streams the whole weight (no helpers woken)
constexpr int64_t kThreadBytes = 256 * 1024;

typedef float Vec __attribute__((vector_size(64)));  // 16 floats (GCC/Clang vector extension)
typedef float VecU __attribute__((vector_size(64), aligned(4)));  // the same, unaligned
constexpr int kVecs = kPanel / 16;

struct Call {
  const float* x;
  const float* w;
  float* y;
  int64_t G, M, K, N, panels;  // panels per group
};

// Rows r0 .. r0+R-1 of the output's columns of panel p (of all groups' panels, group-major).
template <int R>
void Block(const Call& c, int64_t p, int64_t r0) {
  const int64_t g = p / c.panels;
  p -= g * c.panels;
  Vec acc[R][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[r][v] = Vec{};
  const float* panel = c.w + (g * c.panels + p) * c.K * kPanel;
  const float* x = c.x + (g * c.M + r0) * c.K;
  for (int64_t k = 0; k < c.K; ++k) {
    const float* row = panel + k * kPanel;
    __builtin_prefetch(row + kAhead * kPanel);
    __builtin_prefetch(row + kAhead * kPanel + 16);
    Vec w[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) w[v] = *reinterpret_cast<const VecU*>(row + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * c.K + k];
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xs * w[v];
    }
  }
  const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, c.N - n0);
  for (int r = 0; r < R; ++r) {
    float* out = c.y + (g * c.M + r0 + r) * c.N + n0;
    for (int v = 0; v < kVecs; ++v) {
      const Vec a = acc[r][v];
      if (16 * v + 16 <= cols) {
        *reinterpret_cast<VecU*>(out + 16 * v) = a;
      } else if (16 * v < cols) {  // the last panel's columns past N are padding
        alignas(64) float tail[16];
        *reinterpret_cast<Vec*>(tail) = a;
        std::memcpy(out + 16 * v, tail, (cols - 16 * v) * sizeof(float));
      }
    }
  }
}

using BlockFn = void (*)(const Call&, int64_t, int64_t);
constexpr BlockFn kBlocks[kRows + 1] = {nullptr,   &Block<1>, &Block<2>, &Block<3>, &Block<4>,
                                        &Block<5>, &Block<6>, &Block<7>, &Block<8>};

void Panel(const Call& c, int64_t p) {
  for (int64_t r0 = 0; r0 < c.M; r0 += kRows)
    kBlocks[std::min<int64_t>(kRows, c.M - r0)](c, p, r0);
}

// Panels handed out by an atomic counter to the calling thread and to helpers on XLA's pool.
// The caller waits only for panels to finish, never for a helper to start (the pool may be busy
// with other ops that wait too), and the shared state outlives late helpers.
struct Work {
  Call call;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void Run() {
    const int64_t total = call.G * call.panels;
    for (int64_t p; (p = next.fetch_add(1)) < total;) {
      Panel(call, p);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

ffi::Error SkinnyMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 3 || wd.size() != 4 || yd.size() != 3)
    return ffi::Error::InvalidArgument("skinny_matmul_cpu: x must be [G, M, K], w [G, Np, K, P]");
  Call c{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], xd[2], yd[2], wd[1]};
  if (wd[0] != c.G || yd[0] != c.G || wd[2] != c.K || wd[3] != kPanel || yd[1] != c.M ||
      c.N > c.panels * kPanel || c.N <= (c.panels - 1) * kPanel)
    return ffi::Error::InvalidArgument("skinny_matmul_cpu: operand shapes differ from the contract");
  if (c.G == 0 || c.M == 0 || c.N == 0) return ffi::Error::Success();
  if (c.K == 0) {
    std::fill(c.y, c.y + c.G * c.M * c.N, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t total = c.G * c.panels;
  const int64_t bytes = total * c.K * kPanel * int64_t(sizeof(float));
  if (bytes < kThreadBytes || pool.num_threads() < 2 || total < 2) {
    for (int64_t p = 0; p < total; ++p) Panel(c, p);
    return ffi::Error::Success();
  }
  auto work = std::make_shared<Work>();
  work->call = c;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == total; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AgentrlSkinnyMatmulCpu, SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [G, M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [G, Np, K, P]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [G, M, N]
