/* Fused CPU kernels of the 1-bit codec (see compcomm/codec.py for the contract).
 *
 * Plain C with no Python API: loaded through ctypes, which drops the GIL during each call
 * so that the codec overlaps collectives in flight. Every kernel does the same fp32
 * operations, in the same order, as the torch fallback, so the two agree bit for bit
 * (float64 sums of squares may differ in the last bits, which the fp32 scale rounds away).
 * Bits are MSB-first: bit 7 of byte b codes element 8b, and bit 1 means v >= 0 (so -0.0).
 * Loops are written branch-free over whole bytes so that the compiler vectorizes them.
 */
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <immintrin.h>
#endif

enum { F32 = 0, F16 = 1, BF16 = 2 };

static inline float load(const void *x, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)x)[i];
    if (dtype == F16) return (float)((const _Float16 *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* Sign masks come lane 0 first (movemask); bytes are MSB first: reverse each nibble. */
static const uint8_t REVERSE4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

static inline uint8_t msb_first(int mask8) {
    return (uint8_t)(REVERSE4[mask8 & 15] << 4 | REVERSE4[mask8 >> 4]);
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
    return msb_first(low | high << 4);
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

/* pack8 for 8 floats in one AVX2 register: the square of an fp32 value is exact in float64,
 * so fma(v, v, acc) == acc + v * v and the lanes are bitwise those of the portable pack8. */
__attribute__((target("avx2,fma")))
static inline uint8_t pack8_avx2(__m256 v, __m256d *acc_lo, __m256d *acc_hi) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    *acc_lo = _mm256_fmadd_pd(lo, lo, *acc_lo);
    *acc_hi = _mm256_fmadd_pd(hi, hi, *acc_hi);
    return msb_first(mask);
}

/* The float32 scan with AVX2 + FMA, bitwise that of the portable scan. */
__attribute__((target("avx2,fma")))
static double scan_f32_avx2(const float *x, int64_t n, const float *e, int64_t m, uint8_t *bits) {
    __m256d acc_lo = _mm256_setzero_pd(), acc_hi = _mm256_setzero_pd();
    int64_t whole = n / 8 * 8;
    for (int64_t i = 0; i < whole; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (e) v = _mm256_add_ps(v, _mm256_loadu_ps(e + i));
        bits[i / 8] = pack8_avx2(v, &acc_lo, &acc_hi);
    }
    double lanes[8];
    _mm256_storeu_pd(lanes, acc_lo);
    _mm256_storeu_pd(lanes + 4, acc_hi);
    float v[8];
    for (int64_t i = whole; i < m; i += 8) {
        load8(x, F32, n, e, i, v);
        bits[i / 8] = pack8(v, lanes, live_lanes(n - i));
    }
    return sum8(lanes);
}
#endif

double cc_worker_scan(const void *x, int dtype, int64_t n, const float *e, int64_t m, uint8_t *bits) {
#ifdef __SSE2__
    if (dtype == F32 && have_avx2_fma())
        return scan_f32_avx2(x, n, e, m, bits);
#endif
    if (dtype == F32) return scan(x, F32, n, e, m, bits);
    if (dtype == F16) return scan(x, F16, n, e, m, bits);
    return scan(x, BF16, n, e, m, bits);
}

/* Pass 2: e <- v - s sign(v), v = x + e (x may be NULL: v = e), on [:real]; 0 on [real:m]. */
static inline void update(const void *x, int dtype, int64_t n, float *e, int64_t real, int64_t m, float s) {
    int64_t with_x = x ? (n < real ? n : real) : 0;
    for (int64_t i = 0; i < with_x; i++) {
        float v = load(x, i, dtype) + e[i];
        e[i] = v - (v >= 0.0f ? s : -s);
    }
    for (int64_t i = with_x; i < real; i++) {
        float v = e[i];
        e[i] = v - (v >= 0.0f ? s : -s);
    }
    if (m > real) memset(e + real, 0, (size_t)(m - real) * sizeof(float));
}

void cc_error_update(const void *x, int dtype, int64_t n, float *e, int64_t real, int64_t m, float s) {
    if (!x || dtype == F32) update(x, F32, n, e, real, m, s);
    else if (dtype == F16) update(x, F16, n, e, real, m, s);
    else update(x, BF16, n, e, real, m, s);
}

/* Server pass: y = e + (sum_r scales[r] sign_r) / divisor, summed in rank order, stored in e;
 * out_bits = sign(y); returns sum(y[:real]^2). Row r of `bits` starts at r * stride.
 * `tables` is scratch of nranks * 256 * 8 floats: row b of rank r holds the +-scales[r] of b. */
static void fill_tables(int nranks, const float *scales, float *tables) {
    for (int r = 0; r < nranks; r++)
        for (int b = 0; b < 256; b++)
            for (int k = 0; k < 8; k++) tables[(r * 256 + b) * 8 + k] = (b >> (7 - k)) & 1 ? scales[r] : -scales[r];
}

static inline void server_byte(const uint8_t *bits, int64_t stride, int nranks, const float *tables,
                               float divisor, int64_t byte, float *a) {
    const float *first = tables + (int64_t)bits[byte] * 8;
    for (int k = 0; k < 8; k++) a[k] = first[k];
    for (int r = 1; r < nranks; r++) {
        const float *row = tables + ((int64_t)r * 256 + bits[r * stride + byte]) * 8;
        for (int k = 0; k < 8; k++) a[k] += row[k];
    }
    if (divisor != 1.0f)
        for (int k = 0; k < 8; k++) a[k] /= divisor;
}

#ifdef __SSE2__
__attribute__((target("avx2,fma")))
static void server_avx2(const uint8_t *bits, int64_t stride, int nranks, const float *tables, float divisor,
                        float *e, int64_t whole, uint8_t *out_bits, double *lanes) {
    __m256d acc_lo = _mm256_loadu_pd(lanes), acc_hi = _mm256_loadu_pd(lanes + 4);
    __m256 div = _mm256_set1_ps(divisor);
    for (int64_t byte = 0; byte < whole; byte++) {
        __m256 a = _mm256_loadu_ps(tables + (int64_t)bits[byte] * 8);
        for (int r = 1; r < nranks; r++)
            a = _mm256_add_ps(a, _mm256_loadu_ps(tables + ((int64_t)r * 256 + bits[r * stride + byte]) * 8));
        if (divisor != 1.0f) a = _mm256_div_ps(a, div);
        __m256 y = _mm256_add_ps(_mm256_loadu_ps(e + byte * 8), a);
        _mm256_storeu_ps(e + byte * 8, y);
        out_bits[byte] = pack8_avx2(y, &acc_lo, &acc_hi);
    }
    _mm256_storeu_pd(lanes, acc_lo);
    _mm256_storeu_pd(lanes + 4, acc_hi);
}
#endif

double cc_server_scan(const uint8_t *bits, int64_t stride, int nranks, const float *scales,
                      float divisor, float *e, int64_t c, int64_t real, uint8_t *out_bits, float *tables) {
    fill_tables(nranks, scales, tables);
    double lanes[8] = {0};
    int64_t byte = 0;
#ifdef __SSE2__
    if (have_avx2_fma()) {
        byte = real / 8;
        server_avx2(bits, stride, nranks, tables, divisor, e, byte, out_bits, lanes);
    }
#endif
    float a[8];
    for (; byte < c / 8; byte++) {
        server_byte(bits, stride, nranks, tables, divisor, byte, a);
        float *y = e + byte * 8;
        for (int k = 0; k < 8; k++) y[k] += a[k];
        out_bits[byte] = pack8(y, lanes, live_lanes(real - byte * 8));
    }
    return sum8(lanes);
}

/* out[:count] <- per bit one of two precomputed bit patterns (+t and -t in the output dtype). */
void cc_decode(const uint8_t *bits, int64_t count, int elsize, uint32_t plus, uint32_t minus, void *out) {
    int64_t full = count / 8;
    if (elsize == 4) {
        uint32_t table[256][8];
        for (int b = 0; b < 256; b++)
            for (int k = 0; k < 8; k++) table[b][k] = (b >> (7 - k)) & 1 ? plus : minus;
        uint32_t *o = out;
        for (int64_t i = 0; i < full; i++) memcpy(o + 8 * i, table[bits[i]], 32);
        for (int64_t i = full * 8; i < count; i++) o[i] = table[bits[full]][i - full * 8];
    } else {
        uint16_t table[256][8];
        for (int b = 0; b < 256; b++)
            for (int k = 0; k < 8; k++) table[b][k] = (uint16_t)((b >> (7 - k)) & 1 ? plus : minus);
        uint16_t *o = out;
        for (int64_t i = 0; i < full; i++) memcpy(o + 8 * i, table[bits[i]], 16);
        for (int64_t i = full * 8; i < count; i++) o[i] = table[bits[full]][i - full * 8];
    }
}
