/* The exact order's attention scores on the CPU (native.py builds this file; reference._dot_in_order's loop
 * is the specification): s[r][h][c] = the products q[r][h][d] * k[r][c][d] added one at a time, from zero, in
 * increasing d, in fp32 -- a product rounded, then the sum (-ffp-contract=off: no fused multiply-add, as
 * torch's vectorised addcmul_; for bf16 inputs the products are exact, and both ways agree).
 *
 * The order forbids splitting a sum, so the vectors run across c: each lane holds its own c's sum. For one
 * row r, k[r] is transposed to [D][C] once, and for each head the C sums step through d together. Rows are
 * split over n_threads threads (the caller and n_threads - 1 pthreads).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const float *q, *k;
    float *s;
    int64_t r0, r1, h, c, d;
} Work;

static void rows(const Work *w, float *kt /* [D][C] */) {
    for (int64_t r = w->r0; r < w->r1; r++) {
        const float *kr = w->k + r * w->c * w->d;
        for (int64_t j = 0; j < w->c; j++)
            for (int64_t i = 0; i < w->d; i++) kt[i * w->c + j] = kr[j * w->d + i];
        for (int64_t hh = 0; hh < w->h; hh++) {
            const float *qr = w->q + (r * w->h + hh) * w->d;
            float *acc = w->s + (r * w->h + hh) * w->c;
            for (int64_t j = 0; j < w->c; j++) acc[j] = 0.0f;
            for (int64_t i = 0; i < w->d; i++) {
                const float qi = qr[i];
                const float *ki = kt + i * w->c;
                for (int64_t j = 0; j < w->c; j++) {
                    const float p = qi * ki[j];
                    acc[j] = acc[j] + p;
                }
            }
        }
    }
}

typedef struct {
    Work work;
    float *kt;
} Task;

static void *run(void *arg) {
    rows(&((Task *)arg)->work, ((Task *)arg)->kt);
    return NULL;
}

/* -> 0, or -1 when the transposition buffers cannot be allocated (nothing is computed then). */
int od_scores(const float *q, const float *k, float *s, int64_t r, int64_t h, int64_t c, int64_t d,
              int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > r) n_threads = (int)(r > 0 ? r : 1);
    if (n_threads > 64) n_threads = 64;
    Task task[64];
    pthread_t tid[64];
    int started[64] = {0};
    float *buffers = malloc(sizeof(float) * (size_t)(c * d) * (size_t)n_threads);
    if (!buffers) return -1;
    for (int t = 0; t < n_threads; t++)
        task[t] = (Task){{q, k, s, r * t / n_threads, r * (t + 1) / n_threads, h, c, d}, buffers + t * c * d};
    for (int t = 1; t < n_threads; t++) started[t] = pthread_create(&tid[t], NULL, run, &task[t]) == 0;
    run(&task[0]);
    for (int t = 1; t < n_threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run(&task[t]);                         /* a thread that could not start: its rows here */
    }
    free(buffers);
    return 0;
}
