/* ggml blocks for the matmul kernels: geometry, f16, activation quantization (Q8_0, Q8_K) and
 * the portable reference dot products, which define the numerics of every ISA's kernels, and
 * isa_kernels, the table of one instruction set's kernels.
 *
 * Included by each translation unit: _qmatmul.c (the portable baseline) and simd_avx2.c /
 * simd_avx512.c, which compile quants_avx2.h under a function-level target: there the target
 * pragma defines __AVX2__ (and __AVX512VNNI__ ...) before this header is read. */
#ifndef KNOT_QUANTS_H
#define KNOT_QUANTS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if HAVE_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

/* ggml type ids and block geometry: (elements, bytes) written as sums of fields, as gguf-py. */
enum { GGML_Q4_0 = 2, GGML_Q5_0 = 6, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q6_K = 14 };
#define QK 32
#define QK_K 256
#define Q4_0_BYTES (2 + QK / 2)                        /* d f16 | qs 16 */
#define Q5_0_BYTES (2 + 4 + QK / 2)                    /* d f16 | qh 4 | qs 16 */
#define Q8_0_BYTES (2 + QK)                            /* d f16 | qs 32 */
#define Q4_K_BYTES (2 + 2 + 12 + QK_K / 2)             /* d | dmin | scales 12 | qs 128 */
#define Q6_K_BYTES (QK_K / 2 + QK_K / 4 + QK_K / 16 + 2) /* ql 128 | qh 64 | scales 16 | d */

/* ------------------------------------------------------------------ f16 <-> f32 (exact) */

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static inline float f16_to_f32(uint16_t h) {
#if HAVE_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF, bits;
    if (e == 0x1F) bits = sign | 0x7F800000 | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else {  /* subnormal: normalize */
        e = 113;
        while (!(m & 0x400)) { m <<= 1; e--; }
        bits = sign | (e << 23) | ((m & 0x3FF) << 13);
    }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

/* float32 -> nearest f16 (ties to even) -> float32, as GGML_FP32_TO_FP16 then back. */
static inline float round_f16(float f) {
#if HAVE_AVX2
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    uint32_t x; memcpy(&x, &f, 4);
    uint32_t sign = x & 0x80000000u, ax = x & 0x7FFFFFFFu;
    uint16_t h;
    if (ax >= 0x7F800000u) h = (uint16_t)((sign >> 16) | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0));
    else if (ax >= 0x477FF000u) h = (uint16_t)((sign >> 16) | 0x7C00);  /* rounds to inf */
    else if (ax < 0x38800000u) {  /* f16 subnormal or zero: scale by 2^24 and round */
        float a; memcpy(&a, &ax, 4);
        h = (uint16_t)((sign >> 16) | (uint32_t)nearbyintf(a * 16777216.0f));
    } else {
        uint32_t r = ax + 0xFFF + ((ax >> 13) & 1);  /* ties to even */
        h = (uint16_t)((sign >> 16) | ((r - 0x38000000u) >> 13));
    }
    return f16_to_f32(h);
#endif
}

/* ------------------------------------------------------------------ activation quantization */

/* A quantized activation, struct of arrays over T rows:
 *   qs    int8  (T, ne0)
 *   d     float (T, ne0 / block)   the scale as the dot product reads it (Q8_0: f16-rounded)
 *   bsums int16 (T, ne0 / 256, Q8K_AUX)  Q8_K only, per super-block: the 16 sums of 16 consecutive
 *                                  qs, then the 8 sums of 32 (Q6_K reads the first, Q4_K's mins
 *                                  the second: each token's pairs are summed once, not once a row)
 *   corr  int32 (T, ne0 / 32, 8)   Q8_0 for the VNNI kernels only: -offset * (sum of qs 4k..4k+3),
 *                                  which turns a dot with unsigned weights (q + offset) into the
 *                                  dot with the signed ones */
#define Q8K_AUX (QK_K / 16 + QK_K / 32)  /* int16 per super-block of a Q8_K activation's bsums */
static inline size_t q8k_aux_per_row(int ne0) { return (size_t)(ne0 / QK_K) * Q8K_AUX; }  /* int16 a row */

typedef struct {
    int8_t *qs;
    float *d;
    int16_t *bsums;
    int32_t *corr;
    float *dT;  /* d block-major, (nb, T), for the multi-token kernels (toks_t); NULL when T < 2 */
    int u;      /* corr holds each token's quants as u = q ^ 0x80 (unsigned), not its corr lanes (act_u) */
} act_t;

static inline void lane_corr(const int8_t *qs, int32_t *corr, int ne0, int offset) {
    for (int j = 0; j < ne0 / 4; j++)
        corr[j] = -offset * (qs[4 * j] + qs[4 * j + 1] + qs[4 * j + 2] + qs[4 * j + 3]);
}

static inline void act_u8(const int8_t *qs, uint8_t *u, int ne0) {  /* q + 128 as unsigned bytes */
    for (int j = 0; j < ne0; j++) u[j] = (uint8_t)(qs[j] ^ 0x80);
}

/* ref: x86 quants.c quantize_row_q8_0 (the AVX2 one: id = 127 / amax, round half to even) */
static inline void quantize_row_q8_0(const float *x, int8_t *qs, float *d, int ne0) {
    for (int b = 0; b < ne0 / QK; b++, x += QK, qs += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        d[b] = round_f16(amax / 127.f);
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        for (int j = 0; j < QK; j++) qs[j] = (int8_t)nearbyintf(x[j] * id);
    }
}

/* ref: ggml-quants.c quantize_row_q8_K_ref (iscale = -127 / signed max, round half to even) */
static inline void quantize_row_q8_K(const float *x, int8_t *qs, float *d, int16_t *bsums, int ne0) {
    for (int b = 0; b < ne0 / QK_K; b++, x += QK_K, qs += QK_K, bsums += Q8K_AUX) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0.0f) {
            d[b] = 0.0f;
            memset(qs, 0, QK_K);
            memset(bsums, 0, Q8K_AUX * sizeof(int16_t));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) {
            const int v = (int)nearbyintf(iscale * x[j]);
            qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < QK_K / 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qs[16 * g + i];
            bsums[g] = (int16_t)s;
        }
        for (int g = 0; g < QK_K / 32; g++)  /* |sum| <= 32 * 128: an int16 */
            bsums[QK_K / 16 + g] = (int16_t)(bsums[2 * g] + bsums[2 * g + 1]);
        d[b] = 1 / iscale;
    }
}

/* ------------------------------------------------------------------ dot products: reference
 * dot(w row, activation row) over nb blocks. Legacy types keep 8 float lanes, lane k holding
 * the block sums of elements 4k..4k+3 (the int32 lanes of maddubs + madd), reduced at the end
 * as ggml's hsum_float_8 does. K-quants reduce each super-block to one exact int first. */

/* aux: the Q8_K bsums for K-quants, the corr lanes for the legacy kernels that take them, else unused */
typedef float (*dot_fn)(const uint8_t *w, const int8_t *q, const float *d, const void *aux, int nb);

/* The same dot for n tokens at once, 2 to dotn_max (prefill, a verify trip's rows; 1 too where
 * act_u): each weight block is unpacked once. Token i reads q + i * q_stride and aux + i *
 * aux_stride (in elements), and its scale of block b at d[b * d_stride + i]: the scales block-major
 * (act_t.dT). A legacy pass finds token i's corr lanes (or u, VNNI) at a fixed byte distance from
 * its quants, or at aux + i * q_stride bytes (both rows are ne0 bytes).
 * Why: per-token pointers to q, aux and d were more than the general registers, and the 8-token
 * passes moved them in and out of vector registers every block (benchmarks/kernel_ab.py --rows 8).
 * out[i] equals dot() of token i bit for bit: each token's operations are the same, in the same
 * order. */
typedef struct {
    const int8_t *q;
    const float *d;
    const void *aux;
    size_t q_stride, d_stride, aux_stride;
} toks_t;
#define DOTN_MAX 8  /* the most tokens a table's dotn takes at once (isa_kernels.dotn_max) */
typedef void (*dotn_fn)(const uint8_t *w, toks_t tk, int nb, int n, float out[DOTN_MAX]);  /* n: 1 to dotn_max */
/* one token, two rows of W: w and w + row_bytes -> out[0], out[1], each dot_fn's bits */
typedef void (*dot2_fn)(const uint8_t *w, size_t row_bytes, const int8_t *q, const float *d, const void *aux, int nb,
                        float out[2]);

static inline float hsum8(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline float hsum4(const float a[4]) { return (a[0] + a[2]) + (a[1] + a[3]); }

/* w8: the 32 weight quants of a block, already signed; lanes of 4 -> acc */
static inline void lanes_ref(float acc[8], const int8_t *w8, const int8_t *q, float d) {
    for (int k = 0; k < 8; k++) {
        int s = 0;
        for (int i = 4 * k; i < 4 * k + 4; i++) s += w8[i] * q[i];
        acc[k] = acc[k] + (float)s * d;
    }
}

static inline float dot_q8_0_ref(const uint8_t *w, const int8_t *q, const float *ad, const void *aux, int nb) {
    (void)aux;
    float acc[8] = {0};
    for (int b = 0; b < nb; b++, w += Q8_0_BYTES, q += QK)
        lanes_ref(acc, (const int8_t *)w + 2, q, f16_to_f32(rd16(w)) * ad[b]);
    return hsum8(acc);
}

/* Q4_0 / Q5_0: low nibbles are elements 0..15, high nibbles 16..31 */
static inline float dot_q4_0_ref(const uint8_t *w, const int8_t *q, const float *ad, const void *aux, int nb) {
    (void)aux;
    float acc[8] = {0};
    int8_t w8[QK];
    for (int b = 0; b < nb; b++, w += Q4_0_BYTES, q += QK) {
        for (int j = 0; j < QK / 2; j++) {
            w8[j] = (int8_t)((w[2 + j] & 0x0F) - 8);
            w8[j + 16] = (int8_t)((w[2 + j] >> 4) - 8);
        }
        lanes_ref(acc, w8, q, f16_to_f32(rd16(w)) * ad[b]);
    }
    return hsum8(acc);
}

/* Q5_0: bit j of qh (u32 LE) is the 5th bit of element j; value = q - 16 */
static inline float dot_q5_0_ref(const uint8_t *w, const int8_t *q, const float *ad, const void *aux, int nb) {
    (void)aux;
    float acc[8] = {0};
    int8_t w8[QK];
    for (int b = 0; b < nb; b++, w += Q5_0_BYTES, q += QK) {
        uint32_t qh; memcpy(&qh, w + 2, 4);
        for (int j = 0; j < QK / 2; j++) {
            w8[j] = (int8_t)(((w[6 + j] & 0x0F) | (((qh >> j) & 1) << 4)) - 16);
            w8[j + 16] = (int8_t)(((w[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
        }
        lanes_ref(acc, w8, q, f16_to_f32(rd16(w)) * ad[b]);
    }
    return hsum8(acc);
}

/* Q4_K: 8 sub-blocks of 32, 6-bit scale sc and min m each; y = d*sc*q - dmin*m.
 * ref: ggml-quants.c get_scale_min_k4; the utmp shuffle of ggml_vec_dot_q4_K_q8_K. */
static inline void q4_k_scales(const uint8_t *w, uint32_t utmp[4]) {
    memcpy(utmp, w + 4, 12);
    utmp[3] = ((utmp[2] >> 4) & 0x0f0f0f0f) | (((utmp[1] >> 6) & 0x03030303) << 4);
    const uint32_t uaux = utmp[1] & 0x3f3f3f3f;
    utmp[1] = (utmp[2] & 0x0f0f0f0f) | (((utmp[0] >> 6) & 0x03030303) << 4);
    utmp[2] = uaux;
    utmp[0] &= 0x3f3f3f3f;
    /* bytes 0..7: scales sc0..sc7, bytes 8..15: mins m0..m7 */
}

/* Lanes as the AVX2 code: lane k of a super-block sums, over its 8 sub-blocks of 32, the scale
 * times the products of elements 4k..4k+3; the mins go in 4 lanes of 2 sub-blocks each. */
static inline float dot_q4_K_ref(const uint8_t *w, const int8_t *q, const float *ad, const void *aux, int nb) {
    const int16_t *bs = aux;
    float acc[8] = {0}, accm[4] = {0};
    for (int b = 0; b < nb; b++, w += Q4_K_BYTES, q += QK_K, bs += Q8K_AUX) {
        uint32_t utmp[4];
        q4_k_scales(w, utmp);
        const uint8_t *sc = (const uint8_t *)utmp, *m = sc + 8, *qs = w + 16;
        const float d = ad[b] * f16_to_f32(rd16(w)), dmin = ad[b] * f16_to_f32(rd16(w + 2));
        for (int k = 0; k < 8; k++) {
            int lane = 0;
            for (int j = 0; j < QK_K / 64; j++) {  /* qs byte 32j + l: low -> 64j + l, high -> 64j + 32 + l */
                int lo = 0, hi = 0;
                for (int l = 4 * k; l < 4 * k + 4; l++) {
                    lo += (qs[32 * j + l] & 0x0F) * q[64 * j + l];
                    hi += (qs[32 * j + l] >> 4) * q[64 * j + 32 + l];
                }
                lane += sc[2 * j] * lo + sc[2 * j + 1] * hi;
            }
            acc[k] = acc[k] + (float)lane * d;
        }
        for (int i = 0; i < 4; i++) {
            const int mi = m[2 * i] * (bs[4 * i] + bs[4 * i + 1]) + m[2 * i + 1] * (bs[4 * i + 2] + bs[4 * i + 3]);
            accm[i] = accm[i] + (float)mi * dmin;
        }
    }
    return hsum8(acc) - hsum4(accm);
}

/* Q6_K: 16 groups of 16 with int8 scales; value = q - 32, q 6-bit. Per half h, l < 32:
 * elements 128h + l + 32k take low/high nibbles of ql[64h + l (+32)] and bits 2k.. of qh[32h + l].
 * Lanes as the AVX2 code: lane k sums over the 8 runs of 32 the scale times the products of
 * elements 4k..4k+3 of q (0..63), less 32 * (sc[2k] * bsum[2k] + sc[2k+1] * bsum[2k+1]). */
static inline int q6_k_quant(const uint8_t *w, int e) {  /* element e of the block, 0..63 */
    const int h = e / 128, k = (e % 128) / 32, l = e % 32;
    const uint8_t lb = w[64 * h + l + 32 * (k & 1)];
    return (k < 2 ? lb & 0x0F : lb >> 4) | (((w[128 + 32 * h + l] >> (2 * k)) & 3) << 4);
}

static inline float dot_q6_K_ref(const uint8_t *w, const int8_t *q, const float *ad, const void *aux, int nb) {
    const int16_t *bs = aux;
    float acc[8] = {0};
    for (int b = 0; b < nb; b++, w += Q6_K_BYTES, q += QK_K, bs += Q8K_AUX) {
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = ad[b] * f16_to_f32(rd16(w + 208));
        for (int k = 0; k < 8; k++) {
            int lane = -32 * (sc[2 * k] * bs[2 * k] + sc[2 * k + 1] * bs[2 * k + 1]);
            for (int c = 0; c < 8; c++) {  /* runs of 32 elements */
                int s = 0;
                for (int i = 4 * k; i < 4 * k + 4; i++) s += q6_k_quant(w, 32 * c + i) * q[32 * c + i];
                lane += sc[2 * c + (k >= 4)] * s;
            }
            acc[k] = acc[k] + (float)lane * d;
        }
    }
    return hsum8(acc);
}

/* ------------------------------------------------------------------ one ISA's kernels */

enum { K_Q4_0, K_Q5_0, K_Q8_0, K_Q4_K, K_Q6_K, N_KTYPES };  /* index into the tables below */

/* attention's products (attn.h says in which order every ISA sums them):
 * scores: out[r * os + s] = (float) sum_d q[r * hd + d] * k[s * ks + d] in double, r < R, s < S
 * values: out[r * hd + d] += sum_s f16(p[r * ps + s]) * v[s * vs + d] in double, s ascending */
/* keys or values as the KV cache stores them: float32, or f16 (llama.cpp's cache type) when f16 is
 * set; offsets count elements */
typedef struct { const void *p; int f16; } kv_ptr;
static inline kv_ptr kv_add(kv_ptr a, size_t n) {
    a.p = a.f16 ? (const void *)((const uint16_t *)a.p + n) : (const void *)((const float *)a.p + n);
    return a;
}
static inline float kv_get(kv_ptr a, size_t i) {
    return a.f16 ? f16_to_f32(((const uint16_t *)a.p)[i]) : ((const float *)a.p)[i];
}
typedef void (*attn_scores_fn)(const float *q, int R, kv_ptr k, size_t ks, int S, int hd,
                               float *out, size_t os);
typedef void (*attn_values_fn)(const float *p, size_t ps, int R, kv_ptr v, size_t vs, int S,
                               int hd, double *out);

typedef struct {
    const char *name;           /* NULL: not compiled in (the compiler lacks the target, or not x86) */
    dot_fn dot[N_KTYPES];
    dotn_fn dotn[N_KTYPES];     /* 2 to dotn_max tokens at once, or NULL */
    int corr_offset[N_KTYPES];  /* > 0: the kernel reads the activation's corr lanes (VNNI legacy) */
    void (*quantize_q8_0)(const float *x, int8_t *qs, float *d, int ne0);
    void (*quantize_q8_K)(const float *x, int8_t *qs, float *d, int16_t *bsums, int ne0);
    void (*lane_corr)(const int8_t *qs, int32_t *corr, int ne0, int offset);
    attn_scores_fn attn_scores;
    attn_values_fn attn_values;
    int dotn_max;               /* dotn's most tokens (8 in both SIMD builds) */
    dot2_fn dot2[N_KTYPES];     /* one token over two rows at once, or NULL */
    /* 1: the legacy types' multi-token passes (T >= 2) read each token's quants as u = q ^ 0x80 where
     * the corr lanes would be (act_t.u), and also take a single token (n = 1) */
    int act_u;
} isa_kernels;

#endif
