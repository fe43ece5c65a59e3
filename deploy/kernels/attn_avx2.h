/* attn.h's two products on AVX2 (4 doubles a vector) or AVX-512F (8), in attn.h's order, bit for
 * bit. Included by quants_avx2.h, so compiled once per target (simd_avx2.c, simd_avx512.c). */
#ifndef KNOT_ATTN_AVX2_H
#define KNOT_ATTN_AVX2_H

#include "attn.h"

#if HAVE_AVX2

/* 4 keys' or values' elements from i on, as doubles */
static inline __m256d kv_load4_pd(kv_ptr a, size_t i) {
    return a.f16 ? _mm256_cvtps_pd(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)a.p + i))))
                 : _mm256_cvtps_pd(_mm_loadu_ps((const float *)a.p + i));
}

/* n (a multiple of 4; of 8 on AVX-512) keys' or values' elements from i on, as doubles, into dst. On
 * AVX-512 a 64-byte store for each 64-byte load that reads it back. Why: a 64-byte load of two
 * 32-byte stores cannot take its data from the store buffer and waits for both stores to reach L1
 * (benchmarks/kernel_ab.py). */
static inline void kv_to_pd(kv_ptr a, size_t i, int n, double *dst) {
#if defined(__AVX512F__)
    for (int d = 0; d < n; d += 8)
        _mm512_store_pd(dst + d, a.f16 ? _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)a.p + i + d))))
                                       : _mm512_cvtps_pd(_mm256_loadu_ps((const float *)a.p + i + d)));
#else
    for (int d = 0; d < n; d += 4) _mm256_store_pd(dst + d, kv_load4_pd(a, i + d));
#endif
}

#define ATTN_QROWS 16  /* query rows converted to double at a time, reused over every key */

#if defined(__AVX512F__)
/* 8 keys of one query row: acc[j] holds key j's 8 lanes; -> the 8 sums, in attn.h's tree */
static inline __m256 attn_reduce8(const __m512d acc[8]) {
    __m512d t[4], u[2];
    for (int j = 0; j < 4; j++) {  /* l_i + l_{i+4}: [A0+A4 .. A3+A7 | B0+B4 .. B3+B7] */
        const __m512d a = acc[2 * j], b = acc[2 * j + 1];
        t[j] = _mm512_add_pd(_mm512_shuffle_f64x2(a, b, 0x44), _mm512_shuffle_f64x2(a, b, 0xEE));
    }
    for (int j = 0; j < 2; j++)    /* + the pair 2 apart: [A(0+2) A(1+3) | B.. | C.. | D..] */
        u[j] = _mm512_add_pd(_mm512_shuffle_f64x2(t[2 * j], t[2 * j + 1], 0x88),
                             _mm512_shuffle_f64x2(t[2 * j], t[2 * j + 1], 0xDD));
    /* + the neighbour: [A E B F C G D H] -> keys 0..7 */
    const __m512d s = _mm512_add_pd(_mm512_unpacklo_pd(u[0], u[1]), _mm512_unpackhi_pd(u[0], u[1]));
    const __m512d ordered = _mm512_permutexvar_pd(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), s);
    return _mm512_cvtpd_ps(ordered);
}
#define ATTN_KEYS 8
#else
/* 4 keys of one query row: lo[j], hi[j] hold key j's lanes 0-3 and 4-7 -> the 4 sums */
static inline __m128 attn_reduce4(const __m256d lo[4], const __m256d hi[4]) {
    __m256d t[4];
    for (int j = 0; j < 4; j++) t[j] = _mm256_add_pd(lo[j], hi[j]);    /* l_i + l_{i+4} */
    const __m256d u01 = _mm256_add_pd(_mm256_permute2f128_pd(t[0], t[1], 0x20), _mm256_permute2f128_pd(t[0], t[1], 0x31));
    const __m256d u23 = _mm256_add_pd(_mm256_permute2f128_pd(t[2], t[3], 0x20), _mm256_permute2f128_pd(t[2], t[3], 0x31));
    const __m256d s = _mm256_hadd_pd(u01, u23);                          /* keys [0 2 1 3] */
    return _mm256_cvtpd_ps(_mm256_permute4x64_pd(s, 0xD8));
}
#define ATTN_KEYS 4
#endif

static void attn_scores_simd(const float *q, int R, kv_ptr k, size_t ks, int S, int hd,
                             float *out, size_t os) {
    double qd[ATTN_QROWS * ATTN_MAX_HD] __attribute__((aligned(64)));   /* rows of q in double */
    double kd[ATTN_KEYS * ATTN_MAX_HD] __attribute__((aligned(64)));    /* a block of keys in double */
    const int S_blk = S - S % ATTN_KEYS;
    for (int r0 = 0; r0 < R; r0 += ATTN_QROWS) {
        const int nr = R - r0 < ATTN_QROWS ? R - r0 : ATTN_QROWS;
        kv_to_pd((kv_ptr){q + (size_t)r0 * hd, 0}, 0, nr * hd, qd);
        for (int s = 0; s < S_blk; s += ATTN_KEYS) {
            for (int j = 0; j < ATTN_KEYS; j++) kv_to_pd(k, (size_t)(s + j) * ks, hd, kd + j * hd);
            int r = 0;
#if defined(__AVX512F__)
            /* two rows a pass: each key's 8 lanes loaded once for both (16 accumulators, 8 keys, 2 rows
             * of q: 26 of the 32 registers); each row's sums as the one-row loop's */
            for (; r + 2 <= nr; r += 2) {
                const double *q0 = qd + r * hd, *q1 = q0 + hd;
                __m512d a0[8], a1[8];
                for (int j = 0; j < 8; j++) a0[j] = a1[j] = _mm512_setzero_pd();
                for (int d = 0; d < hd; d += 8) {
                    const __m512d qv0 = _mm512_load_pd(q0 + d), qv1 = _mm512_load_pd(q1 + d);
                    for (int j = 0; j < 8; j++) {
                        const __m512d kv = _mm512_load_pd(kd + j * hd + d);
                        a0[j] = _mm512_fmadd_pd(qv0, kv, a0[j]);
                        a1[j] = _mm512_fmadd_pd(qv1, kv, a1[j]);
                    }
                }
                _mm256_storeu_ps(out + (size_t)(r0 + r) * os + s, attn_reduce8(a0));
                _mm256_storeu_ps(out + (size_t)(r0 + r + 1) * os + s, attn_reduce8(a1));
            }
#endif
            for (; r < nr; r++) {
                const double *qr = qd + r * hd;
                float *o = out + (size_t)(r0 + r) * os + s;
#if defined(__AVX512F__)
                __m512d acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_pd();
                for (int d = 0; d < hd; d += 8) {
                    const __m512d qv = _mm512_load_pd(qr + d);
                    for (int j = 0; j < 8; j++) acc[j] = _mm512_fmadd_pd(qv, _mm512_load_pd(kd + j * hd + d), acc[j]);
                }
                _mm256_storeu_ps(o, attn_reduce8(acc));
#else
                __m256d lo[4], hi[4];
                for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_pd();
                for (int d = 0; d < hd; d += 8) {
                    const __m256d ql = _mm256_load_pd(qr + d), qh = _mm256_load_pd(qr + d + 4);
                    for (int j = 0; j < 4; j++) {
                        lo[j] = _mm256_fmadd_pd(ql, _mm256_load_pd(kd + j * hd + d), lo[j]);
                        hi[j] = _mm256_fmadd_pd(qh, _mm256_load_pd(kd + j * hd + d + 4), hi[j]);
                    }
                }
                _mm_storeu_ps(o, attn_reduce4(lo, hi));
#endif
            }
        }
        /* the last S % ATTN_KEYS keys: the reference's sums are the same numbers */
        attn_scores_ref(q + (size_t)r0 * hd, nr, kv_add(k, (size_t)S_blk * ks), ks, S - S_blk, hd,
                        out + (size_t)r0 * os + S_blk, os);
    }
}

/* f16(p[0..n)) as doubles into w */
static inline void attn_round_weights(const float *p, int n, double *w) {
    float tail[8] = {0};
    for (int s = 0; s < n; s += 8) {
        const float *src = p + s;
        if (n - s < 8) {
            for (int j = 0; j < n - s; j++) tail[j] = p[s + j];
            src = tail;
        }
        const __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
        double d[8];
        _mm256_storeu_pd(d, _mm256_cvtps_pd(_mm256_castps256_ps128(r)));
        _mm256_storeu_pd(d + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1)));
        for (int j = 0; j < 8 && s + j < n; j++) w[s + j] = d[j];
    }
}

#define ATTN_VKEYS 32  /* keys per block of values converted to double, reused by every row */
#if defined(__AVX512F__)
typedef __m512d vd_t;
#define VD_W 8
#define vd_load _mm512_load_pd
#define vd_loadu _mm512_loadu_pd
#define vd_storeu _mm512_storeu_pd
#define vd_set1 _mm512_set1_pd
#define vd_fmadd _mm512_fmadd_pd
#else
typedef __m256d vd_t;
#define VD_W 4
#define vd_load _mm256_load_pd
#define vd_loadu _mm256_loadu_pd
#define vd_storeu _mm256_storeu_pd
#define vd_set1 _mm256_set1_pd
#define vd_fmadd _mm256_fmadd_pd
#endif
#define ATTN_VDIMS (4 * VD_W)  /* dims of a pass: 4 vectors per row */

/* NR rows (a constant at each call) of out += w (NR, nk) @ vd (nk, hd), every out element summed
 * over the block's keys in order */
static inline __attribute__((always_inline)) void attn_values_rows(const int NR, const double *w, const double *vd,
                                                                   int nk, int hd, double *out) {
    for (int d0 = 0; d0 < hd; d0 += ATTN_VDIMS) {
        vd_t acc[4][4];
        for (int i = 0; i < NR; i++)
            for (int c = 0; c < 4; c++) acc[i][c] = vd_loadu(out + (size_t)i * hd + d0 + VD_W * c);
        for (int j = 0; j < nk; j++) {
            const double *vj = vd + (size_t)j * hd + d0;
            for (int i = 0; i < NR; i++) {
                const vd_t b = vd_set1(w[i * ATTN_VKEYS + j]);
                for (int c = 0; c < 4; c++) acc[i][c] = vd_fmadd(b, vd_load(vj + VD_W * c), acc[i][c]);
            }
        }
        for (int i = 0; i < NR; i++)
            for (int c = 0; c < 4; c++) vd_storeu(out + (size_t)i * hd + d0 + VD_W * c, acc[i][c]);
    }
}

/* out (R, hd) f64 += f16(p) (R, S) @ v (S, hd): a block of ATTN_VKEYS values is converted to
 * double once, then every row, 4, 2 or 1 at a time, adds its keys in order. hd: a multiple of
 * ATTN_VDIMS (16 on AVX2; on AVX-512, 32, else the AVX2-width loop below). */
static void attn_values_simd(const float *p, size_t ps, int R, kv_ptr v, size_t vs, int S,
                             int hd, double *out) {
    if (hd % ATTN_VDIMS) {  /* AVX-512 with hd = 16 (x 16 odd): the reference's numbers */
        attn_values_ref(p, ps, R, v, vs, S, hd, out);
        return;
    }
    double vd[ATTN_VKEYS * ATTN_MAX_HD] __attribute__((aligned(64)));
    double w[4 * ATTN_VKEYS];
    for (int s0 = 0; s0 < S; s0 += ATTN_VKEYS) {
        const int nk = S - s0 < ATTN_VKEYS ? S - s0 : ATTN_VKEYS;
        for (int j = 0; j < nk; j++) kv_to_pd(v, (size_t)(s0 + j) * vs, hd, vd + (size_t)j * hd);
        int r = 0;
        for (; r + 4 <= R; r += 4) {
            for (int i = 0; i < 4; i++) attn_round_weights(p + (size_t)(r + i) * ps + s0, nk, w + i * ATTN_VKEYS);
            attn_values_rows(4, w, vd, nk, hd, out + (size_t)r * hd);
        }
        if (r + 2 <= R) {
            for (int i = 0; i < 2; i++) attn_round_weights(p + (size_t)(r + i) * ps + s0, nk, w + i * ATTN_VKEYS);
            attn_values_rows(2, w, vd, nk, hd, out + (size_t)r * hd);
            r += 2;
        }
        if (r < R) {
            attn_round_weights(p + (size_t)r * ps + s0, nk, w);
            attn_values_rows(1, w, vd, nk, hd, out + (size_t)r * hd);
        }
    }
}

#endif /* HAVE_AVX2 */
#endif
