/* Float32 products of a few rows by a weight matrix, for decoding on Linux x86_64.
 *
 * mlx_ssp/_small_gemm.py builds this file into a shared library and loads it ahead of OpenBLAS, so
 * that MLX's calls to cblas_sgemm come here first. Products C = alpha * A B^T + beta * C with at most
 * MAX_ROWS rows in A (row-major, A not transposed, B transposed: a Linear layer applied to a few
 * decoding rows) are done by the kernel below; every other call goes on to OpenBLAS unchanged.
 *
 * Why: OpenBLAS packs B into a buffer for every product, which for 1-8 rows costs more than the
 * product itself (OpenBLAS reads the demo model's weights at 7-13 GB/s on the 2-core machine we
 * measure on; this kernel at 14-16 GB/s on one thread, 20-29 GB/s on two). It reads each row of B
 * once, straight from memory, for up to 4 rows of A; rows 5-8 read the same chunk of B again, from cache.
 *
 * The order of the arithmetic is fixed, so every output is the same bit for bit on any x86_64 CPU
 * with AVX2 and FMA, whatever the thread count and whatever other rows share the product:
 *   lane j (j = 0..7) accumulates a[k] * b[k] for k = j, j + 8, ... below K8 = K - K % 8, in
 *   increasing k, with a fused multiply-add, starting from 0;
 *   the lanes are summed as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7));
 *   the remaining k >= K8 are added in increasing k with fmaf;
 *   then c = alpha * dot (beta == 0: C is not read), else c = (alpha * dot) + (beta * c), each
 *   operation rounded on its own (built with -ffp-contract=off).
 * Each output depends only on its row of A and its row of B: a row decoded alone or beside up to 7
 * others gets the same result.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <immintrin.h>

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define MAX_ROWS 8          /* rows of A the kernel takes; more go to OpenBLAS */
#define CHUNK 32            /* rows of B a thread claims at a time */
#define SPLIT_MIN (1 << 17) /* products of fewer elements of B stay on the calling thread */
#define SPIN_NS 50000L      /* how long the helper thread waits for the next product before sleeping */

static sgemm_fn real_sgemm;
static atomic_int enabled;
static atomic_long kernel_calls;
static int simd_ok;
static atomic_int n_threads = 1;

/* ------------------------------------------------------------------ the kernel */

__attribute__((target("avx2,fma"))) static inline float lanes_sum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l_j + l_{j+4} */
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));                                        /* (0+4)+(2+6), (1+5)+(3+7) */
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

__attribute__((target("avx2,fma"))) static inline void store(const float *a, const float *b, int K, int K8,
                                                              __m256 acc, float alpha, float beta, float *c) {
    float s = lanes_sum(acc);
    for (int k = K8; k < K; k++) s = fmaf(a[k], b[k], s);
    float v = alpha * s;
    if (beta != 0.0f) v += beta * *c;
    *c = v;
}

/* Rows n0..n1 of B against M rows of A (M and R, the rows of B read together, are constants after
 * inlining, so the accumulators stay in registers). */
#define DEFINE_ROWS(M, R)                                                                              \
    __attribute__((target("avx2,fma"))) static void rows##M(long n0, long n1, int K, float alpha,      \
                                                            const float *A, int lda, const float *B,   \
                                                            int ldb, float beta, float *C, int ldc) {  \
        const int K8 = K & ~7;                                                                         \
        long n = n0;                                                                                   \
        for (; n + R <= n1; n += R) {                                                                  \
            __m256 acc[R][M];                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                        \
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();   \
            const float *b = B + (size_t)n * ldb;                                                      \
            for (int k = 0; k < K8; k += 8) {                                                          \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
                    __m256 w = _mm256_loadu_ps(b + (size_t)r * ldb + k);                               \
                    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                \
                        acc[r][m] = _mm256_fmadd_ps(_mm256_loadu_ps(A + (size_t)m * lda + k), w,       \
                                                    acc[r][m]);                                        \
                }                                                                                      \
            }                                                                                          \
            for (int r = 0; r < R; r++)                                                                \
                for (int m = 0; m < M; m++)                                                            \
                    store(A + (size_t)m * lda, b + (size_t)r * ldb, K, K8, acc[r][m], alpha, beta,      \
                          C + (size_t)m * ldc + n + r);                                                \
        }                                                                                              \
        for (; n < n1; n++) {                                                                          \
            __m256 acc[M];                                                                             \
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();          \
            const float *b = B + (size_t)n * ldb;                                                      \
            for (int k = 0; k < K8; k += 8) {                                                          \
                __m256 w = _mm256_loadu_ps(b + k);                                                     \
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)                                    \
                    acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(A + (size_t)m * lda + k), w, acc[m]);     \
            }                                                                                          \
            for (int m = 0; m < M; m++)                                                                \
                store(A + (size_t)m * lda, b, K, K8, acc[m], alpha, beta, C + (size_t)m * ldc + n);    \
        }                                                                                              \
    }

/* rows of B read together, chosen by measurement (the fewer rows of A, the more rows of B) */
DEFINE_ROWS(1, 8)
DEFINE_ROWS(2, 4)
DEFINE_ROWS(3, 2)
DEFINE_ROWS(4, 1)

typedef struct {
    int M, K, lda, ldb, ldc;
    unsigned int csr; /* the caller's floating-point mode (flush-to-zero etc.), for the helper */
    long N;
    float alpha, beta;
    const float *A, *B;
    float *C;
} job_t;

static void run_rows(const job_t *j, long n0, long n1) {
    for (int m0 = 0; m0 < j->M; m0 += 4) {
        int mm = j->M - m0 < 4 ? j->M - m0 : 4;
        const float *a = j->A + (size_t)m0 * j->lda;
        float *c = j->C + (size_t)m0 * j->ldc;
        switch (mm) {
            case 1: rows1(n0, n1, j->K, j->alpha, a, j->lda, j->B, j->ldb, j->beta, c, j->ldc); break;
            case 2: rows2(n0, n1, j->K, j->alpha, a, j->lda, j->B, j->ldb, j->beta, c, j->ldc); break;
            case 3: rows3(n0, n1, j->K, j->alpha, a, j->lda, j->B, j->ldb, j->beta, c, j->ldc); break;
            default: rows4(n0, n1, j->K, j->alpha, a, j->lda, j->B, j->ldb, j->beta, c, j->ldc); break;
        }
    }
}

/* ------------------------------------------------------------------ one helper thread */
/* The calling thread and the helper claim chunks of B's rows from one counter, so a helper that is
 * not scheduled (a busy machine) costs at most the chunk it holds. Which thread does a chunk does
 * not change its results. */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int helper_started;
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one split product at a time */
static job_t job;
static atomic_long job_id;      /* odd while a product is open to the helper */
static atomic_long next_chunk;  /* (id << 24) | next chunk index of the open product */
static atomic_long chunks_done;
static atomic_long n_chunks;

static long claim(long id) {
    long cur = atomic_load(&next_chunk);
    for (;;) {
        if ((cur >> 24) != id || (cur & 0xffffff) >= n_chunks) return -1;
        if (atomic_compare_exchange_weak(&next_chunk, &cur, cur + 1)) return cur & 0xffffff;
    }
}

static void work(const job_t *j, long id) {
    long c;
    if (_mm_getcsr() != j->csr) _mm_setcsr(j->csr); /* subnormals as the caller has them */
    while ((c = claim(id)) >= 0) {
        long n0 = c * CHUNK, n1 = n0 + CHUNK < j->N ? n0 + CHUNK : j->N;
        run_rows(j, n0, n1);
        atomic_fetch_add(&chunks_done, 1);
    }
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *helper(void *arg) {
    (void)arg;
    long seen = 0;
    for (;;) {
        long id = atomic_load(&job_id);
        if (id == seen || !(id & 1)) {
            long until = now_ns() + SPIN_NS;
            while ((id = atomic_load(&job_id)) == seen || !(id & 1)) {
                if (now_ns() > until) {
                    pthread_mutex_lock(&mu);
                    while ((id = atomic_load(&job_id)) == seen || !(id & 1)) pthread_cond_wait(&wake, &mu);
                    pthread_mutex_unlock(&mu);
                    break;
                }
                _mm_pause();
            }
        }
        seen = id;
        pthread_mutex_lock(&mu);
        job_t j = job;
        long open = atomic_load(&job_id);
        pthread_mutex_unlock(&mu);
        if (open == id) work(&j, id);
    }
    return NULL;
}

static void after_fork_child(void) {
    /* the helper thread does not exist in a forked child: start a new one when needed */
    pthread_mutex_init(&mu, NULL);
    pthread_mutex_init(&call_mu, NULL);
    pthread_cond_init(&wake, NULL);
    helper_started = 0;
    atomic_store(&job_id, (atomic_load(&job_id) | 1) + 1);
}

static int start_helper(void) {
    if (helper_started) return 1;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&t, &attr, helper, NULL) == 0;
    pthread_attr_destroy(&attr);
    helper_started = ok;
    return ok;
}

static void split(const job_t *j) {
    pthread_mutex_lock(&call_mu);
    if (!start_helper()) {
        pthread_mutex_unlock(&call_mu);
        run_rows(j, 0, j->N);
        return;
    }
    pthread_mutex_lock(&mu);
    job = *j;
    n_chunks = (j->N + CHUNK - 1) / CHUNK;
    long id = atomic_load(&job_id) + 1; /* odd: open */
    atomic_store(&chunks_done, 0);
    atomic_store(&next_chunk, id << 24);
    atomic_store(&job_id, id);
    pthread_cond_signal(&wake);
    pthread_mutex_unlock(&mu);
    work(j, id);
    for (long spins = 0; atomic_load(&chunks_done) < n_chunks; spins++) {
        if (spins < 4096) _mm_pause();
        else sched_yield(); /* the helper holds a chunk but is not running (a busy machine) */
    }
    atomic_store(&job_id, id + 1); /* closed */
    pthread_mutex_unlock(&call_mu);
}

/* ------------------------------------------------------------------ the entry points */

void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (simd_ok && atomic_load(&enabled) && order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && M >= 1 &&
        M <= MAX_ROWS && N >= 1 && K >= 8 && lda >= K && ldb >= K && ldc >= N && alpha != 0.0f) {
        job_t j = {M, K, lda, ldb, ldc, _mm_getcsr(), N, alpha, beta, A, B, C};
        atomic_fetch_add(&kernel_calls, 1);
        if (n_threads > 1 && (long)N * K >= SPLIT_MIN && N >= 2 * CHUNK && N < (1L << 29))
            split(&j);
        else
            run_rows(&j, 0, N);
        return;
    }
    if (!real_sgemm) { /* init never ran: a load order mlx_ssp does not make */
        fprintf(stderr, "mlx_ssp small_gemm: cblas_sgemm called before initialisation\n");
        abort();
    }
    real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static int clamp_threads(int threads) { return threads < 1 ? 1 : (threads > 2 ? 2 : threads); }

/* Called once from Python before MLX is imported: the real sgemm to forward to. Returns whether
 * the kernel can run on this CPU. */
int mlx_ssp_small_gemm_init(sgemm_fn real, int threads) {
    real_sgemm = real;
    simd_ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    atomic_store(&n_threads, clamp_threads(threads));
    pthread_atfork(NULL, NULL, after_fork_child);
    atomic_store(&enabled, simd_ok);
    return simd_ok;
}

/* Turns the kernel on (1) or off (0: every product goes to OpenBLAS); returns the previous state. */
int mlx_ssp_small_gemm_enable(int on) { return atomic_exchange(&enabled, on && simd_ok); }

int mlx_ssp_small_gemm_enabled(void) { return atomic_load(&enabled); }

int mlx_ssp_small_gemm_threads(int threads) {
    return atomic_exchange(&n_threads, clamp_threads(threads));
}

long mlx_ssp_small_gemm_calls(void) { return atomic_load(&kernel_calls); }

/* Whether the process's cblas_sgemm (what MLX resolves) is this one; where not, the path of the
 * library that provides it is written to `who` (an LD_PRELOAD of another BLAS, say). */
int mlx_ssp_small_gemm_first(char *who, int size) {
    void *found = dlsym(RTLD_DEFAULT, "cblas_sgemm");
    Dl_info info, self;
    /* compare libraries, not addresses: inside this -fPIC library, &cblas_sgemm is itself interposable */
    if (found && dladdr(found, &info) && dladdr((void *)run_rows, &self) && info.dli_fbase == self.dli_fbase)
        return 1;
    snprintf(who, size, "%s", found && dladdr(found, &info) && info.dli_fname ? info.dli_fname : "?");
    return 0;
}
