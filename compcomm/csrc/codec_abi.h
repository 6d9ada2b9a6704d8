/* The 1-bit codec's kernel ABI, shared by codec.c (CPU) and codec.cu (CUDA).
 *
 * A kernel name means the same parameters on both: compcomm/_abi.py mirrors this file for
 * the Python side (tests/test_codec.py checks that the two agree). Kernels that sum squares
 * write float64 partial sums into `partial`, one per block: the C kernels run as one block,
 * the CUDA ones as `blocks(count)`; the caller adds them up in a fixed order (the error update's
 * partials are maxima: the caller takes the largest).
 * Bits are MSB-first: bit 7 of byte b codes element 8b, and bit 1 means v >= 0 (so -0.0).
 */
#ifndef COMPCOMM_CODEC_ABI_H
#define COMPCOMM_CODEC_ABI_H

/* Element types of the tensors a kernel reads (`dtype` parameters). */
enum cc_dtype { CC_F32 = 0, CC_F16 = 1, CC_BF16 = 2 };

/* How a kernel is declared: a plain exported C function unless the includer says otherwise
 * (codec.cu defines it as extern "C" __global__). */
#ifndef CC_KERNEL
#define CC_KERNEL
#endif

typedef long long cc_index;

/* Worker pass: v = x + err (x zero beyond n), bits = sign(v) over [0, m); partial sums of
 * v[:n]^2. x's element i < n is formed as (x[i] + addend[i]) / divisor in fp32 (no addend when
 * it is null, no division when divisor is 1). err is 0 when e is null, e itself unless
 * `pending`, and with `pending` (the x' form: e holds the previous call's v, s its scale)
 * e - s sign(e) on [0, n) and 0 beyond. When out is not null (and overlaps neither x, addend nor
 * e), v is written there over [0, m). Writes nothing but bits, out and partial. */
CC_KERNEL void cc_worker_scan(const void *x, int dtype, cc_index n, const float *addend, float divisor, const float *e,
                              float s, int pending, cc_index m, float *out, unsigned char *bits, double *partial);

/* Error update: out <- v - s sign(v) on [0, real), v = x + e on x's first n elements (x may be
 * null) and v = e beyond; 0 on [real, m). out is e itself (in place) or a buffer that does not
 * overlap it (e is then left unchanged). partial: per block, max |out| over [0, real) (NaN if
 * any is NaN, 0 for none); the caller takes the largest. */
CC_KERNEL void cc_error_update(const void *x, int dtype, cc_index n, const float *e, float *out, cc_index real,
                               cc_index m, float s, double *partial);

/* Server pass: y = previous + (sum_r +-scales[r]) / divisor, summed in rank order, stored in e
 * over [0, c); out_bits = sign(y); partial sums of y[:real]^2. Row r of `bits` starts at
 * r * stride. previous is e itself (in place) or a buffer that does not overlap it (left
 * unchanged: a call that keeps the old server error reads it there instead of copying it). */
CC_KERNEL void cc_server_scan(const unsigned char *bits, cc_index stride, int nranks, const float *scales,
                              float divisor, const float *previous, float *e, cc_index c, cc_index real,
                              unsigned char *out_bits, double *partial);

/* Decode: out[:count] <- one of two bit patterns (+t, -t in the output dtype, elsize bytes) per bit. */
CC_KERNEL void cc_decode(const unsigned char *bits, cc_index count, int elsize, unsigned int plus,
                         unsigned int minus, void *out);

#ifndef CC_CUDA
/* The version of this interface, raised with any change of a kernel's parameters: a library built
 * from older source (an editable install not rebuilt) must be refused, not called with parameters
 * it reads otherwise. 2: cc_server_scan's `previous`; 3: cc_error_update's `partial`. */
#define CC_ABI_VERSION 3
int cc_abi_version(void);

/* CPU library only. cc_cpu_features: the kernel sets this CPU runs, bit 0 AVX2 + FMA + F16C,
 * bit 1 AVX-512 (F, BW, VL, DQ). cc_configure: the kernel sets to use (those bits, masked by
 * the CPU's), the threads per pass and the smallest pass (in elements) split over them; every
 * setting gives the same bits. cc_features: the kernel sets in use. */
int cc_cpu_features(void);
int cc_features(void);
void cc_configure(int features, int threads, cc_index split_min);
#endif

#endif
