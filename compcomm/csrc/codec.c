/* Fused CPU kernels of the 1-bit codec (see compcomm/codec.py for the contract, and
 * codec_abi.h for the parameters, which the CUDA kernels share).
 *
 * Plain C with no Python API: loaded through ctypes, which drops the GIL during each call
 * so that the codec overlaps collectives in flight. Every kernel does the same fp32
 * operations, in the same order, as the torch fallback, so the two agree bit for bit
 * (float64 sums of squares may differ in the last bits, which the fp32 scale rounds away).
 * Loops are written branch-free over whole bytes so that the compiler vectorizes them.
 */
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <immintrin.h>
#endif

#include "codec_abi.h"

enum { F32 = CC_F32, F16 = CC_F16, BF16 = CC_BF16 };

/* Outputs of at least this many bytes per call (a decode; an error update into another buffer)
 * are written with non-temporal stores, which skip reading each line before writing it: for a
 * large output that is not read again soon, that read is wasted memory traffic. Smaller outputs
 * keep plain stores: they are still in cache when the caller reads them. The crossover was
 * measured (bench/results/README.md, "codec"). */
enum { STREAM_BYTES = 4 << 20 };

static inline float load(const void *x, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)x)[i];
    if (dtype == F16) return (float)((const _Float16 *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* Sign masks come lane 0 first (movemask); bytes are MSB first: reverse the bits of each byte
 * of a mask holding up to four bytes. */
static inline uint32_t msb_first(uint32_t mask) {
    mask = (mask & 0x55555555u) << 1 | (mask >> 1 & 0x55555555u);
    mask = (mask & 0x33333333u) << 2 | (mask >> 2 & 0x33333333u);
    return (mask & 0x0F0F0F0Fu) << 4 | (mask >> 4 & 0x0F0F0F0Fu);
}

/* How many of the 8 elements of a byte are real, given `remaining` = real count - byte start. */
static inline int live_lanes(int64_t remaining) {
    return remaining >= 8 ? 8 : remaining > 0 ? (int)remaining : 0;
}

/* The sign byte of v[0..8) (MSB first); adds v[k]^2 to lanes[k] for k < live (live = 8: all). */
static inline uint8_t pack8(const float *v, double *lanes, int live) {
#ifdef __SSE2__
    __m128 lo = _mm_loadu_ps(v), hi = _mm_loadu_ps(v + 4), zero = _mm_setzero_ps();
    int low = _mm_movemask_ps(_mm_cmpge_ps(lo, zero)), high = _mm_movemask_ps(_mm_cmpge_ps(hi, zero));
    if (live == 8) {
        __m128d q[4] = {_mm_cvtps_pd(lo), _mm_cvtps_pd(_mm_movehl_ps(lo, lo)),
                        _mm_cvtps_pd(hi), _mm_cvtps_pd(_mm_movehl_ps(hi, hi))};
        for (int j = 0; j < 4; j++)
            _mm_storeu_pd(lanes + 2 * j, _mm_add_pd(_mm_loadu_pd(lanes + 2 * j), _mm_mul_pd(q[j], q[j])));
    } else {
        for (int k = 0; k < live; k++) lanes[k] += (double)v[k] * (double)v[k];
    }
    return (uint8_t)msb_first((uint32_t)(low | high << 4));
#else
    uint8_t b = 0;
    for (int k = 0; k < 8; k++) {
        b |= (uint8_t)((v[k] >= 0.0f) << (7 - k));
        if (k < live) lanes[k] += (double)v[k] * (double)v[k];
    }
    return b;
#endif
}

static inline double sum8(const double *lanes) {
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

/* v[k] = x[i+k] (0 beyond n) + e[i+k] (when e), for the 8 elements of byte i/8. */
static inline void load8(const void *x, int dtype, int64_t n, const float *e, int64_t i, float *v) {
    if (i + 8 <= n) {
        for (int k = 0; k < 8; k++) v[k] = load(x, i + k, dtype);
    } else {
        for (int k = 0; k < 8; k++) v[k] = i + k < n ? load(x, i + k, dtype) : 0.0f;
    }
    if (e)
        for (int k = 0; k < 8; k++) v[k] += e[i + k];
}

/* Pass 1 on a worker: v = x + e (x zero beyond n, e optional), bits = sign(v); returns
 * sum(v[:n]^2), accumulated per lane so that it vectorizes without reassociation. Writes
 * nothing but `bits`, so a call rejected afterwards leaves no trace. */
static inline double scan(const void *x, int dtype, int64_t n, const float *e, int64_t m, uint8_t *bits) {
    double lanes[8] = {0};
    float v[8];
    for (int64_t i = 0; i < m; i += 8) {
        load8(x, dtype, n, e, i, v);
        bits[i / 8] = pack8(v, lanes, live_lanes(n - i));
    }
    return sum8(lanes);
}

#ifdef __SSE2__
static int have_avx2_fma(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static int have_avx2_fma(void) {
    return 0;
}
#endif

int cc_cpu_features(void) {
    return have_avx2_fma();
}

#ifdef __SSE2__

/* Lane-first sign mask of eight floats: bit k is v[k] >= 0. */
__attribute__((target("avx2,fma")))
static inline uint32_t sign_mask8(__m256 v) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
}

/* acc[0], acc[1] += the float64 squares of v's low and high halves. The square of an fp32
 * value is exact in float64, so fma(v, v, acc) == acc + v * v, as in the portable pack8. */
__attribute__((target("avx2,fma")))
static inline void add_squares(__m256 v, __m256d *acc) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
}

/* The four sign bytes of v[0..4) at out; squares of v[j] into acc[2j], acc[2j+1]: eight
 * independent sums, so the float64 adds do not wait on each other. */
__attribute__((target("avx2,fma")))
static inline void pack32_avx2(const __m256 *v, __m256d *acc, uint8_t *out) {
    uint32_t mask = 0;
    for (int j = 0; j < 4; j++) {
        mask |= sign_mask8(v[j]) << (8 * j);
        add_squares(v[j], acc + 2 * j);
    }
    mask = msb_first(mask);
    memcpy(out, &mask, 4); /* x86 is little-endian: byte j holds bits 8j..8j+7 */
}

/* lanes[k] += the sums of lane k (0..7) of the eight accumulators of pack32_avx2. */
__attribute__((target("avx2,fma")))
static void add_lanes(const __m256d *acc, double *lanes) {
    __m256d lo = _mm256_add_pd(_mm256_add_pd(acc[0], acc[2]), _mm256_add_pd(acc[4], acc[6]));
    __m256d hi = _mm256_add_pd(_mm256_add_pd(acc[1], acc[3]), _mm256_add_pd(acc[5], acc[7]));
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_loadu_pd(lanes), lo));
    _mm256_storeu_pd(lanes + 4, _mm256_add_pd(_mm256_loadu_pd(lanes + 4), hi));
}

/* The float32 scan with AVX2 + FMA, 32 elements per step; the portable code does the tail. */
__attribute__((target("avx2,fma")))
static double scan_f32_avx2(const float *x, int64_t n, const float *e, int64_t m, uint8_t *bits) {
    __m256d acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_pd();
    __m256 v[4];
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + i + 8 * j);
            if (e) v[j] = _mm256_add_ps(v[j], _mm256_loadu_ps(e + i + 8 * j));
        }
        pack32_avx2(v, acc, bits + i / 8);
    }
    double lanes[8] = {0};
    add_lanes(acc, lanes);
    float w[8];
    for (; i < m; i += 8) {
        load8(x, F32, n, e, i, w);
        bits[i / 8] = pack8(w, lanes, live_lanes(n - i));
    }
    return sum8(lanes);
}
#endif

void cc_worker_scan(const void *x, int dtype, cc_index n, const float *e, cc_index m, unsigned char *bits,
                    double *partial) {
#ifdef __SSE2__
    if (dtype == F32 && have_avx2_fma()) {
        *partial = scan_f32_avx2(x, n, e, m, bits);
        return;
    }
#endif
    if (dtype == F32) *partial = scan(x, F32, n, e, m, bits);
    else if (dtype == F16) *partial = scan(x, F16, n, e, m, bits);
    else *partial = scan(x, BF16, n, e, m, bits);
}

/* Pass 2: out <- v - s sign(v), v = x + e (x may be NULL: v = e), on [:real]; 0 on [real:m].
 * out may be e itself (in place) or another buffer (e is then left as it was). */
static inline float minus_signed(float v, float s) {
    return v - (v >= 0.0f ? s : -s);
}

static inline void update(const void *x, int dtype, int64_t with_x, const float *e, float *out, int64_t real,
                          float s) {
    for (int64_t i = 0; i < with_x; i++) out[i] = minus_signed(load(x, i, dtype) + e[i], s);
    for (int64_t i = with_x; i < real; i++) out[i] = minus_signed(e[i], s);
}

#ifdef __SSE2__
__attribute__((target("avx2,fma")))
static inline __m256 minus_signed8(__m256 v, __m256 plus, __m256 minus) {
    return _mm256_sub_ps(v, _mm256_blendv_ps(minus, plus, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ)));
}

/* Eight floats to out (32-byte aligned when streaming: out itself is, and i is a multiple of 8;
 * see STREAM_BYTES). */
__attribute__((target("avx2,fma")))
static inline void put8(float *out, __m256 v, int streaming) {
    if (streaming) _mm256_stream_ps(out, v);
    else _mm256_storeu_ps(out, v);
}

/* The float32 update with AVX2: bitwise that of `update` (same single fp32 subtraction). */
__attribute__((target("avx2,fma")))
static void update_f32_avx2(const float *x, int64_t with_x, const float *e, float *out, int64_t real, float s,
                            int streaming) {
    __m256 plus = _mm256_set1_ps(s), minus = _mm256_set1_ps(-s);
    int64_t i = 0;
    for (; i + 8 <= with_x; i += 8)
        put8(out + i, minus_signed8(_mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(e + i)), plus, minus),
             streaming);
    for (; i < with_x; i++) out[i] = minus_signed(x[i] + e[i], s);
    for (; i < real && i % 8; i++) out[i] = minus_signed(e[i], s); /* back to whole rows of 8 (aligned) */
    for (; i + 8 <= real; i += 8) put8(out + i, minus_signed8(_mm256_loadu_ps(e + i), plus, minus), streaming);
    for (; i < real; i++) out[i] = minus_signed(e[i], s);
    if (streaming) _mm_sfence();
}
#endif

void cc_error_update(const void *x, int dtype, cc_index n, const float *e, float *out, cc_index real, cc_index m,
                     float s) {
    int64_t with_x = x ? (n < real ? n : real) : 0;
#ifdef __SSE2__
    /* Streaming pays only when out is another buffer: in place, its lines are read anyway. */
    int streaming = out != e && real * (int64_t)sizeof(float) >= STREAM_BYTES && (uintptr_t)out % 32 == 0;
    if ((!x || dtype == F32) && have_avx2_fma()) update_f32_avx2(x, with_x, e, out, real, s, streaming);
    else
#endif
    if (!x || dtype == F32) update(x, F32, with_x, e, out, real, s);
    else if (dtype == F16) update(x, F16, with_x, e, out, real, s);
    else update(x, BF16, with_x, e, out, real, s);
    if (m > real) memset(out + real, 0, (size_t)(m - real) * sizeof(float));
}

/* Server pass: y = e + (sum_r scales[r] sign_r) / divisor, summed in rank order, stored in e;
 * out_bits = sign(y); returns sum(y[:real]^2). Row r of `bits` starts at r * stride.
 * SIGNS[b] holds the eight +-1 coded by byte b: +-1 * s is exact, so sign * s + a rounds
 * once, as a +- s does, with or without a fused multiply-add. */
static float SIGNS[256][8];

__attribute__((constructor)) static void fill_signs(void) {
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) SIGNS[b][k] = (b >> (7 - k)) & 1 ? 1.0f : -1.0f;
}

static inline void server_byte(const uint8_t *bits, int64_t stride, int nranks, const float *scales,
                               float divisor, int64_t byte, float *y) {
    float a[8];
    for (int k = 0; k < 8; k++) a[k] = SIGNS[bits[byte]][k] * scales[0];
    for (int r = 1; r < nranks; r++)
        for (int k = 0; k < 8; k++) a[k] += SIGNS[bits[r * stride + byte]][k] * scales[r];
    for (int k = 0; k < 8; k++) y[k] += divisor != 1.0f ? a[k] / divisor : a[k];
}

#ifdef __SSE2__
/* y = e + a of one byte of the server pass, stored in e and returned. */
__attribute__((target("avx2,fma")))
static inline __m256 server8_avx2(const uint8_t *bits, int64_t stride, int nranks, const float *scales,
                                  float divisor, float *e, int64_t byte) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(SIGNS[bits[byte]]), _mm256_set1_ps(scales[0]));
    for (int r = 1; r < nranks; r++)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(SIGNS[bits[r * stride + byte]]), _mm256_set1_ps(scales[r]), a);
    if (divisor != 1.0f) a = _mm256_div_ps(a, _mm256_set1_ps(divisor));
    __m256 y = _mm256_add_ps(_mm256_loadu_ps(e + 8 * byte), a);
    _mm256_storeu_ps(e + 8 * byte, y);
    return y;
}

/* The server pass over bytes [0, whole) with AVX2, four bytes per step; returns bytes done. */
__attribute__((target("avx2,fma")))
static int64_t server_avx2(const uint8_t *bits, int64_t stride, int nranks, const float *scales, float divisor,
                           float *e, int64_t whole, uint8_t *out_bits, double *lanes) {
    __m256d acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_pd();
    __m256 y[4];
    int64_t byte = 0;
    for (; byte + 4 <= whole; byte += 4) {
        for (int j = 0; j < 4; j++) y[j] = server8_avx2(bits, stride, nranks, scales, divisor, e, byte + j);
        pack32_avx2(y, acc, out_bits + byte);
    }
    add_lanes(acc, lanes);
    return byte;
}
#endif

void cc_server_scan(const unsigned char *bits, cc_index stride, int nranks, const float *scales,
                    float divisor, float *e, cc_index c, cc_index real, unsigned char *out_bits, double *partial) {
    double lanes[8] = {0};
    int64_t byte = 0;
#ifdef __SSE2__
    if (have_avx2_fma()) byte = server_avx2(bits, stride, nranks, scales, divisor, e, real / 8, out_bits, lanes);
#endif
    for (; byte < c / 8; byte++) {
        float *y = e + byte * 8;
        server_byte(bits, stride, nranks, scales, divisor, byte, y);
        out_bits[byte] = pack8(y, lanes, live_lanes(real - byte * 8));
    }
    *partial = sum8(lanes);
}

#ifdef __SSE2__
/* The whole bytes of a decode with non-temporal stores; out must be aligned to one byte's
 * output (32 bytes for 4-byte elements, 16 for 2-byte ones). */
__attribute__((target("avx2,fma")))
static void decode_streaming(const unsigned char *bits, int64_t full, int elsize, const void *table, void *out) {
    if (elsize == 4) {
        const uint32_t (*rows)[8] = table;
        for (int64_t i = 0; i < full; i++)
            _mm256_stream_si256((__m256i *)out + i, _mm256_loadu_si256((const __m256i *)rows[bits[i]]));
    } else {
        const uint16_t (*rows)[8] = table;
        for (int64_t i = 0; i < full; i++)
            _mm_stream_si128((__m128i *)out + i, _mm_loadu_si128((const __m128i *)rows[bits[i]]));
    }
    _mm_sfence();
}
#endif

/* The whole bytes of a decode: streamed when large and aligned (see STREAM_BYTES), else copied. */
static void decode_whole(const unsigned char *bits, int64_t full, int elsize, const void *table, void *out) {
    size_t row = 8 * (size_t)elsize;
#ifdef __SSE2__
    if ((size_t)full * row >= STREAM_BYTES && (uintptr_t)out % row == 0 && have_avx2_fma()) {
        decode_streaming(bits, full, elsize, table, out);
        return;
    }
#endif
    for (int64_t i = 0; i < full; i++) memcpy((char *)out + i * row, (const char *)table + bits[i] * row, row);
}

/* out[:count] <- per bit one of two precomputed bit patterns (+t and -t in the output dtype). */
void cc_decode(const unsigned char *bits, cc_index count, int elsize, unsigned int plus, unsigned int minus,
               void *out) {
    int64_t full = count / 8;
    if (elsize == 4) {
        uint32_t table[256][8];
        for (int b = 0; b < 256; b++)
            for (int k = 0; k < 8; k++) table[b][k] = (b >> (7 - k)) & 1 ? plus : minus;
        uint32_t *o = out;
        decode_whole(bits, full, 4, table, o);
        for (int64_t i = full * 8; i < count; i++) o[i] = table[bits[full]][i - full * 8];
    } else {
        uint16_t table[256][8];
        for (int b = 0; b < 256; b++)
            for (int k = 0; k < 8; k++) table[b][k] = (uint16_t)((b >> (7 - k)) & 1 ? plus : minus);
        uint16_t *o = out;
        decode_whole(bits, full, 2, table, o);
        for (int64_t i = full * 8; i < count; i++) o[i] = table[bits[full]][i - full * 8];
    }
}
