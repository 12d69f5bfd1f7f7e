/* The blend schedule of megaformer/data/blend.py (earliest-deadline-first over two heaps), the same
   floating-point keys in the same order as its Python loop, so the same schedule. Built on first
   use by megaformer.kernels.native.build_library (no FMA contraction: -ffp-contract=off). */
#include <stdint.h>
typedef struct { double key; int32_t d; } item;
static int less(item a, item b) { return a.key < b.key || (a.key == b.key && a.d < b.d); }
static void push(item *h, int64_t *n, item x) {
    int64_t i = (*n)++;
    while (i > 0) { int64_t p = (i - 1) / 2; if (!less(x, h[p])) break; h[i] = h[p]; i = p; }
    h[i] = x;
}
static item pop(item *h, int64_t *n) {
    item top = h[0], x = h[--(*n)];
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && less(h[c + 1], h[c])) c++;
        if (!less(h[c], x)) break;
        h[i] = h[c]; i = c;
    }
    h[i] = x;
    return top;
}
static void put(void *a, int size, int64_t i, int64_t v) {
    switch (size) {
        case 1: ((int8_t *)a)[i] = (int8_t)v; break;
        case 2: ((int16_t *)a)[i] = (int16_t)v; break;
        case 4: ((int32_t *)a)[i] = (int32_t)v; break;
        default: ((int64_t *)a)[i] = v;
    }
}
/* Slots i0 .. i0+n-1 of the schedule whose counts before slot i0 are count[] (updated); which and
   offset are signed integers of which_size and offset_size bytes. */
int mf_blend(const double *w, const int32_t *active, int32_t n_active, double delta, int64_t i0,
             int64_t n, int64_t *count, void *which, int which_size, void *offset, int offset_size,
             item *scratch) {
    item *future = scratch, *ready = scratch + n_active;
    int64_t nf = 0, nr = 0;
    for (int32_t j = 0; j < n_active; j++) {
        item x = {((double)count[active[j]] + delta) / w[active[j]], active[j]};
        push(future, &nf, x);
    }
    for (int64_t i = i0; i < i0 + n; i++) {
        double t = (double)(i + 1) + 1e-9;
        while (nf > 0 && future[0].key <= t) {
            item x = pop(future, &nf);
            item y = {((double)(count[x.d] + 1) - delta) / w[x.d], x.d};
            push(ready, &nr, y);
        }
        if (nr == 0) return -1;
        item x = pop(ready, &nr);
        put(which, which_size, i - i0, x.d);
        put(offset, offset_size, i - i0, count[x.d]);
        count[x.d] += 1;
        item y = {((double)count[x.d] + delta) / w[x.d], x.d};
        push(future, &nf, y);
    }
    return 0;
}
