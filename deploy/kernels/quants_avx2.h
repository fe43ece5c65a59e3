/* AVX2 kernels (with AVX-512 VNNI where compiled for it): the same numbers as the reference dot
 * products of quants.h, bit for bit, computed on 32-byte vectors.
 *
 * Included by simd_avx2.c and simd_avx512.c, each after its target pragma, with KNOT_ISA (the
 * name of the table exported at the end) and KNOT_ISA_NAME defined. */
#ifndef KNOT_QUANTS_AVX2_H
#define KNOT_QUANTS_AVX2_H

#include "quants.h"

/* ------------------------------------------------------------------ dot products: AVX2 */
#if HAVE_AVX2

/* Software prefetch of the weights, KNOT_PF_DIST bytes ahead of the block being multiplied.
 * Why: a decode product (T = 1) reads each weight byte once, and on these VMs one core's
 * hardware prefetchers do not run far enough ahead to hide DRAM latency, so without it the
 * kernels waited on memory and computed in turn. 2 KiB ahead (a few rows of a task's contiguous
 * range) hides it; 1, 4 and 8 KiB and the T1 and NTA hints measured no better
 * (benchmarks/kernel_ab.py). A prefetch never faults, so reading past W's end is safe. */
#ifndef KNOT_PF_DIST
#define KNOT_PF_DIST 2048
#endif
static inline void prefetch_ahead(const uint8_t *w, int nbytes) {
    for (int o = 0; o < nbytes; o += 64) _mm_prefetch((const char *)w + KNOT_PF_DIST + o, _MM_HINT_T0);
}

/* The multi-token kernels, dotn_*: N tokens per pass over a weight row (2 to 8), each weight
 * block unpacked once. Each is written once as dotn_body_* with N a parameter and inlined for each N,
 * so every N runs on registers; DOTN_ENTRY makes the table's entry, dotn_*, which takes n at run
 * time.
 * Why: a speculative verify trip's 2 or 3 rows (or the rows left after the 4s) took a
 * single-token pass each, and 3 rows cost more than 4; passes of 8 also make 8 and 9 rows cheaper
 * than passes of 4 (benchmarks/bench_kernels.py --rows). */
#define DOTN_INLINE static inline __attribute__((always_inline))
/* Integer chains per token in dotn_body_q4_K: 2 up to 4 tokens with VNNI, else 1. The lanes are
 * exact integers, so the bits do not depend on it. Why: one chain of 8 dependent vpdpwssd a
 * super-block per token bounds 2-4 token passes where the cores compute slower than they read
 * (benchmarks/kernel_ab.py); 4 tokens and more did not move, nor did Q6_K's 2. Without VNNI the
 * chain is a 1-cycle vpaddd, and there are only 16 registers. */
#define DOTN_CHAINS(N) (HAVE_VNNI && (N) <= 4 ? 2 : 1)
/* 8 tokens a pass in both builds. Why 8 with AVX2's 16 vector registers too: a pass of 8 took
 * less time than two of 4 for every type (benchmarks/kernel_ab.py --isa avx2 --rows 8): the
 * weights' unpacking is shared by twice the tokens, and what spills is reloaded from L1. */
#define DOTN_ISA 8
#define DOTN_ENTRY(name)                                                                           \
static void dotn_##name(const uint8_t *w, toks_t tk, int nb, int n, float out[DOTN_MAX]) {        \
    switch (n) {                                                                                   \
    case 1: dotn_body_##name(w, tk, nb, 1, out); break;                                            \
    case 2: dotn_body_##name(w, tk, nb, 2, out); break;                                            \
    case 3: dotn_body_##name(w, tk, nb, 3, out); break;                                            \
    case 4: dotn_body_##name(w, tk, nb, 4, out); break;                                            \
    case 5: dotn_body_##name(w, tk, nb, 5, out); break;                                            \
    case 6: dotn_body_##name(w, tk, nb, 6, out); break;                                            \
    case 7: dotn_body_##name(w, tk, nb, 7, out); break;                                            \
    default: dotn_body_##name(w, tk, nb, 8, out);                                                  \
    }                                                                                              \
}

static inline float hsum8_ps(__m256 a) {
    float v[8];
    _mm256_storeu_ps(v, a);
    return hsum8(v);
}

static inline __m256 lanes_acc(__m256 acc, __m256i s, float d) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d)));
}

static inline __m256i nibbles_32(const uint8_t *p) {  /* 16 bytes -> low nibbles | high nibbles */
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
#if HAVE_VNNI
    __m256i b = _mm256_broadcastsi128_si256(t);
    b = _mm256_mask_srli_epi16(b, 0xFF00, b, 4);  /* the upper 128 bits: high nibbles */
#else
    const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
#endif
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

/* A block's f16 scale times the activation block's, in all 8 lanes: f16_to_f32(rd16(w)) * *ad, the
 * same float32 product, as a broadcast load, one conversion and a multiply by a broadcast.
 * Why: the scalar form (insert, convert, multiply, broadcast) was 5 of a one-token block's ~20 uops;
 * the vector form is faster with the same bits, with VNNI and without (benchmarks/kernel_ab.py). */
static inline __m256 block_scale8(const uint8_t *w, const float *ad) {  /* ad NULL: the weight's scale alone */
    short h;
    memcpy(&h, w, 2);
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi16(h));
    return ad ? _mm256_mul_ps(d, _mm256_set1_ps(*ad)) : d;
}

#if HAVE_VNNI
/* The 32 weight quants of a legacy block plus an offset, unsigned, for vpdpbusd; the activation's
 * corr lanes (-offset * sums of 4) make the dot signed again. */
#define Q8_0_OFFSET 128
#define Q4_0_OFFSET 8
#define Q5_0_OFFSET 16
static inline __m256i unpack_q8_0(const uint8_t *w) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 2)), _mm256_set1_epi8((char)0x80));
}

static inline __m256i unpack_q4_0(const uint8_t *w) { return nibbles_32(w + 2); }

static inline __m256i unpack_q5_0(const uint8_t *w) {
    uint32_t qh; memcpy(&qh, w + 2, 4);
    const __m256i x = nibbles_32(w + 6);
    return _mm256_mask_add_epi8(x, (__mmask32)qh, x, _mm256_set1_epi8(16));  /* 5th bit: +16 */
}

/* ref: ggml_vec_dot_q8_0_q8_0 / q4_0 / q5_0, AVX2 branch (mul + add in place of its fmadd) */
#define LEGACY_DOTS(name, BYTES)                                                                   \
static float dot_##name##_avx2(const uint8_t *w, const int8_t *q, const float *ad,                \
                               const void *aux, int nb) {                                         \
    const int32_t *corr = aux;                                                                     \
    __m256 acc = _mm256_setzero_ps();                                                              \
    _Pragma("GCC unroll 2")                                                                        \
    for (int b = 0; b < nb; b++, w += BYTES, q += QK, corr += 8) {                                \
        prefetch_ahead(w, BYTES);                                                                  \
        const __m256i s = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)corr),         \
                                              unpack_##name(w), _mm256_loadu_si256((const __m256i *)q)); \
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(s), block_scale8(w, ad + b)));  \
    }                                                                                              \
    return hsum8_ps(acc);                                                                          \
}
/* The weight quants of a legacy block minus the offset, signed: the multi-token passes' form */
static inline __m256i signed_q8_0(const uint8_t *w) { return _mm256_loadu_si256((const __m256i *)(w + 2)); }
static inline __m256i signed_q4_0(const uint8_t *w) { return _mm256_sub_epi8(nibbles_32(w + 2), _mm256_set1_epi8(8)); }
static inline __m256i signed_q5_0(const uint8_t *w) {  /* the nibble, less 16 where the 5th bit is clear */
    uint32_t qh; memcpy(&qh, w + 2, 4);
    const __m256i x = nibbles_32(w + 6);
    return _mm256_mask_sub_epi8(x, (__mmask32)~qh, x, _mm256_set1_epi8(16));
}

/* Multi-token passes on u = q + 128 (unsigned; act_t.u), the weights signed: a token's lanes are
 * sum(w * (q + 128)) - 128 * sum(w) = sum(w * q), the integers the corr lanes give, so the same
 * bits. Why: the 128 * sum(w) lanes are the block's, formed once for all its tokens, where the corr
 * lanes were a 32-byte load a token of their own (benchmarks/kernel_ab.py --rows 8,64;
 * docs/lab/2026-12-07-prompt-lookup-bound.md). */
#define LEGACY_DOTN(name, BYTES)                                                                   \
DOTN_INLINE void dotn_body_##name##_avx2(const uint8_t *w, toks_t tk, int nb, const int N, float out[DOTN_MAX]) { \
    const uint8_t *u = (const uint8_t *)tk.aux;  /* token i's u: ne0 bytes a token, as its quants */ \
    const __m256i u128 = _mm256_set1_epi8((char)0x80);                                             \
    __m256 acc[DOTN_ISA];                                                                          \
    for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();                                      \
    for (int b = 0; b < nb; b++, w += BYTES, u += QK) {                                           \
        prefetch_ahead(w, BYTES);                                                                  \
        const __m256i x = signed_##name(w);                                                        \
        const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(),                                 \
                                           _mm256_dpbusd_epi32(_mm256_setzero_si256(), u128, x));  \
        const __m256 wd = block_scale8(w, NULL);                                                   \
        for (int i = 0; i < N; i++) {                                                              \
            const __m256i s = _mm256_dpbusd_epi32(                                                 \
                c, _mm256_loadu_si256((const __m256i *)(u + i * tk.q_stride)), x);                 \
            const __m256 d = _mm256_mul_ps(wd, _mm256_set1_ps(tk.d[(size_t)b * tk.d_stride + i])); \
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(s), d));               \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < N; i++) out[i] = hsum8_ps(acc[i]);                                         \
}
#else
/* Q4_0 / Q5_0 as their unsigned quants (0..15, 0..31) for vpmaddubsw, with the activation's corr
 * lanes (-offset * sums of 4, as the VNNI kernels) added to make the dot signed again. Why: on a
 * CPU whose 256-bit ops are two 128-bit uops, these kernels are compute-bound (as fast in L2 as
 * from DRAM), and the unsigned form drops the two vpsignb of dot_i8_lanes
 * (docs/lab/2026-12-02-zen1-avx2-without-vnni.md). No saturation: 31 * 127 * 2 < 32767.
 * Q8_0 keeps the signed form: 255 * 127 * 2 would saturate vpmaddubsw's int16. */
#define Q4_0_OFFSET 8
#define Q5_0_OFFSET 16

static inline __m256i unpack_q8_0(const uint8_t *w) { return _mm256_loadu_si256((const __m256i *)(w + 2)); }

static inline __m256i unpack_q4_0(const uint8_t *w) { return nibbles_32(w + 2); }

/* Q5_0's 5th bits as ggml's bytes_from_bits_32: byte j takes qh's byte j / 8 (vpshufb), every bit
 * but j % 8 set over it leaves 0xFF only where that bit is set (vpor, vpcmpeqb), 0x10 kept there
 * and or-ed into the nibbles.
 * Why not four table reads of 8 bytes each: where the 256-bit units are whole, building the vector
 * from four 64-bit reads (vmovq, vpinsrq, vinserti128) costs more than these four operations
 * (benchmarks/kernel_ab.py --types Q5_0); where they are split in two the table had measured the
 * faster (docs/lab/2026-12-02-zen1-avx2-without-vnni.md, docs/lab/2026-12-07-zen3-avx2-q5_0.md). */
static inline __m256i unpack_q5_0(const uint8_t *w) {
    int32_t qh; memcpy(&qh, w + 2, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bits = _mm256_cmpeq_epi8(_mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread),
                                                           _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                           _mm256_set1_epi64x(-1));
    return _mm256_or_si256(nibbles_32(w + 6), _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
}

/* signed x * signed y, summed in int32 lanes of 4 (|y| <= 127, so no int16 saturation) */
static inline __m256i dot_i8_lanes(__m256i x, __m256i y) {
    const __m256i ax = _mm256_sign_epi8(x, x), sy = _mm256_sign_epi8(y, x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
}

/* unsigned u * signed y, summed in int32 lanes of 4, plus the corr lanes at c */
static inline __m256i dot_u8_lanes(__m256i u, __m256i y, const int32_t *c) {
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1));
    return _mm256_add_epi32(s, _mm256_loadu_si256((const __m256i *)c));
}

/* Q8_0: signed; Q4_0 / Q5_0: unsigned with the corr lanes */
#define LANES_q8_0(x, y, c) dot_i8_lanes(x, y)
#define LANES_q4_0(x, y, c) dot_u8_lanes(x, y, c)
#define LANES_q5_0(x, y, c) dot_u8_lanes(x, y, c)

/* ref: ggml_vec_dot_q8_0_q8_0 / q4_0 / q5_0, AVX2 branch (mul + add in place of its fmadd) */
#define LEGACY_DOTS(name, BYTES)                                                                   \
static float dot_##name##_avx2(const uint8_t *w, const int8_t *q, const float *ad,                \
                               const void *aux, int nb) {                                         \
    const int32_t *corr = aux;                                                                     \
    (void)corr;                                                                                    \
    __m256 acc = _mm256_setzero_ps();                                                              \
    _Pragma("GCC unroll 2")                                                                        \
    for (int b = 0; b < nb; b++, w += BYTES, q += QK) {                                           \
        prefetch_ahead(w, BYTES);                                                                  \
        const __m256i y = _mm256_loadu_si256((const __m256i *)q);                                 \
        const __m256i s = LANES_##name(unpack_##name(w), y, corr + 8 * b);                        \
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(s), block_scale8(w, ad + b)));  \
    }                                                                                              \
    return hsum8_ps(acc);                                                                          \
}
#define LEGACY_DOTN(name, BYTES)                                                                   \
DOTN_INLINE void dotn_body_##name##_avx2(const uint8_t *w, toks_t tk, int nb, const int N, float out[DOTN_MAX]) { \
    const int8_t *q = tk.q;                                                                        \
    const intptr_t dc = (intptr_t)tk.aux - (intptr_t)tk.q;  /* corr lanes: both rows are ne0 bytes (Q8_0: unused) */ \
    (void)dc;                                                                                      \
    __m256 acc[DOTN_ISA];                                                                          \
    for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();                                      \
    for (int b = 0; b < nb; b++, w += BYTES, q += QK) {                                           \
        prefetch_ahead(w, BYTES);                                                                  \
        const __m256i x = unpack_##name(w);                                                        \
        const __m256 wd = block_scale8(w, NULL);                                                   \
        for (int i = 0; i < N; i++) {                                                              \
            const int8_t *qi = q + i * tk.q_stride;                                                \
            const __m256i y = _mm256_loadu_si256((const __m256i *)qi);                             \
            const __m256 d = _mm256_mul_ps(wd, _mm256_set1_ps(tk.d[(size_t)b * tk.d_stride + i])); \
            const __m256i s = LANES_##name(x, y, (const int32_t *)((intptr_t)qi + dc));            \
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(s), d));               \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < N; i++) out[i] = hsum8_ps(acc[i]);                                         \
}
#endif

LEGACY_DOTS(q8_0, Q8_0_BYTES)
LEGACY_DOTS(q4_0, Q4_0_BYTES)
#if HAVE_VNNI
/* One token over two rows of W at once: each row's lanes are dot_*'s, block by block in the same
 * order (the same bits); the token's quants, corr lanes and scale are loaded once for both, and
 * the two rows' chains of adds interleave. Only Q5_0's is in the table: its unpacking makes it the
 * most compute-bound of the three: its products got faster, while a shard's Q8_0 head slice got
 * slower (benchmarks/kernel_ab.py), so Q8_0 (and Q4_0, unmeasured) keep one row a pass. */
#define LEGACY_DOT2(name, BYTES)                                                                   \
static void dot2_##name##_avx2(const uint8_t *w0, size_t row_bytes, const int8_t *q, const float *ad, \
                               const void *aux, int nb, float out[2]) {                           \
    const int32_t *corr = aux;                                                                     \
    const uint8_t *w1 = w0 + row_bytes;                                                            \
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                 \
    for (int b = 0; b < nb; b++, w0 += BYTES, w1 += BYTES, q += QK, corr += 8) {                  \
        prefetch_ahead(w0, BYTES);                                                                 \
        prefetch_ahead(w1, BYTES);                                                                 \
        const __m256i c = _mm256_loadu_si256((const __m256i *)corr);                               \
        const __m256i y = _mm256_loadu_si256((const __m256i *)q);                                  \
        const __m256i s0 = _mm256_dpbusd_epi32(c, unpack_##name(w0), y);                           \
        const __m256i s1 = _mm256_dpbusd_epi32(c, unpack_##name(w1), y);                           \
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(_mm256_cvtepi32_ps(s0), block_scale8(w0, ad + b))); \
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_cvtepi32_ps(s1), block_scale8(w1, ad + b))); \
    }                                                                                              \
    out[0] = hsum8_ps(acc0);                                                                       \
    out[1] = hsum8_ps(acc1);                                                                       \
}
LEGACY_DOT2(q5_0, Q5_0_BYTES)
#define DOT2_TABLE {NULL, dot2_q5_0_avx2, NULL, NULL, NULL}
#else
#define DOT2_TABLE {NULL, NULL, NULL, NULL, NULL}
#endif
LEGACY_DOTS(q5_0, Q5_0_BYTES)
LEGACY_DOTN(q8_0, Q8_0_BYTES)
LEGACY_DOTN(q4_0, Q4_0_BYTES)
LEGACY_DOTN(q5_0, Q5_0_BYTES)
DOTN_ENTRY(q8_0_avx2)
DOTN_ENTRY(q4_0_avx2)
DOTN_ENTRY(q5_0_avx2)

static inline float hsum4_ps(__m128 a) {
    float v[4];
    _mm_storeu_ps(v, a);
    return hsum4(v);
}

/* The 12 packed bytes at w + 4 -> sc0..7 | m0..7, as q4_k_scales (reads 4 bytes past them, in qs):
 *   sc j<4: s[j] & 63         sc j>=4: (s[j+4] & 15) | (s[j-4] >> 6) << 4
 *   m  j<4: s[j+4] & 63       m  j>=4: (s[j+4] >> 4) | (s[j] >> 6) << 4 */
static inline __m128i q4_k_scales_sse(const uint8_t *w) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(w + 4));
    const __m128i lo = _mm_and_si128(_mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, -1, -1, -1, -1)),
                                     _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i nib = _mm_and_si128(_mm_shuffle_epi8(_mm_srli_epi16(v, 4), _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 8, 9, 10, 11)),
                                      _mm_set1_epi8(15));
    const __m128i top = _mm_and_si128(_mm_shuffle_epi8(_mm_srli_epi16(v, 2), _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)),
                                      _mm_set1_epi8(0x30));
    return _mm_or_si128(_mm_or_si128(lo, nib), top);
}

/* broadcast int16 lane i of the Q4_K scales (ref: get_scale_shuffle_k4) */
static const uint8_t Q4_K_SHUFFLE[8][32] = {
    {0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1},
    {2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3},
    {4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5},
    {6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7},
    {8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9, 8, 9},
    {10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11, 10, 11},
    {12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13, 12, 13},
    {14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15, 14, 15},
};

/* sumi + madd(scale, pairs): int16 pairs times int16 scales, summed into int32 lanes. With
 * AVX-512 VNNI one vpdpwssd; the lanes are exact integers either way, so the bits are the same. */
static inline __m256i scaled_add(__m256i sumi, __m256i scale, __m256i pairs) {
#if HAVE_VNNI
    return _mm256_dpwssd_epi32(sumi, scale, pairs);
#else
    return _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, pairs));
#endif
}

/* ref: ggml_vec_dot_q4_K_q8_K, AVX2 branch: 8 float lanes for the scales, 4 for the mins */
static float dot_q4_K_avx2(const uint8_t *w, const int8_t *q, const float *ad, const void *aux, int nb) {
    const int16_t *bs = aux;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q4_K_BYTES, q += QK_K, bs += Q8K_AUX) {
        prefetch_ahead(w, Q4_K_BYTES);
        const __m256i sm = _mm256_cvtepu8_epi16(q4_k_scales_sse(w));  /* sc0..7 | m0..7 as int16 */
        /* mins: lane i = m[2i] * bsum32[2i] + m[2i+1] * bsum32[2i+1], the sums of 32 from the aux */
        const __m128i bs32 = _mm_loadu_si128((const __m128i *)(bs + QK_K / 16));
        const __m128i prod = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bs32);
        accm = _mm_add_ps(accm, _mm_mul_ps(_mm_cvtepi32_ps(prod), _mm_set1_ps(ad[b] * f16_to_f32(rd16(w + 2)))));
        const __m128i sc128 = _mm256_castsi256_si128(sm);
        const __m256i scales = _mm256_inserti128_si256(_mm256_castsi128_si256(sc128), sc128, 1);
        const uint8_t *qs = w + 16;
        /* Two integer chains, the low and the high nibbles', summed once per super-block: the lanes
         * are exact integers, so the bits are the same. Why: one chain of 8 dependent vpdpwssd per
         * super-block bound the one-token kernel where two threads compute it slower than they
         * read it (the 1.5B's ffn_gate/up; benchmarks/kernel_ab.py). */
        __m256i sl = _mm256_setzero_si256(), sh = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 64; j++) {
            const __m256i scale_l = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)Q4_K_SHUFFLE[2 * j]));
            const __m256i scale_h = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)Q4_K_SHUFFLE[2 * j + 1]));
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            const __m256i ql = _mm256_and_si256(bits, m4);
            const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i yl = _mm256_loadu_si256((const __m256i *)(q + 64 * j));
            const __m256i yh = _mm256_loadu_si256((const __m256i *)(q + 64 * j + 32));
            sl = scaled_add(sl, scale_l, _mm256_maddubs_epi16(ql, yl));
            sh = scaled_add(sh, scale_h, _mm256_maddubs_epi16(qh, yh));
        }
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sl, sh)), block_scale8(w, ad + b)));
    }
    return hsum8_ps(acc) - hsum4_ps(accm);
}

/* bytes: Q6_K scale 2i x8, scale 2i+1 x8 (ref: get_scale_shuffle) */
static const uint8_t Q6_K_SHUFFLE[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};

/* ref: ggml_vec_dot_q6_K_q8_K, AVX2 branch, with the -32 offset taken from the activation's
 * 16-element sums (as its AVX branch does) */
static float dot_q6_K_avx2(const uint8_t *w, const int8_t *q, const float *ad, const void *aux, int nb) {
    const int16_t *bs = aux;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q6_K_BYTES, q += QK_K, bs += Q8K_AUX) {
        prefetch_ahead(w, Q6_K_BYTES);
        const uint8_t *ql = w, *qh = w + 128;
        const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
        /* lane k: 32 * (sc[2k] * bsum[2k] + sc[2k+1] * bsum[2k+1]), the -32 offset of the quants */
        const __m256i corr = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scales),
                                               _mm256_loadu_si256((const __m256i *)bs));
        __m256i sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5));
        __m256i s2 = _mm256_setzero_si256();  /* a second integer chain, as dot_q4_K_avx2's */
        for (int h = 0; h < 2; h++) {
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i b2 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i bh = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(b1, m4),
                                               _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4));
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(b2, m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 2), m3), 4));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 4), m3), 4));
            const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 6), m3), 4));
            const int8_t *y = q + 128 * h;
            __m256i p0 = _mm256_maddubs_epi16(q0, _mm256_loadu_si256((const __m256i *)(y + 0)));
            __m256i p1 = _mm256_maddubs_epi16(q1, _mm256_loadu_si256((const __m256i *)(y + 32)));
            __m256i p2 = _mm256_maddubs_epi16(q2, _mm256_loadu_si256((const __m256i *)(y + 64)));
            __m256i p3 = _mm256_maddubs_epi16(q3, _mm256_loadu_si256((const __m256i *)(y + 96)));
#define Q6_SCALE(k) _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128((const __m128i *)Q6_K_SHUFFLE[4 * h + (k)])))
            sumi = scaled_add(sumi, Q6_SCALE(0), p0);
            s2 = scaled_add(s2, Q6_SCALE(1), p1);
            sumi = scaled_add(sumi, Q6_SCALE(2), p2);
            s2 = scaled_add(s2, Q6_SCALE(3), p3);
#undef Q6_SCALE
        }
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sumi, s2)), block_scale8(w + 208, ad + b)));
    }
    return hsum8_ps(acc);
}

/* The mins' 4 lanes of tokens 2p and 2p + 1 share one vector (lanes 0-3 and 4-7): the same lanes,
 * products and sums as one token's vector of 4 each, in half the instructions (an odd last token
 * keeps its own). Why: the mins term is a sizeable share of a pass of 8 tokens
 * (benchmarks/bench_kernels.py --rows). */
DOTN_INLINE void dotn_body_q4_K_avx2(const uint8_t *w, toks_t tk, int nb, const int N, float out[DOTN_MAX]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[DOTN_ISA], accm2[DOTN_ISA / 2];
    __m128 accm1 = _mm_setzero_ps();
    for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();
    for (int p = 0; p < N / 2; p++) accm2[p] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q4_K_BYTES) {
        prefetch_ahead(w, Q4_K_BYTES);
        const __m256i sm = _mm256_cvtepu8_epi16(q4_k_scales_sse(w));
        const __m128i mins = _mm256_extracti128_si256(sm, 1);
        const __m256i mins2 = _mm256_broadcastsi128_si256(mins);
        const float wd = f16_to_f32(rd16(w)), wdmin = f16_to_f32(rd16(w + 2));
        const __m256 wdmin8 = _mm256_set1_ps(wdmin);
        const __m128i sc128 = _mm256_castsi256_si128(sm);
        const __m256i scales = _mm256_inserti128_si256(_mm256_castsi128_si256(sc128), sc128, 1);
        __m256i sumi[DOTN_ISA], sumh[DOTN_ISA];
        for (int i = 0; i < N; i++) sumi[i] = sumh[i] = _mm256_setzero_si256();
        for (int j = 0; j < QK_K / 64; j++) {
            const __m256i scale_l = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)Q4_K_SHUFFLE[2 * j]));
            const __m256i scale_h = _mm256_shuffle_epi8(scales, _mm256_loadu_si256((const __m256i *)Q4_K_SHUFFLE[2 * j + 1]));
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            const __m256i ql = _mm256_and_si256(bits, m4);
            const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            for (int i = 0; i < N; i++) {
                const int8_t *q = tk.q + i * tk.q_stride + (size_t)b * QK_K + 64 * j;
                sumi[i] = scaled_add(sumi[i], scale_l, _mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)q)));
                const __m256i ph = _mm256_maddubs_epi16(qh, _mm256_loadu_si256((const __m256i *)(q + 32)));
                if (DOTN_CHAINS(N) == 2) sumh[i] = scaled_add(sumh[i], scale_h, ph);
                else sumi[i] = scaled_add(sumi[i], scale_h, ph);
            }
        }
        if (DOTN_CHAINS(N) == 2)
            for (int i = 0; i < N; i++) sumi[i] = _mm256_add_epi32(sumi[i], sumh[i]);
        /* token i's sums of 32 (the aux's second part) and its scale for this super-block */
#define Q4K_BS32(i) ((const __m128i *)((const int16_t *)tk.aux + (i) * tk.aux_stride + (size_t)b * Q8K_AUX + QK_K / 16))
#define Q4K_AD(i) tk.d[(size_t)b * tk.d_stride + (i)]
        for (int p = 0; p < N / 2; p++) {
            const __m256i bs2 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(Q4K_BS32(2 * p))),
                                                        _mm_loadu_si128(Q4K_BS32(2 * p + 1)), 1);
            const __m256 ad2 = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(Q4K_AD(2 * p))),
                                                    _mm_set1_ps(Q4K_AD(2 * p + 1)), 1);
            accm2[p] = _mm256_add_ps(accm2[p], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins2, bs2)),
                                                             _mm256_mul_ps(ad2, wdmin8)));
        }
        if (N & 1)
            accm1 = _mm_add_ps(accm1, _mm_mul_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, _mm_loadu_si128(Q4K_BS32(N - 1)))),
                                                 _mm_set1_ps(Q4K_AD(N - 1) * wdmin)));
        for (int i = 0; i < N; i++) acc[i] = lanes_acc(acc[i], sumi[i], Q4K_AD(i) * wd);
#undef Q4K_BS32
#undef Q4K_AD
    }
    for (int i = 0; i < N; i++) {
        const __m128 m = i == N - 1 && (N & 1) ? accm1
                       : i & 1 ? _mm256_extractf128_ps(accm2[i / 2], 1) : _mm256_castps256_ps128(accm2[i / 2]);
        out[i] = hsum8_ps(acc[i]) - hsum4_ps(m);
    }
}

DOTN_INLINE void dotn_body_q6_K_avx2(const uint8_t *w, toks_t tk, int nb, const int N, float out[DOTN_MAX]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256 acc[DOTN_ISA];
    for (int i = 0; i < N; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += Q6_K_BYTES) {
        prefetch_ahead(w, Q6_K_BYTES);
        const uint8_t *ql = w, *qh = w + 128;
        const __m128i scales = _mm_loadu_si128((const __m128i *)(w + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(scales);
        const float wd = f16_to_f32(rd16(w + 208));
        __m256i sumi[DOTN_ISA];
        for (int i = 0; i < N; i++) {
            const int16_t *bs = (const int16_t *)tk.aux + i * tk.aux_stride + (size_t)b * Q8K_AUX;
            sumi[i] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                       _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)bs)), 5));
        }
        for (int h = 0; h < 2; h++) {
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i b2 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i bh = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            __m256i qv[4], sv[4];
            qv[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4));
            qv[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 2), m3), 4));
            qv[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 4), m3), 4));
            qv[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 6), m3), 4));
            for (int k = 0; k < 4; k++)
                sv[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_loadu_si128((const __m128i *)Q6_K_SHUFFLE[4 * h + k])));
            for (int i = 0; i < N; i++) {
                const int8_t *y = tk.q + i * tk.q_stride + (size_t)b * QK_K + 128 * h;
                for (int k = 0; k < 4; k++)
                    sumi[i] = scaled_add(sumi[i], sv[k], _mm256_maddubs_epi16(qv[k], _mm256_loadu_si256((const __m256i *)(y + 32 * k))));
            }
        }
        for (int i = 0; i < N; i++) acc[i] = lanes_acc(acc[i], sumi[i], tk.d[(size_t)b * tk.d_stride + i] * wd);
    }
    for (int i = 0; i < N; i++) out[i] = hsum8_ps(acc[i]);
}

DOTN_ENTRY(q4_K_avx2)
DOTN_ENTRY(q6_K_avx2)

/* AVX2 q8_0 quantization: same operations as quantize_row_q8_0 above, 32 at a time */
static void quantize_row_q8_0_avx2(const float *x, int8_t *qs, float *d, int ne0) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < ne0 / QK; b++, x += QK, qs += QK) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        d[b] = round_f16(amax / 127.f);
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.f / amax : 0.0f);
        __m256i i[4];
        for (int k = 0; k < 4; k++)
            i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)qs, p);
    }
}

#if HAVE_VNNI
#define CORR(T) T##_OFFSET
#define CORR_Q8_0 Q8_0_OFFSET
#else
#define CORR(T) T##_OFFSET
#define CORR_Q8_0 0  /* signed: no corr lanes */
#endif

#include "attn_avx2.h"

const isa_kernels KNOT_ISA = {
    KNOT_ISA_NAME,
    {dot_q4_0_avx2, dot_q5_0_avx2, dot_q8_0_avx2, dot_q4_K_avx2, dot_q6_K_avx2},
    {dotn_q4_0_avx2, dotn_q5_0_avx2, dotn_q8_0_avx2, dotn_q4_K_avx2, dotn_q6_K_avx2},
    {CORR(Q4_0), CORR(Q5_0), CORR_Q8_0, 0, 0},
    quantize_row_q8_0_avx2, quantize_row_q8_K, lane_corr,  /* the last two: quants.h's, compiled for this ISA */
    attn_scores_simd, attn_values_simd, DOTN_ISA, DOT2_TABLE, HAVE_VNNI,
};
#else
const isa_kernels KNOT_ISA = {NULL};  /* the compiler did not take the target: the module runs without it */
#endif /* HAVE_AVX2 */

#endif
