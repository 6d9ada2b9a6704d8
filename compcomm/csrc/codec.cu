/* Fused CUDA kernels of the 1-bit codec (see compcomm/codec.py for the contract, and
 * codec_abi.h for the parameters, which the C kernels share).
 *
 * Compiled at first use by cupy's NVRTC (compcomm/_cuda.py) and launched on torch's current
 * stream. Each kernel is one pass over memory and does the same fp32 operations, in the same
 * order, as the C kernels and the torch fallback, so that all three give the same bits: no
 * multiply feeds an fp32 add or subtract (so no fused multiply-add can change a rounding) and
 * division is IEEE (no --use_fast_math). The float64 sums of squares are per-block partials,
 * summed by the caller in a fixed order, so a given size always rounds the same way.
 *
 * One thread per element; a warp's 32 signs become 4 bytes with one ballot, MSB first (bit 7
 * of byte b codes element 8b; bit 1 means v >= 0, so -0.0 too). Grid-stride loops run whole
 * warps, so every ballot has all 32 lanes.
 */

#define CC_CUDA
#define CC_KERNEL extern "C" __global__
#include "codec_abi.h"

enum { F32 = CC_F32, F16 = CC_F16, BF16 = CC_BF16 };
#define ALL_LANES 0xffffffffu

#ifndef COMPCOMM_CUDA_EMULATION /* tests/cuda_emulation.cpp runs this file on the CPU */
__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#endif

__device__ __forceinline__ float load_value(const void *x, long long i, int dtype) {
    if (dtype == F32) return ((const float *)x)[i];
    unsigned short h = ((const unsigned short *)x)[i];
    return dtype == BF16 ? __uint_as_float((unsigned int)h << 16) : half_to_float(h);
}

/* Index of this thread's element in the first round, and the grid-stride step. */
__device__ __forceinline__ long long first_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long grid_step() {
    return (long long)gridDim.x * blockDim.x;
}

/* Bytes of the warp's 32 signs (element i on this lane): lane 8j stores byte j if i < m. */
__device__ __forceinline__ void store_signs(bool positive, long long i, long long m, unsigned char *bits) {
    unsigned int lane = threadIdx.x & 31, ballot = __ballot_sync(ALL_LANES, positive);
    if ((lane & 7) == 0 && i < m) bits[i >> 3] = (unsigned char)(__brev(ballot >> lane) >> 24);
}

/* partial[blockIdx.x] <- the sum of `acc` over the block, in a fixed order. */
__device__ void store_block_sum(double acc, double *partial) {
    __shared__ double warp_sums[32];
    unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(ALL_LANES, acc, offset);
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0.0;
        for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(ALL_LANES, acc, offset);
        if (lane == 0) partial[blockIdx.x] = acc;
    }
}

/* partial[blockIdx.x] <- the largest |v| of the block, from each thread's largest |v| as the bits
 * of its float with the sign cleared: as integers these order as the magnitudes, with NaN above
 * infinity, so a NaN wins (as torch.aminmax's). Shuffled as doubles, which hold them exactly. */
__device__ void store_block_peak(unsigned int bits, double *partial) {
    __shared__ double warp_peaks[32];
    double peak = (double)bits;
    unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) {
        double other = __shfl_down_sync(ALL_LANES, peak, offset);
        peak = other > peak ? other : peak;
    }
    if (lane == 0) warp_peaks[warp] = peak;
    __syncthreads();
    if (warp == 0) {
        peak = lane < (blockDim.x >> 5) ? warp_peaks[lane] : 0.0;
        for (int offset = 16; offset > 0; offset >>= 1) {
            double other = __shfl_down_sync(ALL_LANES, peak, offset);
            peak = other > peak ? other : peak;
        }
        if (lane == 0) partial[blockIdx.x] = (double)__uint_as_float((unsigned int)peak);
    }
}

extern "C" __global__ void cc_worker_scan(const void *x, int dtype, cc_index n, const float *addend,
                                          float divisor, const float *e, float s, int pending, cc_index m,
                                          float *out, unsigned char *bits, double *partial) {
    double acc = 0.0;
    for (long long i = first_index(); i - (threadIdx.x & 31) < m; i += grid_step()) {
        float v = 0.0f;
        if (i < n) {
            v = load_value(x, i, dtype);
            if (addend) v += addend[i];
            if (divisor != 1.0f) v = v / divisor;
        }
        if (e && i < m && (i < n || !pending)) v += pending ? e[i] - (e[i] >= 0.0f ? s : -s) : e[i];
        if (out && i < m) out[i] = v;
        if (i < n) acc += (double)v * (double)v;
        store_signs(v >= 0.0f, i, m, bits);
    }
    store_block_sum(acc, partial);
}

extern "C" __global__ void cc_error_update(const void *x, int dtype, cc_index n, const float *e, float *out,
                                           cc_index real, cc_index m, float s, double *partial) {
    long long with_x = x ? (n < real ? n : real) : 0;
    unsigned int peak = 0;
    for (long long i = first_index(); i < m; i += grid_step()) {
        float v = i < with_x ? load_value(x, i, dtype) + e[i] : e[i];
        float r = i < real ? v - (v >= 0.0f ? s : -s) : 0.0f;
        unsigned int magnitude = __float_as_uint(r) & 0x7fffffffu;
        out[i] = r;
        peak = magnitude > peak ? magnitude : peak;
    }
    store_block_peak(peak, partial);
}

extern "C" __global__ void cc_server_scan(const unsigned char *bits, cc_index stride, int nranks,
                                          const float *scales, float divisor, const float *previous, float *e,
                                          cc_index c, cc_index real, unsigned char *out_bits, double *partial) {
    double acc = 0.0;
    for (long long i = first_index(); i - (threadIdx.x & 31) < c; i += grid_step()) {
        float y = 0.0f;
        if (i < c) {
            long long byte = i >> 3;
            int shift = 7 - (int)(i & 7);
            float a = (bits[byte] >> shift) & 1 ? scales[0] : -scales[0];
            for (int r = 1; r < nranks; r++) a += (bits[r * stride + byte] >> shift) & 1 ? scales[r] : -scales[r];
            if (divisor != 1.0f) a = a / divisor;
            y = previous[i] + a;
            e[i] = y;
            if (i < real) acc += (double)y * (double)y;
        }
        store_signs(y >= 0.0f, i, c, out_bits);
    }
    store_block_sum(acc, partial);
}

extern "C" __global__ void cc_decode(const unsigned char *bits, cc_index count, int elsize, unsigned int plus,
                                     unsigned int minus, void *out) {
    for (long long i = first_index(); i < count; i += grid_step()) {
        unsigned int value = (bits[i >> 3] >> (7 - (int)(i & 7))) & 1 ? plus : minus;
        if (elsize == 4) ((unsigned int *)out)[i] = value;
        else ((unsigned short *)out)[i] = (unsigned short)value;
    }
}
