/* The blend schedule of megaformer/data/blend.py (earliest-deadline-first over two heaps), the same
   floating-point keys in the same order as its Python loop, so the same schedule; and the walk
   that gives an epoch's sample-index rows (megaformer/data/gpt_dataset.py). Built on first use by
   megaformer.kernels.native.build_library (no FMA contraction: -ffp-contract=off). */
#include <stdint.h>
#include <string.h>
#define SCAN_MAX 16 /* up to this many datasets: a scan, not heaps */
#define AHEAD 32    /* random accesses prefetched this many steps ahead */
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
/* The same schedule by a scan over the datasets instead of heaps, for few datasets: dataset d is
   released (its deadline key computed) at the first slot whose t reaches its release key, as when
   the heap pops it; the choice is the least (deadline, d), as the heap's. */
static int blend_scan(const double *w, const int32_t *active, int32_t n_active, double delta,
                      int64_t i0, int64_t n, int64_t *count, void *which, int which_size,
                      void *offset, int offset_size) {
    double rel[SCAN_MAX], dl[SCAN_MAX], wa[SCAN_MAX];
    int64_t cnt[SCAN_MAX];
    int ready[SCAN_MAX];
    for (int32_t j = 0; j < n_active; j++) {
        wa[j] = w[active[j]];
        cnt[j] = count[active[j]];
        rel[j] = ((double)cnt[j] + delta) / wa[j];
        ready[j] = 0;
    }
    for (int64_t i = i0; i < i0 + n; i++) {
        double t = (double)(i + 1) + 1e-9;
        int32_t best = -1;
        for (int32_t j = 0; j < n_active; j++) {
            if (!ready[j] && rel[j] <= t) {
                ready[j] = 1;
                dl[j] = ((double)(cnt[j] + 1) - delta) / wa[j];
            }
            if (ready[j] && (best < 0 || dl[j] < dl[best] ||
                             (dl[j] == dl[best] && active[j] < active[best])))
                best = j;
        }
        if (best < 0) return -1;
        put(which, which_size, i - i0, active[best]);
        put(offset, offset_size, i - i0, cnt[best]);
        cnt[best] += 1;
        ready[best] = 0;
        rel[best] = ((double)cnt[best] + delta) / wa[best];
    }
    for (int32_t j = 0; j < n_active; j++) count[active[j]] = cnt[j];
    return 0;
}

int mf_blend(const double *w, const int32_t *active, int32_t n_active, double delta, int64_t i0,
             int64_t n, int64_t *count, void *which, int which_size, void *offset, int offset_size,
             item *scratch) {
    if (n_active <= SCAN_MAX)
        return blend_scan(w, active, n_active, delta, i0, n, count, which, which_size, offset,
                          offset_size);
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

/* Sample-index rows of one epoch (megaformer/data/gpt_dataset.py): the epoch's documents are
   docs[0..n_docs) (int32 or int64 ids into lengths), state = {p, S} with S the tokens of
   docs[0..p). Row j of n is the (pos_base + p, t - S) of the document holding epoch token
   t = t0 + j * L: the p with S(p) <= t < S(p + 1). Rows are int32 or int64 pairs; the state is
   advanced so that the next call continues. -1 when the tokens run out before the last row. */
static int64_t doc_at(const void *docs, int size, int64_t p) {
    return size == 4 ? (int64_t)((const int32_t *)docs)[p] : ((const int64_t *)docs)[p];
}
int mf_epoch_rows(const unsigned char *lengths, const void *docs, int docs_size, int64_t n_docs,
                  int64_t *state, int64_t t0, int64_t L, int64_t n, int64_t pos_base, void *rows,
                  int rows_size) {
    int64_t p = state[0], S = state[1];
    for (int64_t j = 0; j < n; j++) {
        int64_t t = t0 + j * L;
        for (;;) {
            if (p >= n_docs) return -1;
            if (p + AHEAD < n_docs) /* the lengths are read in a random order: fetch ahead */
                __builtin_prefetch(lengths + 4 * doc_at(docs, docs_size, p + AHEAD));
            int32_t len;
            memcpy(&len, lengths + 4 * doc_at(docs, docs_size, p), 4); /* may be unaligned */
            if (t < S + len) break;
            S += len;
            p++;
        }
        put(rows, rows_size, 2 * j, pos_base + p);
        put(rows, rows_size, 2 * j + 1, t - S);
    }
    state[0] = p;
    state[1] = S;
    return 0;
}

/* numpy's Generator.shuffle of a 1-d array of 4- or 8-byte items, draw for draw: its PCG64 bit
   generator (128-bit LCG, XSL-RR output, the upper half of a 64-bit draw kept for the next 32-bit
   one) and its Fisher-Yates loop (i = n-1 down to 1, j = random_interval(i) by masked rejection,
   swap items i and j), so the same permutation. The draws do not depend on the data, so they are
   made AHEAD slots early and the items they will swap prefetched: the swaps, random accesses over
   the whole array, no longer wait on memory one at a time. st = {state high, state low, increment
   high, increment low, has_uint32, uinteger} as numpy's bit_generator.state gives them. */
typedef unsigned __int128 u128;
typedef struct { u128 state, inc; int has32; uint32_t u32; } pcg64;
static inline uint64_t pcg64_next64(pcg64 *r) {
    const u128 mult = ((u128)2549297995355413924ULL << 64) | (u128)4865540595714422341ULL;
    r->state = r->state * mult + r->inc;
    uint64_t hi = (uint64_t)(r->state >> 64), x = hi ^ (uint64_t)r->state;
    unsigned rot = (unsigned)(hi >> 58);
    return (x >> rot) | (x << ((64 - rot) & 63));
}
static inline uint32_t pcg64_next32(pcg64 *r) {
    if (r->has32) { r->has32 = 0; return r->u32; }
    uint64_t v = pcg64_next64(r);
    r->has32 = 1;
    r->u32 = (uint32_t)(v >> 32);
    return (uint32_t)v;
}
static inline uint64_t random_interval(pcg64 *r, uint64_t max) {
    uint64_t mask = max, v;
    if (max == 0) return 0;
    mask |= mask >> 1; mask |= mask >> 2; mask |= mask >> 4;
    mask |= mask >> 8; mask |= mask >> 16; mask |= mask >> 32;
    if (max <= 0xffffffffULL) {
        while ((v = (pcg64_next32(r) & mask)) > max) {}
    } else {
        while ((v = (pcg64_next64(r) & mask)) > max) {}
    }
    return v;
}
void mf_shuffle(const uint64_t *st, void *data, int size, int64_t n) {
    pcg64 r = {((u128)st[0] << 64) | st[1], ((u128)st[2] << 64) | st[3], (int)st[4], (uint32_t)st[5]};
    int64_t js[AHEAD];
    char *d = (char *)data;
    for (int64_t k = 0; k < AHEAD && n - 1 - k >= 1; k++) {
        js[k] = (int64_t)random_interval(&r, (uint64_t)(n - 1 - k));
        __builtin_prefetch(d + js[k] * size, 1);
    }
    for (int64_t i = n - 1, slot = 0; i >= 1; i--, slot = (slot + 1) % AHEAD) {
        int64_t j = js[slot];
        if (i - AHEAD >= 1) {
            js[slot] = (int64_t)random_interval(&r, (uint64_t)(i - AHEAD));
            __builtin_prefetch(d + js[slot] * size, 1);
        }
        if (size == 4) {
            int32_t *a = (int32_t *)data, t = a[i];
            a[i] = a[j]; a[j] = t;
        } else {
            int64_t *a = (int64_t *)data, t = a[i];
            a[i] = a[j]; a[j] = t;
        }
    }
}
