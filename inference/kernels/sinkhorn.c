/* The fast order's Sinkhorn normalisation on the CPU (native.py builds this file; fast.sinkhorn's loop is the
 * specification): comb [n][hc][hc], each row already softmaxed, + eps, then a column pass and iters - 1 (row,
 * column) passes, each dividing every value by its row's (column's) sum plus eps. A sum runs from zero over
 * the hc values in increasing index, then adds eps: the order of torch's sum over the [hc + 1] frame whose
 * last entry holds eps (fast.sinkhorn), so that the numbers are that loop's, bit for bit. In place, one token
 * after the other: a decode step's few tokens take microseconds where the torch loop's 80 operations took
 * half a millisecond.
 */
#include <stdint.h>

#define MAX_HC 16

void hc_sinkhorn(float *comb, int64_t n, int hc, int iters, float eps) {
    for (int64_t t = 0; t < n; t++) {
        float *c = comb + t * hc * hc;
        float sums[MAX_HC];
        for (int i = 0; i < hc * hc; i++) c[i] += eps;
        for (int pass = 0; pass < 2 * iters - 1; pass++) {
            const int rows = pass % 2 == 1; /* the column pass first, then row and column in turn */
            for (int a = 0; a < hc; a++) {
                float s = 0.0f;
                for (int b = 0; b < hc; b++) s += rows ? c[a * hc + b] : c[b * hc + a];
                sums[a] = s + eps;
            }
            for (int a = 0; a < hc; a++)
                for (int b = 0; b < hc; b++) c[a * hc + b] /= rows ? sums[a] : sums[b];
        }
    }
}
