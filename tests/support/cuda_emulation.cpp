// Runs compcomm/csrc/codec.cu on the CPU, so that its logic is tested where no GPU is.
//
// Each launch runs its blocks one after another and the threads of a block as real threads.
// Warp primitives (ballot, shuffle) meet at a per-warp barrier, __syncthreads at a per-block
// one, so the kernels see the lock-step lanes they rely on. What this cannot check is what
// only a GPU has: its memory model, scheduling, NVRTC's code generation and the speed.
// Built by tests/cuda_emulation.py: g++ -std=c++20 -pthread -shared -fPIC.
#include <barrier>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define COMPCOMM_CUDA_EMULATION
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static  // blocks run one at a time, so one copy serves the running block

struct Dim3 {
    unsigned x = 1;
};
static thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim, gridDim;

struct Warp {
    std::barrier<> meet{32};
    unsigned votes[32];
    double values[32];
};
static Warp *warps;
static std::barrier<> *block_barrier;

static Warp &my_warp() { return warps[threadIdx.x / 32]; }

static unsigned __ballot_sync(unsigned, bool predicate) {
    Warp &w = my_warp();
    w.votes[threadIdx.x % 32] = predicate;
    w.meet.arrive_and_wait();
    unsigned ballot = 0;
    for (unsigned lane = 0; lane < 32; lane++) ballot |= w.votes[lane] << lane;
    w.meet.arrive_and_wait();
    return ballot;
}

static double __shfl_down_sync(unsigned, double value, int offset) {
    Warp &w = my_warp();
    unsigned lane = threadIdx.x % 32;
    w.values[lane] = value;
    w.meet.arrive_and_wait();
    double out = lane + offset < 32 ? w.values[lane + offset] : value;
    w.meet.arrive_and_wait();
    return out;
}

static void __syncthreads() { block_barrier->arrive_and_wait(); }

static unsigned __brev(unsigned x) {
    unsigned out = 0;
    for (int k = 0; k < 32; k++) out |= ((x >> k) & 1u) << (31 - k);
    return out;
}

static float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}

static float half_to_float(unsigned short h) {
    _Float16 value;
    std::memcpy(&value, &h, 2);
    return (float)value;
}

#include "../../compcomm/csrc/codec.cu"

template <class Kernel>
static void launch(unsigned grid, unsigned block, Kernel kernel) {
    gridDim.x = grid;
    blockDim.x = block;
    for (unsigned b = 0; b < grid; b++) {
        std::barrier<> block_meet(block);
        std::unique_ptr<Warp[]> block_warps(new Warp[block / 32]);
        block_barrier = &block_meet;
        warps = block_warps.get();
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; t++)
            threads.emplace_back([=] {
                blockIdx.x = b;
                threadIdx.x = t;
                kernel();
            });
        for (std::thread &thread : threads) thread.join();
    }
}

// One entry per kernel: the grid and block size, then the kernel's own arguments.
extern "C" {
void emulate_worker_scan(unsigned grid, unsigned block, const void *x, int dtype, long long n, const float *addend,
                         float divisor, const float *e, float s, int pending, long long m, float *out,
                         unsigned char *bits, double *partial) {
    launch(grid, block, [=] { cc_worker_scan(x, dtype, n, addend, divisor, e, s, pending, m, out, bits, partial); });
}

void emulate_error_update(unsigned grid, unsigned block, const void *x, int dtype, long long n, const float *e,
                          float *out, long long real, long long m, float s, double *partial) {
    launch(grid, block, [=] { cc_error_update(x, dtype, n, e, out, real, m, s, partial); });
}

void emulate_server_scan(unsigned grid, unsigned block, const unsigned char *bits, long long stride, int nranks,
                         const float *scales, float divisor, const float *previous, float *e, long long c,
                         long long real, unsigned char *out_bits, double *partial) {
    launch(grid, block,
           [=] { cc_server_scan(bits, stride, nranks, scales, divisor, previous, e, c, real, out_bits, partial); });
}

void emulate_decode(unsigned grid, unsigned block, const unsigned char *bits, long long count, int elsize,
                    unsigned plus, unsigned minus, void *out) {
    launch(grid, block, [=] { cc_decode(bits, count, elsize, plus, minus, out); });
}
}
