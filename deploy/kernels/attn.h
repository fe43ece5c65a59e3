/* Attention's two products, K·q and V·p, summed in float64 in one fixed order.
 *
 * What they compute is common/models/qwen2.py's numpy attention (_scores, _weighted_values), on
 * a float32 or an f16 KV cache:
 * llama.cpp's CPU path with flash attention off reads an f16 KV cache and rounds q and the
 * softmax's probabilities to f16, so every product here is of numbers a float32 holds exactly,
 * and their product is exact in float64 (24 + 24 significant bits <= 53). The sums are float64;
 * a score is rounded once to float32, a weighted value is left in float64 for the caller.
 *
 * The order is fixed here, and every ISA's kernel (attn_avx2.h) sums in it, so the bits depend
 * on no ISA, thread count or batch:
 *   a score    hd split into 8 lanes, lane i = the terms d = i (mod 8) added
 *              in order of d, then ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7));
 *   a value    out[d] += w_s * v[s][d] for s = 0, 1, ... in order, w_s = f16(p[s]).
 * An FMA of an exact product rounds as the reference's multiply and then add does (built with
 * -ffp-contract=off, the reference never fuses).
 *
 * numpy's float64 matmul (BLAS) sums in another order, so its float32 score can differ in the
 * last bit where the float64 sum's rounding error straddles a float32 rounding boundary. Where
 * every float64 sum is exact, no order matters, and tests/unit/test_attention.py checks both give
 * the same bits there; on the real models the llama.cpp oracle's tables came out identical. */
#ifndef KNOT_ATTN_H
#define KNOT_ATTN_H

#include <stddef.h>

#include "quants.h"

/* attn_scores_fn, attn_values_fn (quants.h, in the ISA table) say what the kernels compute. */
#define ATTN_MAX_HD 256  /* head dims the kernels take: a multiple of ATTN_HD_ALIGN, at most this */
#define ATTN_HD_ALIGN 16

static inline double attn_dot_ref(const float *q, kv_ptr k, int hd) {
    double l[8] = {0};
    for (int d = 0; d < hd; d += 8)
        for (int i = 0; i < 8; i++) l[i] += (double)q[d + i] * (double)kv_get(k, d + i);
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static void attn_scores_ref(const float *q, int R, kv_ptr k, size_t ks, int S, int hd,
                            float *out, size_t os) {
    for (int r = 0; r < R; r++)
        for (int s = 0; s < S; s++)
            out[(size_t)r * os + s] = (float)attn_dot_ref(q + (size_t)r * hd, kv_add(k, (size_t)s * ks), hd);
}

static void attn_values_ref(const float *p, size_t ps, int R, kv_ptr v, size_t vs, int S,
                            int hd, double *out) {
    for (int r = 0; r < R; r++) {
        double *o = out + (size_t)r * hd;
        for (int s = 0; s < S; s++) {
            const double w = round_f16(p[(size_t)r * ps + s]);
            const kv_ptr vr = kv_add(v, (size_t)s * vs);
            for (int d = 0; d < hd; d++) o[d] += w * (double)kv_get(vr, d);
        }
    }
}

#endif
