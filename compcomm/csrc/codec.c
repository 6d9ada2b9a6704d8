/* Fused CPU kernels of the 1-bit codec (see compcomm/codec.py for the contract, and
 * codec_abi.h for the parameters, which the CUDA kernels share).
 *
 * Plain C with no Python API: loaded through ctypes, which drops the GIL during each call
 * so that the codec overlaps collectives in flight. Every kernel does the same fp32
 * operations, in the same order, as the torch fallback, so the two agree bit for bit.
 *
 * Three kernel sets, chosen at run time (cc_configure; the best the CPU has by default):
 * AVX-512 (F, BW, VL, DQ), AVX2 + FMA + F16C, and portable C. They give the same bits, the
 * float64 sums of squares included, because all of them accumulate a sum the same way:
 *
 * - The elements are cut into blocks of BLOCK (a multiple of 64; the last block is shorter).
 *   A pass over a block sums the squares of its whole groups of 32 real elements in 32
 *   float64 lanes, lane k taking the elements k mod 32 in order; folds them into 8 lanes as
 *   lanes[k] = (E[k] + E[8+k]) + (E[16+k] + E[24+k]); adds the rest of the block byte by
 *   byte (8 elements, lane k taking element k of the byte when it is real); and returns
 *   ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)).
 * - The pass returns 0.0 + block 0 + block 1 + ..., in block order.
 *
 * The square of an fp32 value is exact in float64, so acc + v * v rounds once whether or not
 * the compiler fuses it (fma(v, v, acc)). Blocks are also the unit of work of the threads
 * (below): a pass split over any number of threads computes the same blocks and adds them in
 * the same order, so its bits do not depend on the thread count either.
 *
 * Threads: a pass over at least `split_min` elements (cc_configure) runs on up to `threads`
 * threads, the caller and a persistent pool. Blocks are claimed one at a time from a shared
 * counter, so a helper that the OS does not schedule soon costs nothing but its share: the
 * others take its blocks. One pass uses the pool at a time; a second caller meanwhile runs
 * its pass on its own thread (same bits). After fork() the child starts a new pool.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __SSE2__
#include <immintrin.h>
#endif

#include "codec_abi.h"

enum { F32 = CC_F32, F16 = CC_F16, BF16 = CC_BF16 };

/* Elements per block: per-block float64 partial sums, and a thread's unit of work. 256 KiB of
 * fp32 amortizes a block's fixed costs (folding lanes, claiming it) to nothing. */
enum { BLOCK = 1 << 16 };

/* Outputs of at least this many bytes per call (a decode; an error update into another buffer)
 * are written with non-temporal stores, which skip reading each line before writing it: for a
 * large output that is not read again soon, that read is wasted memory traffic. Smaller outputs
 * use plain stores: they are still in cache when the caller reads them. The crossover was
 * measured (bench/results/README.md, "codec"). */
enum { STREAM_BYTES = 4 << 20 };

/* Kernel sets, as cc_cpu_features reports them. */
enum { HAVE_AVX2 = 1, HAVE_AVX512 = 2 };

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

static inline int64_t min64(int64_t a, int64_t b) {
    return a < b ? a : b;
}

static inline float load(const void *x, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)x)[i];
    if (dtype == F16) return (float)((const _Float16 *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* Sign masks come lane 0 first (compare masks, movemask); bytes are MSB first: reverse the bits
 * of each byte of a mask holding up to eight bytes. Its own inverse, so it also turns eight
 * bytes of signs into a lane-first mask. */
static inline uint64_t msb_first(uint64_t mask) {
    mask = (mask & 0x5555555555555555u) << 1 | (mask >> 1 & 0x5555555555555555u);
    mask = (mask & 0x3333333333333333u) << 2 | (mask >> 2 & 0x3333333333333333u);
    return (mask & 0x0F0F0F0F0F0F0F0Fu) << 4 | (mask >> 4 & 0x0F0F0F0F0F0F0F0Fu);
}

/* How many of the 8 elements of a byte are real, given `remaining` = real count - byte start. */
static inline int live_lanes(int64_t remaining) {
    return remaining >= 8 ? 8 : remaining > 0 ? (int)remaining : 0;
}

/* The sign byte of v[0..8) (MSB first). */
static inline uint8_t sign_byte(const float *v) {
#ifdef __SSE2__
    __m128 zero = _mm_setzero_ps();
    int low = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v), zero));
    int high = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(v + 4), zero));
    return (uint8_t)msb_first((uint64_t)(low | high << 4));
#else
    uint8_t b = 0;
    for (int k = 0; k < 8; k++) b |= (uint8_t)((v[k] >= 0.0f) << (7 - k));
    return b;
#endif
}

/* The sign byte of v[0..8); adds v[k]^2 to lanes[k] for k < live. */
static inline uint8_t pack8(const float *v, double *lanes, int live) {
    for (int k = 0; k < live; k++) lanes[k] += (double)v[k] * (double)v[k];
    return sign_byte(v);
}

/* The 8 lanes of a block from its 32 (see the top of the file). */
static inline void fold_lanes(const double *acc, double *lanes) {
    for (int k = 0; k < 8; k++) lanes[k] = (acc[k] + acc[8 + k]) + (acc[16 + k] + acc[24 + k]);
}

static inline double sum8(const double *lanes) {
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

static inline float minus_signed(float v, float s) {
    return v - (v >= 0.0f ? s : -s);
}

/* |v| as the bits of its float (the sign cleared): as integers these order as the magnitudes
 * do, with every NaN above infinity, so the largest is max |v|, or a NaN where there is one (as
 * torch.aminmax gives). Signed, though never negative: x86 has a signed 32-bit max from SSE4.1
 * and AVX2 on, an unsigned one only in SSE4.1, which the portable build cannot assume. */
static inline int32_t magnitude_bits(float v) {
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return i & 0x7FFFFFFF;
}

static inline double magnitude_value(int32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return (double)f;
}

/* ------------------------------------------------------------------------------------------ */
/* Run-time configuration: which kernel set, how many threads, from what size.                 */

static int cpu_features;
static _Atomic int use_features, use_threads = 1;
static _Atomic cc_index use_split_min = 3 << 20; /* compcomm._native.SPLIT_MIN sets it */

#ifdef __SSE2__
static int detect_features(void) {
    __builtin_cpu_init();
    int found = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        found |= HAVE_AVX2;
    if ((found & HAVE_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        found |= HAVE_AVX512;
    return found;
}
#else
static int detect_features(void) {
    return 0;
}
#endif

int cc_abi_version(void) {
    return CC_ABI_VERSION;
}

int cc_cpu_features(void) {
    return cpu_features;
}

int cc_features(void) {
    return atomic_load_explicit(&use_features, memory_order_relaxed);
}

void cc_configure(int features, int threads, cc_index split_min) {
    atomic_store_explicit(&use_features, features & cpu_features, memory_order_relaxed);
    atomic_store_explicit(&use_threads, threads > 1 ? threads : 1, memory_order_relaxed);
    atomic_store_explicit(&use_split_min, split_min, memory_order_relaxed);
}

/* ------------------------------------------------------------------------------------------ */
/* The thread pool: a pass is `chunks` independent calls run(args, chunk), in any order.       */

typedef void (*chunk_fn)(void *args, int64_t chunk);

struct job {
    chunk_fn run;
    void *args;
    int64_t chunks;
    atomic_llong next; /* the next chunk to claim */
    int helpers;       /* pool threads that may join */
    int joined, closed; /* under pool.lock */
    atomic_int active;  /* helpers working on it; changed under pool.lock */
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, idle;
    int workers;
    atomic_ulong generation; /* bumped (under lock) for each job posted */
    struct job *job;         /* the job in progress, or NULL */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL};

/* Waking a sleeping thread takes a system call and, on a virtual machine whose idle core has
 * halted, tens of microseconds, about what a pass over 1 MiB costs. So a thread that expects
 * news soon polls for it this many times (about 20-50 us) before it sleeps: a helper after its
 * job (passes often come back to back: scan then update, one decode per server), the caller
 * while the helpers finish their last blocks. */
enum { POLLS = 2000 };

static inline void pause_briefly(void) {
#ifdef __SSE2__
    _mm_pause();
#endif
}

static void work_on(struct job *job) {
    for (;;) {
        int64_t chunk = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (chunk >= job->chunks) return;
        job->run(job->args, chunk);
    }
}

static void *worker_main(void *start) {
    unsigned long seen = (unsigned long)(uintptr_t)start;
    for (;;) {
        for (int i = 0; i < POLLS && atomic_load_explicit(&pool.generation, memory_order_relaxed) == seen; i++)
            pause_briefly();
        pthread_mutex_lock(&pool.lock);
        while (atomic_load_explicit(&pool.generation, memory_order_relaxed) == seen)
            pthread_cond_wait(&pool.wake, &pool.lock);
        seen = atomic_load_explicit(&pool.generation, memory_order_relaxed);
        struct job *job = pool.job;
        if (!job || job->closed || job->joined >= job->helpers) {
            pthread_mutex_unlock(&pool.lock);
            continue;
        }
        job->joined++;
        atomic_fetch_add_explicit(&job->active, 1, memory_order_relaxed);
        pthread_mutex_unlock(&pool.lock);
        work_on(job);
        pthread_mutex_lock(&pool.lock); /* the caller takes the job back under this lock, so the */
        atomic_fetch_sub_explicit(&job->active, 1, memory_order_release); /* job outlives this */
        if (job->closed) pthread_cond_signal(&pool.idle);
        pthread_mutex_unlock(&pool.lock);
    }
    return NULL;
}

/* Start pool threads until there are `wanted` (under pool.lock). They block every signal, so
 * that signals reach the interpreter's threads. Returns how many there are. */
static int grow_pool(int wanted) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        unsigned long now = atomic_load_explicit(&pool.generation, memory_order_relaxed);
        int failed = pthread_create(&thread, &attr, worker_main, (void *)(uintptr_t)now);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pool.workers;
}

/* The child of a fork has none of the parent's pool threads: it starts with an empty pool. */
static void pool_lock(void) {
    pthread_mutex_lock(&pool.lock);
}

static void pool_unlock(void) {
    pthread_mutex_unlock(&pool.lock);
}

static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pool.workers = 0;
    pool.job = NULL;
}

__attribute__((constructor)) static void setup(void) {
    cpu_features = detect_features();
    atomic_store(&use_features, cpu_features);
    pthread_atfork(pool_lock, pool_unlock, pool_after_fork);
}

/* Threads for a pass over `count` elements in `chunks` chunks (1: the caller alone). */
static int threads_for(int64_t count, int64_t chunks) {
    int threads = atomic_load_explicit(&use_threads, memory_order_relaxed);
    if (threads <= 1 || count < atomic_load_explicit(&use_split_min, memory_order_relaxed)) return 1;
    return chunks < threads ? (int)chunks : threads;
}

/* run(args, c) for every c in [0, chunks), on `threads` threads (the caller one of them). */
static void run_chunks(chunk_fn run, void *args, int64_t chunks, int threads) {
    struct job job = {.run = run, .args = args, .chunks = chunks, .helpers = threads - 1};
    atomic_init(&job.next, 0);
    atomic_init(&job.active, 0);
    int posted = 0;
    if (threads > 1) {
        pthread_mutex_lock(&pool.lock);
        if (!pool.job && grow_pool(threads - 1) > 0) {
            pool.job = &job;
            atomic_fetch_add_explicit(&pool.generation, 1, memory_order_relaxed);
            pthread_cond_broadcast(&pool.wake);
            posted = 1;
        }
        pthread_mutex_unlock(&pool.lock);
    }
    work_on(&job);
    if (!posted) return;
    pthread_mutex_lock(&pool.lock);
    job.closed = 1; /* no helper joins from now on */
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < POLLS && atomic_load_explicit(&job.active, memory_order_acquire); i++) pause_briefly();
    pthread_mutex_lock(&pool.lock);
    while (atomic_load_explicit(&job.active, memory_order_acquire)) pthread_cond_wait(&pool.idle, &pool.lock);
    pool.job = NULL;
    pthread_mutex_unlock(&pool.lock);
}

/* The sum of the blocks' partial sums `one(args, b)` in block order, on `threads` threads. */
typedef double (*block_sum_fn)(void *args, int64_t block);

struct summed {
    block_sum_fn one;
    void *args;
    double *sums;
};

static void sum_chunk(void *p, int64_t block) {
    struct summed *s = p;
    s->sums[block] = s->one(s->args, block);
}

static inline double combine(double total, double block, int largest) {
    return largest ? (block > total ? block : total) : total + block;
}

/* `largest`: the largest of the blocks' results instead of their sum (they are then
 * magnitude_bits, so never NaN). */
static double sum_blocks(block_sum_fn one, void *args, int64_t blocks, int threads, int largest) {
    double total = 0.0, local[256], *sums = local;
    if (threads > 1 && blocks > 256) sums = malloc((size_t)blocks * sizeof(double));
    if (threads <= 1 || !sums) {
        for (int64_t b = 0; b < blocks; b++) total = combine(total, one(args, b), largest);
        return total;
    }
    struct summed s = {one, args, sums};
    run_chunks(sum_chunk, &s, blocks, threads);
    for (int64_t b = 0; b < blocks; b++) total = combine(total, sums[b], largest);
    if (sums != local) free(sums);
    return total;
}

static inline int64_t blocks_of(int64_t count) {
    return count > 0 ? (count + BLOCK - 1) / BLOCK : 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Pass 1 on a worker: v = x + e (x zero beyond n, e optional), bits = sign(v); returns         */
/* sum(v[:n]^2). x is formed as (x + addend) / divisor when the scan has an addend (fp32, n    */
/* elements) or a divisor other than 1: a node's sum and mean, never written out.               */
/* With `pending`, e holds the previous call's x' and s its scale: the error is                 */
/* e - s sign(e) on [:n] and 0 beyond (the x' form; the same fp32 operations as the update that */
/* it replaces). With `out`, v is also written there, over [0, m): the new x'. Writes nothing   */
/* but `bits` and `out`, so a call rejected afterwards leaves no trace in the error state.      */

struct scan_args {
    const void *x;
    int dtype;
    int64_t n;
    const float *addend;
    float divisor;
    const float *e;
    float s;
    int pending;
    int64_t m;
    float *out;
    uint8_t *bits;
    int streaming;
    int features;
};

/* The previous error at element i < n (see above). */
static inline float previous_error(const struct scan_args *a, int64_t i) {
    return a->pending ? minus_signed(a->e[i], a->s) : a->e[i];
}

/* x at element i < n, formed: (x + addend) / divisor. */
static inline float formed(const struct scan_args *a, int64_t i, int dtype) {
    float v = load(a->x, i, dtype);
    if (a->addend) v += a->addend[i];
    return a->divisor != 1.0f ? v / a->divisor : v;
}

/* v[k] for the 8 elements of byte i/8 (also written to out, when the scan has one). */
static inline void load8(const struct scan_args *a, int64_t i, float *v) {
    for (int k = 0; k < 8; k++) {
        int64_t j = i + k;
        v[k] = j < a->n ? formed(a, j, a->dtype) : 0.0f;
        if (a->e) v[k] += j < a->n || !a->pending ? previous_error(a, j) : 0.0f;
        if (a->out) a->out[j] = v[k];
    }
}

/* The bytes of [i, hi) one at a time, into `lanes`; the block's sum. */
static double scan_tail(const struct scan_args *a, int64_t i, int64_t hi, double *lanes) {
    float v[8];
    for (; i < hi; i += 8) {
        load8(a, i, v);
        a->bits[i / 8] = pack8(v, lanes, live_lanes(a->n - i));
    }
    return sum8(lanes);
}

INLINE double scan_block_portable(const struct scan_args *a, int64_t lo, int64_t hi, int dtype) {
    double acc[32] = {0}, lanes[8];
    float v[32];
    int64_t i = lo, end = min64(hi, a->n);
    for (; i + 32 <= end; i += 32) {
        for (int k = 0; k < 32; k++) v[k] = formed(a, i + k, dtype);
        if (a->e)
            for (int k = 0; k < 32; k++) v[k] += previous_error(a, i + k);
        if (a->out) memcpy(a->out + i, v, sizeof v);
        for (int k = 0; k < 32; k++) acc[k] += (double)v[k] * (double)v[k];
        for (int b = 0; b < 4; b++) a->bits[i / 8 + b] = sign_byte(v + 8 * b);
    }
    fold_lanes(acc, lanes);
    return scan_tail(a, i, hi, lanes);
}

#ifdef __SSE2__
TARGET_AVX2 INLINE __m256 load8_avx2(const void *x, int dtype, int64_t i) {
    if (dtype == F32) return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (dtype == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TARGET_AVX2 INLINE __m256 minus_signed8(__m256 v, __m256 plus, __m256 minus) {
    return _mm256_sub_ps(v, _mm256_blendv_ps(minus, plus, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ)));
}

/* Eight floats to out (32-byte aligned when streaming: out is, and lo and i are multiples of 8). */
TARGET_AVX2 INLINE void put8(float *out, __m256 v, int streaming) {
    if (streaming) _mm256_stream_ps(out, v);
    else _mm256_storeu_ps(out, v);
}

/* acc[0], acc[1] += the float64 squares of v's low and high halves. */
TARGET_AVX2 INLINE void add_squares8(__m256 v, __m256d *acc) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
}

/* The four sign bytes of v[0..4) at out; squares of v[j] into acc[2j], acc[2j+1] (lanes
 * 8j..8j+3 and 8j+4..8j+7 of the 32). */
TARGET_AVX2 INLINE void pack32_avx2(const __m256 *v, __m256d *acc, uint8_t *out) {
    uint32_t mask = 0;
    for (int j = 0; j < 4; j++) {
        mask |= (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v[j], _mm256_setzero_ps(), _CMP_GE_OQ)) << (8 * j);
        add_squares8(v[j], acc + 2 * j);
    }
    mask = (uint32_t)msb_first(mask);
    memcpy(out, &mask, 4); /* x86 is little-endian: byte j holds bits 8j..8j+7 */
}

/* The 8 lanes from pack32_avx2's accumulators (fold_lanes). */
TARGET_AVX2 INLINE void fold_avx2(const __m256d *acc, double *lanes) {
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(acc[0], acc[2]), _mm256_add_pd(acc[4], acc[6])));
    _mm256_storeu_pd(lanes + 4, _mm256_add_pd(_mm256_add_pd(acc[1], acc[3]), _mm256_add_pd(acc[5], acc[7])));
}

/* The vector part of a block with AVX2, over whole groups of 32 elements in [lo, end):
 * values(args, i, 4, dtype, v) gives the 4 vectors of 8 from element i, whose signs go to
 * bits and squares to the lanes. Returns where it stopped; lanes get the 8 folded sums. */
typedef void (*values_avx2)(const void *args, int64_t i, int groups, int dtype, __m256 *v);

TARGET_AVX2 INLINE int64_t vector_part_avx2(values_avx2 values, const void *args, int dtype, int64_t lo,
                                            int64_t end, uint8_t *bits, double *lanes) {
    __m256d acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_pd();
    __m256 v[4];
    int64_t i = lo;
    for (; i + 32 <= end; i += 32) {
        values(args, i, 4, dtype, v);
        pack32_avx2(v, acc, bits + i / 8);
    }
    fold_avx2(acc, lanes);
    return i;
}

/* The scan's values (v = x + e, x formed with its addend and divisor, e in the x' form when
 * pending; v stored to out when there is one) and block for one kernel set, whose vectors hold
 * `width` floats: `load` converts x's elements; `add`, `div`, `loadu` and `set1` are the set's,
 * `minus_signed` and `put` as above. The vector part covers real elements only (i < n), where
 * the addend and the x' form's error need no mask. */
#define SCAN_WITH(isa, target, vector, width, load, add, div, loadu, set1, minus_signed, put)            \
    target INLINE void scan_values_##isa(const void *p, int64_t i, int groups, int dtype, vector *v) {     \
        const struct scan_args *a = p;                                                                     \
        vector plus = set1(a->s), minus = set1(-a->s), divisor = set1(a->divisor);                         \
        for (int j = 0; j < groups; j++) {                                                                 \
            v[j] = load(a->x, dtype, i + width * j);                                                       \
            if (a->addend) v[j] = add(v[j], loadu(a->addend + i + width * j));                             \
            if (a->divisor != 1.0f) v[j] = div(v[j], divisor);                                             \
            if (a->e) {                                                                                    \
                vector e = loadu(a->e + i + width * j);                                                    \
                v[j] = add(v[j], a->pending ? minus_signed(e, plus, minus) : e);                           \
            }                                                                                              \
            if (a->out) put(a->out + i + width * j, v[j], a->streaming);                                   \
        }                                                                                                  \
    }                                                                                                      \
    target INLINE double scan_block_##isa(const struct scan_args *a, int64_t lo, int64_t hi, int dtype) {  \
        double lanes[8];                                                                                   \
        int64_t i = vector_part_##isa(scan_values_##isa, a, dtype, lo, min64(hi, a->n), a->bits, lanes);  \
        double sum = scan_tail(a, i, hi, lanes);                                                           \
        if (a->streaming) _mm_sfence();                                                                    \
        return sum;                                                                                        \
    }
SCAN_WITH(avx2, TARGET_AVX2, __m256, 8, load8_avx2, _mm256_add_ps, _mm256_div_ps, _mm256_loadu_ps, _mm256_set1_ps,
          minus_signed8, put8)

TARGET_AVX512 INLINE __m512 load16_avx512(const void *x, int dtype, int64_t i) {
    if (dtype == F32) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (dtype == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* load16_avx512 of the lanes in k (the others 0, and not read). */
TARGET_AVX512 INLINE __m512 load16_masked(const void *x, int dtype, int64_t i, __mmask16 k) {
    if (dtype == F32) return _mm512_maskz_loadu_ps(k, (const float *)x + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)x + i);
    if (dtype == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET_AVX512 INLINE __mmask16 nonnegative(__m512 v) {
    return _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
}

/* acc[0] += squares of v[0..8), acc[1] += squares of v[8..16) (lanes 0-7 and 8-15 of 16). */
TARGET_AVX512 INLINE void add_squares16(__m512 v, __m512d *acc) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    acc[0] = _mm512_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm512_fmadd_pd(hi, hi, acc[1]);
}

/* Sign bytes and squares of `groups` (2 or 4) vectors of 16 at out: vector j's squares go to
 * acc[2 (j % 2)], acc[2 (j % 2) + 1], so that acc[q] holds the lanes 8q..8q+7 of the 32. */
TARGET_AVX512 INLINE void pack_avx512(const __m512 *v, int groups, __m512d *acc, uint8_t *out) {
    uint64_t mask = 0;
    for (int j = 0; j < groups; j++) {
        mask |= (uint64_t)nonnegative(v[j]) << (16 * j);
        add_squares16(v[j], acc + 2 * (j % 2));
    }
    mask = msb_first(mask);
    memcpy(out, &mask, (size_t)(2 * groups));
}

TARGET_AVX512 INLINE void fold_avx512(const __m512d *acc, double *lanes) {
    _mm512_storeu_pd(lanes, _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3])));
}

/* The vector part of a block with AVX-512, over whole groups of 32 elements in [lo, end), 64 a
 * step and 32 at the end: values(args, i, groups, dtype, v) gives the `groups` (4 or 2) vectors
 * of 16 from element i, whose signs go to bits and squares to the lanes (acc[q] holds lanes
 * 8q..8q+7 of the 32). Returns where it stopped; lanes get the 8 folded sums. */
typedef void (*values_avx512)(const void *args, int64_t i, int groups, int dtype, __m512 *v);

TARGET_AVX512 INLINE int64_t vector_part_avx512(values_avx512 values, const void *args, int dtype, int64_t lo,
                                                int64_t end, uint8_t *bits, double *lanes) {
    __m512d acc[4];
    for (int j = 0; j < 4; j++) acc[j] = _mm512_setzero_pd();
    __m512 v[4];
    int64_t i = lo;
    for (; i + 64 <= end; i += 64) {
        values(args, i, 4, dtype, v);
        pack_avx512(v, 4, acc, bits + i / 8);
    }
    if (i + 32 <= end) {
        values(args, i, 2, dtype, v);
        pack_avx512(v, 2, acc, bits + i / 8);
        i += 32;
    }
    fold_avx512(acc, lanes);
    return i;
}

TARGET_AVX512 INLINE __m512 minus_signed16(__m512 v, __m512 plus, __m512 minus) {
    return _mm512_sub_ps(v, _mm512_mask_blend_ps(nonnegative(v), minus, plus));
}

/* Sixteen floats to out (64-byte aligned when streaming). */
TARGET_AVX512 INLINE void put16(float *out, __m512 v, int streaming) {
    if (streaming) _mm512_stream_ps(out, v);
    else _mm512_storeu_ps(out, v);
}

SCAN_WITH(avx512, TARGET_AVX512, __m512, 16, load16_avx512, _mm512_add_ps, _mm512_div_ps, _mm512_loadu_ps,
          _mm512_set1_ps, minus_signed16, put16)
#endif

/* One scan block per call, specialized for each kernel set and dtype. */
#define SCAN_BLOCK(name, target, body)                                                                   \
    target static double name(void *p, int64_t b) {                                                      \
        const struct scan_args local = *(const struct scan_args *)p, *a = &local;                        \
        int64_t lo = b * BLOCK, hi = min64(lo + BLOCK, a->m);                                            \
        return a->dtype == F32 ? body(a, lo, hi, F32) : a->dtype == F16 ? body(a, lo, hi, F16)           \
                                                                        : body(a, lo, hi, BF16);         \
    }
SCAN_BLOCK(scan_portable, , scan_block_portable)
#ifdef __SSE2__
SCAN_BLOCK(scan_avx2, TARGET_AVX2, scan_block_avx2)
SCAN_BLOCK(scan_avx512, TARGET_AVX512, scan_block_avx512)
#endif

static block_sum_fn pick_scan(int features) {
#ifdef __SSE2__
    if (features & HAVE_AVX512) return scan_avx512;
    if (features & HAVE_AVX2) return scan_avx2;
#else
    (void)features;
#endif
    return scan_portable;
}

void cc_worker_scan(const void *x, int dtype, cc_index n, const float *addend, float divisor, const float *e, float s,
                    int pending, cc_index m, float *out, unsigned char *bits, double *partial) {
    struct scan_args a = {x, dtype, n, addend, divisor, e, s, pending && e, m, out, bits, 0, cc_features()};
#ifdef __SSE2__
    /* Streaming stores (see STREAM_BYTES) for a large new x', on aligned vectors: the vector part
     * starts every block at a multiple of 32 elements, so an out on a 64-byte boundary is. */
    a.streaming = out && (a.features & (HAVE_AVX2 | HAVE_AVX512)) && (uintptr_t)out % 64 == 0 &&
                  m * (int64_t)sizeof(float) >= STREAM_BYTES;
#endif
    int64_t blocks = blocks_of(m);
    *partial = sum_blocks(pick_scan(a.features), &a, blocks, threads_for(m, blocks), 0);
}

/* ------------------------------------------------------------------------------------------ */
/* Pass 2: out <- v - s sign(v), v = x + e (x may be NULL: v = e), on [:real]; 0 on [real:m].  */
/* out may be e itself (in place) or another buffer (e is then left as it was). Returns max     */
/* |out| as it writes (a server error's bound for the next call's phase 0, with no pass of its  */
/* own).                                                                                        */

struct update_args {
    const void *x;
    int dtype;
    int64_t with_x; /* v = x + e on [0, with_x), v = e beyond */
    const float *e;
    float *out;
    int64_t real;
    float s;
    int streaming;
    int features;
};

/* Each body returns the largest magnitude_bits of what it wrote. */
INLINE int32_t update_portable(const struct update_args *a, int64_t lo, int64_t hi, int dtype) {
    int32_t peak = 0;
    for (int64_t i = lo; i < hi; i++) {
        float v = i < a->with_x ? load(a->x, i, dtype) + a->e[i] : a->e[i], r = minus_signed(v, a->s);
        int32_t m = magnitude_bits(r);
        a->out[i] = r;
        peak = m > peak ? m : peak;
    }
    return peak;
}

#ifdef __SSE2__
TARGET_AVX2 INLINE __m256i peak8(__m256i peak, __m256 r) {
    return _mm256_max_epi32(peak, _mm256_and_si256(_mm256_castps_si256(r), _mm256_set1_epi32(0x7FFFFFFF)));
}

TARGET_AVX2 INLINE int32_t update_avx2(const struct update_args *a, int64_t lo, int64_t hi, int dtype) {
    __m256 plus = _mm256_set1_ps(a->s), minus = _mm256_set1_ps(-a->s);
    __m256i peaks = _mm256_setzero_si256();
    const float *e = a->e;
    float *out = a->out;
    int64_t i = lo, split = a->with_x < lo ? lo : min64(a->with_x, hi);
    for (; i + 8 <= split; i += 8) {
        __m256 r = minus_signed8(_mm256_add_ps(load8_avx2(a->x, dtype, i), _mm256_loadu_ps(e + i)), plus, minus);
        put8(out + i, r, a->streaming);
        peaks = peak8(peaks, r);
    }
    int32_t lanes[8], peak = update_portable(a, i, split, dtype);
    i = split;
    int64_t aligned = min64(hi, (i + 7) / 8 * 8); /* back to whole rows of 8 (aligned) */
    int32_t head = update_portable(a, i, aligned, dtype);
    peak = head > peak ? head : peak;
    for (i = aligned; i + 8 <= hi; i += 8) {
        __m256 r = minus_signed8(_mm256_loadu_ps(e + i), plus, minus);
        put8(out + i, r, a->streaming);
        peaks = peak8(peaks, r);
    }
    int32_t tail = update_portable(a, i, hi, dtype);
    peak = tail > peak ? tail : peak;
    if (a->streaming) _mm_sfence();
    _mm256_storeu_si256((__m256i *)lanes, peaks);
    for (int k = 0; k < 8; k++) peak = lanes[k] > peak ? lanes[k] : peak;
    return peak;
}

/* Elements i + (lanes of k) of the AVX-512 update (k: all 16 but at the ends of a span);
 * returns `peak` raised by their magnitude_bits. */
TARGET_AVX512 INLINE __m512i update16(const struct update_args *a, int64_t i, __mmask16 k, int dtype, __m512 plus,
                                      __m512 minus, int streaming, __m512i peak) {
    int full = k == 0xFFFF;
    __m512 v = full ? _mm512_loadu_ps(a->e + i) : _mm512_maskz_loadu_ps(k, a->e + i);
    if (i + 16 <= a->with_x && full) {
        v = _mm512_add_ps(load16_avx512(a->x, dtype, i), v);
    } else if (i < a->with_x) { /* x ends in this vector: x + e below its end, e beyond */
        int64_t left = a->with_x - i;
        __mmask16 kx = (__mmask16)(k & (left >= 16 ? 0xFFFF : (1u << left) - 1));
        v = _mm512_mask_add_ps(v, kx, load16_masked(a->x, dtype, i, kx), v);
    }
    __m512 r = minus_signed16(v, plus, minus);
    if (!full) _mm512_mask_storeu_ps(a->out + i, k, r);
    else if (streaming) _mm512_stream_ps(a->out + i, r);
    else _mm512_storeu_ps(a->out + i, r);
    __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_mask_max_epi32(peak, k, peak, magnitude);
}

static inline __mmask16 first_lanes16(int64_t count) {
    return (__mmask16)(count >= 16 ? 0xFFFF : (1u << count) - 1);
}

/* Streaming stores need 64-byte aligned addresses: the span's head up to the first such
 * address (any element count) runs with masked plain stores. */
TARGET_AVX512 INLINE int32_t update_avx512(const struct update_args *a, int64_t lo, int64_t hi, int dtype) {
    __m512 plus = _mm512_set1_ps(a->s), minus = _mm512_set1_ps(-a->s);
    __m512i peak = _mm512_setzero_si512();
    int64_t i = lo;
    if (a->streaming) {
        int64_t head = min64((int64_t)((64 - (uintptr_t)(a->out + lo) % 64) % 64 / 4), hi - lo);
        if (head) peak = update16(a, i, first_lanes16(head), dtype, plus, minus, 0, peak);
        i += head;
    }
    for (; i + 16 <= hi; i += 16) peak = update16(a, i, 0xFFFF, dtype, plus, minus, a->streaming, peak);
    if (i < hi) peak = update16(a, i, first_lanes16(hi - i), dtype, plus, minus, 0, peak);
    if (a->streaming) _mm_sfence();
    return _mm512_reduce_max_epi32(peak);
}
#endif

#define UPDATE_BLOCK(name, target, body)                                                                   \
    target static double name(void *p, int64_t b) {                                                        \
        const struct update_args local = *(const struct update_args *)p, *a = &local;                      \
        int64_t lo = b * BLOCK, hi = min64(lo + BLOCK, a->real);                                           \
        if (a->dtype == F32 || !a->x) return body(a, lo, hi, F32);                                         \
        if (a->dtype == F16) return body(a, lo, hi, F16);                                                  \
        return body(a, lo, hi, BF16);                                                                      \
    }
UPDATE_BLOCK(update_block_portable, , update_portable)
#ifdef __SSE2__
UPDATE_BLOCK(update_block_avx2, TARGET_AVX2, update_avx2)
UPDATE_BLOCK(update_block_avx512, TARGET_AVX512, update_avx512)
#endif

void cc_error_update(const void *x, int dtype, cc_index n, const float *e, float *out, cc_index real, cc_index m,
                     float s, double *partial) {
    struct update_args a = {x, dtype, x ? min64(n, real) : 0, e, out, real, s, 0, cc_features()};
    block_sum_fn one = update_block_portable;
#ifdef __SSE2__
    /* Streaming pays only when out is another buffer: in place, its lines are read anyway. The
     * AVX2 stores need 32-byte alignment; the AVX-512 ones align themselves. */
    int large = out != e && real * (int64_t)sizeof(float) >= STREAM_BYTES;
    if (a.features & HAVE_AVX512) {
        one = update_block_avx512;
        a.streaming = large;
    } else if (a.features & HAVE_AVX2) {
        one = update_block_avx2;
        a.streaming = large && (uintptr_t)out % 32 == 0;
    }
#endif
    int64_t blocks = blocks_of(real);
    *partial = magnitude_value((int32_t)sum_blocks(one, &a, blocks, threads_for(real, blocks), 1));
    if (m > real) memset(out + real, 0, (size_t)(m - real) * sizeof(float));
}

/* ------------------------------------------------------------------------------------------ */
/* Server pass: y = e + (sum_r scales[r] sign_r) / divisor, summed in rank order, stored in e;  */
/* out_bits = sign(y); returns sum(y[:real]^2). Row r of `bits` starts at r * stride.           */
/* SIGNS[b] holds the eight +-1 coded by byte b: +-1 * s is exact, so sign * s + a rounds       */
/* once, as a +- s does, with or without a fused multiply-add.                                  */

static float SIGNS[256][8];

__attribute__((constructor)) static void fill_signs(void) {
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) SIGNS[b][k] = (b >> (7 - k)) & 1 ? 1.0f : -1.0f;
}

struct server_args {
    const uint8_t *bits;
    int64_t stride;
    int nranks;
    const float *scales;
    float divisor;
    const float *previous;
    float *e;
    int64_t c, real;
    uint8_t *out_bits;
    int features;
};

/* y = previous + a of one byte's eight elements, stored in e. */
static inline void server_byte(const struct server_args *a, int64_t byte) {
    float acc[8];
    const float *previous = a->previous + 8 * byte;
    float *y = a->e + 8 * byte;
    for (int k = 0; k < 8; k++) acc[k] = SIGNS[a->bits[byte]][k] * a->scales[0];
    for (int r = 1; r < a->nranks; r++)
        for (int k = 0; k < 8; k++) acc[k] += SIGNS[a->bits[r * a->stride + byte]][k] * a->scales[r];
    for (int k = 0; k < 8; k++) y[k] = previous[k] + (a->divisor != 1.0f ? acc[k] / a->divisor : acc[k]);
}

/* The bytes of [i, hi) one at a time, into `lanes`; the block's sum. */
static double server_tail(const struct server_args *a, int64_t i, int64_t hi, double *lanes) {
    for (; i < hi; i += 8) {
        server_byte(a, i / 8);
        a->out_bits[i / 8] = pack8(a->e + i, lanes, live_lanes(a->real - i));
    }
    return sum8(lanes);
}

INLINE double server_block_portable(const struct server_args *a, int64_t lo, int64_t hi) {
    double acc[32] = {0}, lanes[8];
    int64_t i = lo, end = min64(hi, a->real);
    for (; i + 32 <= end; i += 32) {
        for (int j = 0; j < 4; j++) server_byte(a, i / 8 + j);
        for (int k = 0; k < 32; k++) acc[k] += (double)a->e[i + k] * (double)a->e[i + k];
        for (int j = 0; j < 4; j++) a->out_bits[i / 8 + j] = sign_byte(a->e + i + 8 * j);
    }
    fold_lanes(acc, lanes);
    return server_tail(a, i, hi, lanes);
}

#ifdef __SSE2__
/* y = previous + a of one byte of the server pass, stored in e and returned. */
TARGET_AVX2 INLINE __m256 server8_avx2(const struct server_args *a, int64_t byte) {
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(SIGNS[a->bits[byte]]), _mm256_set1_ps(a->scales[0]));
    for (int r = 1; r < a->nranks; r++)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(SIGNS[a->bits[r * a->stride + byte]]), _mm256_set1_ps(a->scales[r]),
                              sum);
    if (a->divisor != 1.0f) sum = _mm256_div_ps(sum, _mm256_set1_ps(a->divisor));
    __m256 y = _mm256_add_ps(_mm256_loadu_ps(a->previous + 8 * byte), sum);
    _mm256_storeu_ps(a->e + 8 * byte, y);
    return y;
}

TARGET_AVX2 INLINE void server_values_avx2(const void *p, int64_t i, int groups, int dtype, __m256 *y) {
    (void)dtype;
    for (int j = 0; j < groups; j++) y[j] = server8_avx2(p, i / 8 + j);
}

TARGET_AVX2 INLINE double server_block_avx2(const struct server_args *a, int64_t lo, int64_t hi) {
    double lanes[8];
    int64_t i = vector_part_avx2(server_values_avx2, a, F32, lo, min64(hi, a->real), a->out_bits, lanes);
    return server_tail(a, i, hi, lanes);
}

/* y = previous + a for elements [i, i + 16 groups), stored in e: rank r's sign of each element is the
 * blend of +s_r and -s_r under its bit, added in rank order (a +- s, as in server_byte). The
 * bits are used as they come, lane k of a byte's eight taking its bit k, which is element
 * 7 - k: the sums are formed in that order and put back in element order once, after the ranks
 * (a permutation moves values; it changes no bits). */
TARGET_AVX512 INLINE void server_values_avx512(const void *p, int64_t i, int groups, int dtype, __m512 *y) {
    const struct server_args *a = p;
    (void)dtype;
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int r = 0; r < a->nranks; r++) {
        const uint8_t *row = a->bits + r * a->stride + i / 8;
        __m512 plus = _mm512_set1_ps(a->scales[r]), minus = _mm512_set1_ps(-a->scales[r]);
        for (int j = 0; j < groups; j++) {
            __m512 sign = _mm512_mask_blend_ps(_load_mask16((__mmask16 *)(row + 2 * j)), minus, plus);
            sum[j] = r ? _mm512_add_ps(sum[j], sign) : sign;
        }
    }
    __m512i reverse8 = _mm512_set_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = 0; j < groups; j++) {
        __m512 in_order = _mm512_permutexvar_ps(reverse8, sum[j]);
        if (a->divisor != 1.0f) in_order = _mm512_div_ps(in_order, _mm512_set1_ps(a->divisor));
        y[j] = _mm512_add_ps(_mm512_loadu_ps(a->previous + i + 16 * j), in_order);
        _mm512_storeu_ps(a->e + i + 16 * j, y[j]);
    }
}

TARGET_AVX512 INLINE double server_block_avx512(const struct server_args *a, int64_t lo, int64_t hi) {
    double lanes[8];
    int64_t i = vector_part_avx512(server_values_avx512, a, F32, lo, min64(hi, a->real), a->out_bits, lanes);
    return server_tail(a, i, hi, lanes);
}
#endif

/* One server block per call, for each kernel set. */
#define SERVER_BLOCK(name, target, body)                                                                 \
    target static double name(void *p, int64_t b) {                                                      \
        const struct server_args local = *(const struct server_args *)p, *a = &local;                    \
        return body(a, b * BLOCK, min64(b * BLOCK + BLOCK, a->c));                                       \
    }
SERVER_BLOCK(server_portable, , server_block_portable)
#ifdef __SSE2__
SERVER_BLOCK(server_avx2, TARGET_AVX2, server_block_avx2)
SERVER_BLOCK(server_avx512, TARGET_AVX512, server_block_avx512)
#endif

void cc_server_scan(const unsigned char *bits, cc_index stride, int nranks, const float *scales, float divisor,
                    const float *previous, float *e, cc_index c, cc_index real, unsigned char *out_bits,
                    double *partial) {
    struct server_args a = {bits, stride, nranks, scales, divisor, previous, e, c, real, out_bits, cc_features()};
    block_sum_fn one = server_portable;
#ifdef __SSE2__
    if (a.features & HAVE_AVX512) one = server_avx512;
    else if (a.features & HAVE_AVX2) one = server_avx2;
#endif
    int64_t blocks = blocks_of(c);
    *partial = sum_blocks(one, &a, blocks, threads_for(c, blocks), 0);
}

/* ------------------------------------------------------------------------------------------ */
/* Decode: out[:count] <- per bit one of two precomputed bit patterns (+t and -t in the output */
/* dtype).                                                                                       */

struct decode_args {
    const uint8_t *bits;
    int64_t count;
    int elsize;
    uint32_t plus, minus;
    const void *table; /* [256][8] patterns of elsize bytes (portable and AVX2) */
    void *out;
    int streaming;
    int features;
};

/* Elements [lo, hi) (lo a multiple of 8) by table rows of `elsize` bytes per element (a
 * constant where inlined, so that each row is copied by a few moves, not a call); the last
 * partial byte element-wise. */
INLINE void decode_rows_of(const struct decode_args *a, int64_t lo, int64_t hi, size_t elsize) {
    int64_t whole = hi / 8 * 8;
    char *out = a->out;
    const char *table = a->table;
    const uint8_t *bits = a->bits;
    for (int64_t i = lo; i < whole; i += 8) memcpy(out + i * elsize, table + bits[i / 8] * 8 * elsize, 8 * elsize);
    if (whole < hi && whole >= lo)
        memcpy(out + whole * elsize, table + bits[whole / 8] * 8 * elsize, (size_t)(hi - whole) * elsize);
}

static void decode_rows(const struct decode_args *a, int64_t lo, int64_t hi) {
    if (a->elsize == 4) decode_rows_of(a, lo, hi, 4);
    else decode_rows_of(a, lo, hi, 2);
}

static void decode_portable(void *p, int64_t b) {
    const struct decode_args local = *(const struct decode_args *)p, *a = &local;
    decode_rows(a, b * BLOCK, min64(b * BLOCK + BLOCK, a->count));
}

#ifdef __SSE2__
/* Whole bytes with non-temporal stores; out aligned to one byte's output (32 bytes for 4-byte
 * elements, 16 for 2-byte ones). */
TARGET_AVX2 static void decode_avx2(void *p, int64_t b) {
    const struct decode_args local = *(const struct decode_args *)p, *a = &local;
    int64_t lo = b * BLOCK, hi = min64(lo + BLOCK, a->count);
    if (!a->streaming) {
        decode_rows(a, lo, hi);
        return;
    }
    int64_t whole = hi / 8 * 8;
    if (a->elsize == 4) {
        const uint32_t(*rows)[8] = a->table;
        for (int64_t i = lo; i < whole; i += 8)
            _mm256_stream_si256((__m256i *)((uint32_t *)a->out + i),
                                _mm256_loadu_si256((const __m256i *)rows[a->bits[i / 8]]));
    } else {
        const uint16_t(*rows)[8] = a->table;
        for (int64_t i = lo; i < whole; i += 8)
            _mm_stream_si128((__m128i *)((uint16_t *)a->out + i), _mm_loadu_si128((const __m128i *)rows[a->bits[i / 8]]));
    }
    _mm_sfence();
    decode_rows(a, whole, hi);
}

/* Elements [i, i + count) (count <= 64, i a multiple of 8) from their bytes: each 16 (4-byte
 * elements) or 32 (2-byte) lanes are a blend of the two patterns under their bits. */
TARGET_AVX512 INLINE void decode64(const struct decode_args *a, int64_t i, int64_t count, int streaming) {
    uint64_t w = 0;
    memcpy(&w, a->bits + i / 8, (size_t)((count + 7) / 8));
    w = msb_first(w);
    if (a->elsize == 4) {
        __m512i plus = _mm512_set1_epi32((int)a->plus), minus = _mm512_set1_epi32((int)a->minus);
        uint32_t *out = (uint32_t *)a->out + i;
        for (int j = 0; j < 4 && 16 * j < count; j++) {
            __m512i v = _mm512_mask_blend_epi32((__mmask16)(w >> 16 * j), minus, plus);
            if (count - 16 * j < 16) _mm512_mask_storeu_epi32(out + 16 * j, first_lanes16(count - 16 * j), v);
            else if (streaming) _mm512_stream_si512((__m512i *)(out + 16 * j), v);
            else _mm512_storeu_si512(out + 16 * j, v);
        }
    } else {
        __m512i plus = _mm512_set1_epi16((short)a->plus), minus = _mm512_set1_epi16((short)a->minus);
        uint16_t *out = (uint16_t *)a->out + i;
        for (int j = 0; j < 2 && 32 * j < count; j++) {
            __m512i v = _mm512_mask_blend_epi16((__mmask32)(w >> 32 * j), minus, plus);
            int64_t left = count - 32 * j;
            if (left < 32) _mm512_mask_storeu_epi16(out + 32 * j, (__mmask32)((1u << left) - 1), v);
            else if (streaming) _mm512_stream_si512((__m512i *)(out + 32 * j), v);
            else _mm512_storeu_si512(out + 32 * j, v);
        }
    }
}

/* Streaming: out is aligned to one byte's output, so the head up to the first 64-byte aligned
 * address is whole bytes, written with plain stores. */
TARGET_AVX512 static void decode_avx512(void *p, int64_t b) {
    const struct decode_args local = *(const struct decode_args *)p, *a = &local;
    int64_t i = b * BLOCK, hi = min64(i + BLOCK, a->count);
    if (a->streaming) {
        int64_t head = min64((int64_t)((64 - (uintptr_t)((char *)a->out + i * a->elsize) % 64) % 64 / a->elsize),
                             hi - i);
        if (head) decode64(a, i, head, 0);
        i += head;
    }
    for (; i + 64 <= hi; i += 64) decode64(a, i, 64, a->streaming);
    if (i < hi) decode64(a, i, hi - i, 0);
    if (a->streaming) _mm_sfence();
}
#endif

static void decode_table(int elsize, uint32_t plus, uint32_t minus, void *table) {
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) {
            uint32_t v = (b >> (7 - k)) & 1 ? plus : minus;
            if (elsize == 4) ((uint32_t *)table)[8 * b + k] = v;
            else ((uint16_t *)table)[8 * b + k] = (uint16_t)v;
        }
}

void cc_decode(const unsigned char *bits, cc_index count, int elsize, unsigned int plus, unsigned int minus,
               void *out) {
    uint32_t table[256][8];
    struct decode_args a = {bits, count, elsize, plus, minus, table, out, 0, cc_features()};
    chunk_fn run = decode_portable;
    int by_table = 1, large = count * elsize >= STREAM_BYTES, row_aligned = (uintptr_t)out % (8 * (uintptr_t)elsize) == 0;
#ifdef __SSE2__
    if (a.features & HAVE_AVX512) {
        run = decode_avx512;
        a.streaming = large && row_aligned;
        by_table = 0;
    } else if (a.features & HAVE_AVX2) {
        run = decode_avx2;
        a.streaming = large && row_aligned;
    }
#else
    (void)large;
    (void)row_aligned;
#endif
    if (by_table) decode_table(elsize, plus, minus, table);
    int64_t chunks = blocks_of(count);
    int threads = threads_for(count, chunks);
    if (threads > 1) run_chunks(run, &a, chunks, threads);
    else
        for (int64_t b = 0; b < chunks; b++) run(&a, b);
}
