// How far apart the machine's first two cores are: the shortest round trip of one cache line between a
// thread on each (ns), the minimum over 400 batches of 64 round trips, so that load elsewhere does not show.
// On the 2-vCPU test VM: ~50 ns while the host runs both vCPUs on one die, ~270-400 ns while on two
// (bench/shm_stores.py builds and runs it beside each sample). With ``copies`` it also prints, for a 4 MB
// buffer, the GB/s of core 1 copying out what core 0 just wrote (read_other), of core 0 rewriting what
// core 1 just read (rewrite_other), of a copy within one core's memory (own_copy), and the rate of eight
// independent multiply-adds per core with the other core doing the same, over its rate alone (fma_both:
// ~1 for two physical cores, ~0.5 for two threads of one).
//     cc -O2 -pthread bench/core_distance.c -o /tmp/core_distance && /tmp/core_distance [copies]
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { BATCH = 64, BATCHES = 400 };
static _Alignas(64) _Atomic long line;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void* answer(void* unused) {  // on core 1: turn every odd value into the next even one
    (void)unused;
    pin(1);
    for (long i = 0; i < (long)BATCH * BATCHES; i++) {
        while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 1) {
        }
        atomic_store_explicit(&line, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

enum { BUF = 4 << 20, ROUNDS = 20 };
static char *shared_buf, *out_buf;
static _Alignas(64) _Atomic long turn;
static volatile double sink;

static void* copy_out(void* unused) {  // on core 1: copy the buffer out each time core 0 has written it
    (void)unused;
    pin(1);
    for (long i = 0; i < ROUNDS; i++) {
        while (atomic_load_explicit(&turn, memory_order_acquire) != 2 * i + 1) {
        }
        memcpy(out_buf, shared_buf, BUF);
        atomic_store_explicit(&turn, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

static double fma_rate(void) {  // millions of multiply-adds per second, eight independent chains
    double x[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    const long n = 20000000;
    const double start = now();
    for (long i = 0; i < n; i++)
        for (int k = 0; k < 8; k++) x[k] = x[k] * 1.0000001 + 1e-9;
    sink = x[0] + x[7];
    return 8.0 * n / (now() - start) / 1e6;
}

static double fma_both_rate[2];
static _Atomic int ready;
static void* fma_thread(void* arg) {
    const long cpu = (long)arg;
    pin((int)cpu);
    atomic_fetch_add(&ready, 1);
    while (atomic_load(&ready) < 2) {
    }
    fma_both_rate[cpu] = fma_rate();
    return NULL;
}

static void copies(void) {
    pthread_t peer;
    shared_buf = aligned_alloc(4096, BUF);
    out_buf = aligned_alloc(4096, BUF);
    memset(shared_buf, 0, BUF);
    memset(out_buf, 0, BUF);
    pthread_create(&peer, NULL, copy_out, NULL);
    double rewrite = 0, read = 0;
    for (long i = 0; i < ROUNDS; i++) {
        const double t0 = now();
        memset(shared_buf, (int)i, BUF);  // lines core 1 read last round
        const double t1 = now();
        atomic_store_explicit(&turn, 2 * i + 1, memory_order_release);
        while (atomic_load_explicit(&turn, memory_order_acquire) != 2 * i + 2) {
        }
        if (i >= 4) rewrite += t1 - t0, read += now() - t1;
    }
    pthread_join(peer, NULL);
    const double start = now();
    for (int i = 0; i < 16; i++) memcpy(out_buf, shared_buf, BUF);
    const double own = 16.0 * BUF / (now() - start) / 1e9;
    const double alone = fma_rate();
    pthread_t a, b;
    pthread_create(&a, NULL, fma_thread, (void*)0L);
    pthread_create(&b, NULL, fma_thread, (void*)1L);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    printf("read_other %.1f GB/s rewrite_other %.1f GB/s own_copy %.1f GB/s fma_both %.2f\n",
           (ROUNDS - 4.0) * BUF / read / 1e9, (ROUNDS - 4.0) * BUF / rewrite / 1e9, own,
           (fma_both_rate[0] + fma_both_rate[1]) / 2 / alone);
}

int main(int argc, char** argv) {
    pthread_t peer;
    pin(0);
    pthread_create(&peer, NULL, answer, NULL);
    double best = 1e9;
    for (long b = 0, i = 0; b < BATCHES; b++) {
        const double start = now();
        for (int k = 0; k < BATCH; k++, i++) {
            atomic_store_explicit(&line, 2 * i + 1, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 2) {
            }
        }
        const double each = (now() - start) / BATCH * 1e9;
        if (each < best) best = each;
    }
    pthread_join(peer, NULL);
    printf("%.0f\n", best);
    if (argc > 1 && strcmp(argv[1], "copies") == 0) copies();
    return 0;
}
