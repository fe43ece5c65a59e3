/* y = x @ W.T computed on the quantized blocks of W, as llama.cpp's CPU path does.
 *
 * Each activation row is quantized like ggml's quantize_row_q8_0 (for Q4_0, Q5_0, Q8_0) or
 * quantize_row_q8_K (for Q4_K, Q6_K); then each output is a sum of integer block dot products
 * times the block scales (ref: ggml-cpu/arch/x86/quants.c ggml_vec_dot_*).
 *
 *   quants.h       block geometry, activation quantization, the reference dot products: they
 *                  define the numerics (exact integer lanes, then float32 multiply and add in a
 *                  fixed order, no FMA: built with -ffp-contract=off)
 *   quants_avx2.h  the same numbers on AVX2 (+ AVX-512 VNNI), one token or four at a time,
 *                  compiled twice under function-level targets: simd_avx2.c, simd_avx512.c
 *   attn.h         attention's products K·q and V·p in float64, in one fixed order (the
 *                  reference), attn_avx2.h the same on AVX2 / AVX-512F
 *   pool.h         the thread pool
 *
 * The extension itself is built for the baseline ISA (x86-64: SSE2), so one build runs on any
 * CPU. At import it takes the best kernel table the CPU runs: avx512 (AVX-512 VL/BW/VNNI), avx2
 * (AVX2 + F16C) or scalar (the reference); set_isa() picks another one (the tests run each).
 *
 * So a result does not depend on the ISA, on the thread count (a row is computed by one thread),
 * or on how many tokens share the call. The GIL is released while computing. Only the buffer
 * protocol is used (no numpy headers): x float32 (T, ne0), w uint8 raw rows, y float32 (T, ne1)
 * written in place.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "quants.h"
#include "attn.h"
#include "quants_avx2.h"
#include "pool.h"

/* ------------------------------------------------------------------ type table */

typedef struct {
    int type;
    const char *name;
    int block_elems, block_bytes;
    int act_k;  /* 0: Q8_0 activations, 1: Q8_K */
    int k;      /* index into isa_kernels' tables */
} qtype_t;

static const qtype_t QTYPES[] = {
    {GGML_Q4_0, "Q4_0", QK, Q4_0_BYTES, 0, K_Q4_0},
    {GGML_Q5_0, "Q5_0", QK, Q5_0_BYTES, 0, K_Q5_0},
    {GGML_Q8_0, "Q8_0", QK, Q8_0_BYTES, 0, K_Q8_0},
    {GGML_Q4_K, "Q4_K", QK_K, Q4_K_BYTES, 1, K_Q4_K},
    {GGML_Q6_K, "Q6_K", QK_K, Q6_K_BYTES, 1, K_Q6_K},
};
#define N_QTYPES ((int)(sizeof(QTYPES) / sizeof(QTYPES[0])))

static const qtype_t *find_qtype(int type) {
    for (int i = 0; i < N_QTYPES; i++)
        if (QTYPES[i].type == type) return &QTYPES[i];
    return NULL;
}

/* ------------------------------------------------------------------ ISA tables and dispatch */

static const isa_kernels ISA_SCALAR = {
    "scalar",
    {dot_q4_0_ref, dot_q5_0_ref, dot_q8_0_ref, dot_q4_K_ref, dot_q6_K_ref},
    {NULL, NULL, NULL, NULL, NULL},
    {0, 0, 0, 0, 0},
    quantize_row_q8_0, quantize_row_q8_K, lane_corr,
    attn_scores_ref, attn_values_ref, 0,
};
extern const isa_kernels knot_isa_avx2, knot_isa_avx512;  /* simd_avx2.c, simd_avx512.c */

static const isa_kernels *const ISAS[] = {&ISA_SCALAR, &knot_isa_avx2, &knot_isa_avx512};  /* worst to best */
#define N_ISAS ((int)(sizeof(ISAS) / sizeof(ISAS[0])))

static const isa_kernels *_Atomic isa_current = &ISA_SCALAR;

/* compiled in, and this CPU (and its OS: __builtin_cpu_supports checks XCR0) runs it */
static int isa_runs(const isa_kernels *isa) {
    if (!isa->name) return 0;
    if (isa == &ISA_SCALAR) return 1;
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    /* fma: attention's float64 sums (every AVX2 CPU has it) */
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
    if (isa == &knot_isa_avx2) return avx2;
    if (isa == &knot_isa_avx512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
               && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

/* ------------------------------------------------------------------ matmul */

typedef struct {
    const float *x;
    act_t a;
    int ne0, act_k;
    const isa_kernels *isa;
    int corr_offset;  /* > 0: fill a.corr for the VNNI legacy kernels (corr lanes, or u where a.u) */
    int rows_per_task;
} quant_ctx;

static void quant_task(void *vctx, int task) {  /* one task = rows_per_task activation rows */
    const quant_ctx *c = vctx;
    const int nblk = c->ne0 / (c->act_k ? QK_K : QK);
    for (int t = task * c->rows_per_task, end = t + c->rows_per_task; t < end; t++) {
        const float *x = c->x + (size_t)t * c->ne0;
        int8_t *qs = c->a.qs + (size_t)t * c->ne0;
        float *d = c->a.d + (size_t)t * nblk;
        if (c->act_k) c->isa->quantize_q8_K(x, qs, d, c->a.bsums + (size_t)t * q8k_aux_per_row(c->ne0), c->ne0);
        else c->isa->quantize_q8_0(x, qs, d, c->ne0);
        if (c->a.u) act_u8(qs, (uint8_t *)c->a.corr + (size_t)t * c->ne0, c->ne0);  /* corr: ne0 bytes a token */
        else if (c->corr_offset) c->isa->lane_corr(qs, c->a.corr + (size_t)t * (c->ne0 / 4), c->ne0, c->corr_offset);
    }
}

typedef struct {
    dot_fn dot;
    dotn_fn dotn;
    dot2_fn dot2;  /* T = 1: two rows a pass, or NULL */
    const uint8_t *w;
    size_t row_bytes;
    int ne0, ne1, nb, T;
    act_t a;
    float *y;
    int rows_per_task, tok_tile, dotn_max;
} mm_ctx;

static inline const void *act_aux(const mm_ctx *c, int t) {  /* token t's bsums, corr lanes or u */
    return c->a.bsums ? (const void *)(c->a.bsums + (size_t)t * q8k_aux_per_row(c->ne0))
         : c->a.corr ? (const void *)(c->a.corr + (size_t)t * (c->ne0 / 4)) : NULL;
}

static void mm_task(void *vctx, int task) {  /* one task = rows_per_task rows of W, all tokens */
    const mm_ctx *c = vctx;
    const int r0 = task * c->rows_per_task;
    const int r1 = r0 + c->rows_per_task < c->ne1 ? r0 + c->rows_per_task : c->ne1;
    if (c->T == 1 && c->dot2) {  /* a decode row: its rows of W two at a time */
        const void *aux = act_aux(c, 0);
        int r = r0;
        for (; r + 2 <= r1; r += 2) c->dot2(c->w + (size_t)r * c->row_bytes, c->row_bytes, c->a.qs, c->a.d, aux, c->nb, c->y + r);
        if (r < r1) c->y[r] = c->dot(c->w + (size_t)r * c->row_bytes, c->a.qs, c->a.d, aux, c->nb);
        return;
    }
    const toks_t tk0 = {c->a.qs, c->a.dT, act_aux(c, 0), (size_t)c->ne0, (size_t)c->T,
                        c->a.bsums ? q8k_aux_per_row(c->ne0) : (size_t)(c->ne0 / 4)};
    for (int t0 = 0; t0 < c->T; t0 += c->tok_tile) {
        const int t1 = t0 + c->tok_tile < c->T ? t0 + c->tok_tile : c->T;
        for (int r = r0; r < r1; r++) {
            const uint8_t *wr = c->w + (size_t)r * c->row_bytes;
            int t = t0;
            /* up to dotn_max tokens per pass over the row; a last single token too where the
             * activations hold u, which dot() does not read */
            while (c->dotn && t1 - t >= (c->a.u ? 1 : 2)) {
                const int n = t1 - t >= c->dotn_max ? c->dotn_max : t1 - t;
                toks_t tk = tk0;
                tk.q += (size_t)t * tk.q_stride;
                tk.d += t;  /* block-major: token t's scales are column t */
                tk.aux = act_aux(c, t);
                float out[DOTN_MAX];
                c->dotn(wr, tk, c->nb, n, out);
                for (int i = 0; i < n; i++) c->y[(size_t)(t + i) * c->ne1 + r] = out[i];
                t += n;
            }
            for (; t < t1; t++)
                c->y[(size_t)t * c->ne1 + r] = c->dot(wr, c->a.qs + (size_t)t * c->ne0,
                                                      c->a.d + (size_t)t * c->nb, act_aux(c, t), c->nb);
        }
    }
}

static void act_free(act_t *a) { free(a->qs); free(a->d); free(a->bsums); free(a->corr); free(a->dT); }

/* x (T, ne0) quantized as qt's kernels on isa read it into a (malloc'd; act_free frees it): 0, or -1
 * when out of memory */
static int act_quantize(const qtype_t *qt, const isa_kernels *isa, const float *x, int T, int ne0, int parallel,
                        act_t *out) {
    const int nblk_act = ne0 / (qt->act_k ? QK_K : QK);
    act_t a = {0};
    a.qs = malloc((size_t)T * ne0);
    a.d = malloc((size_t)T * nblk_act * sizeof(float));
    const int corr_offset = isa->corr_offset[qt->k];
    if (qt->act_k) a.bsums = malloc((size_t)T * q8k_aux_per_row(ne0) * sizeof(int16_t));
    if (corr_offset) a.corr = malloc((size_t)T * (ne0 / 4) * sizeof(int32_t));
    if (T >= 2) a.dT = malloc((size_t)T * nblk_act * sizeof(float));  /* the multi-token kernels' (toks_t) */
    a.u = corr_offset && T >= 2 && isa->act_u;
    if (!a.qs || !a.d || (qt->act_k && !a.bsums) || (corr_offset && !a.corr) || (T >= 2 && !a.dT)) {
        act_free(&a);
        return -1;
    }
    quant_ctx qc = {x, a, ne0, qt->act_k, isa, corr_offset, T >= 16 ? 4 : 1};
    const int n_qtasks = T / qc.rows_per_task;
    parallel_for(quant_task, &qc, n_qtasks, parallel && T >= 16);
    quant_ctx rest = qc;
    rest.rows_per_task = 1;
    for (int t = n_qtasks * qc.rows_per_task; t < T; t++) quant_task(&rest, t);  /* remainder rows */
    if (a.dT)  /* the scales block-major */
        for (int t = 0; t < T; t++)
            for (int b = 0; b < nblk_act; b++) a.dT[(size_t)b * T + t] = a.d[(size_t)t * nblk_act + b];
    *out = a;
    return 0;
}

#define DOT2_MAX_ROW_BYTES 2048  /* rows of W up to this long go two a pass at T = 1 (mm_setup) */

/* the product's tasks over W (ne1, ne0) of type qt, activations a: returns how many */
static int mm_setup(mm_ctx *c, const qtype_t *qt, const isa_kernels *isa, const uint8_t *w, act_t a, float *y,
                    int T, int ne0, int ne1) {
    const int nb = ne0 / qt->block_elems;
    const int corr_offset = isa->corr_offset[qt->k];
    *c = (mm_ctx){isa->dot[qt->k], isa->dotn[qt->k], isa->dot2[qt->k], w, (size_t)nb * qt->block_bytes,
                  ne0, ne1, nb, T, a, y, 1, 1, isa->dotn_max > 1 ? isa->dotn_max : 1};
    /* two rows a pass only while the pair's two prefetch leads (KNOT_PF_DIST ahead of each row) are
     * one stream: a longer second row's first lines are never prefetched, and longer rows went
     * slower (docs/lab/2026-12-04-one-token-against-two-weight-rows.md) */
    if (c->row_bytes > DOT2_MAX_ROW_BYTES) c->dot2 = NULL;
    /* tokens per tile: a multiple of dotn_max whose activations (qs, corr lanes) stay in L1 while the
     * task's rows of W go by */
    const size_t act_bytes = (size_t)ne0 * (corr_offset ? 2 : 1) + q8k_aux_per_row(ne0) * 2;
    c->tok_tile = (int)((16u << 10) / act_bytes) / c->dotn_max * c->dotn_max;
    if (c->tok_tile < c->dotn_max) c->tok_tile = c->dotn_max;  /* a pass takes dotn_max tokens whatever L1 holds */
    /* rows per task: about 16 KiB of W, and at least 4 tasks per thread when there are rows */
    int rpt = (int)((16u << 10) / c->row_bytes);
    if (rpt < 1) rpt = 1;
    const int min_tasks = 4 * P.n_threads;
    if (ne1 / rpt < min_tasks) rpt = ne1 / min_tasks > 0 ? ne1 / min_tasks : 1;
    c->rows_per_task = rpt;
    return (ne1 + rpt - 1) / rpt;
}

/* small products cost less than a wake-up of the workers */
#define MM_PARALLEL_MIN (32u << 10)  /* bytes of W times tokens */

/* y (T, ne1) = x (T, ne0) @ W.T; returns 0, or -1 when out of memory */
static int qmatmul(const qtype_t *qt, const isa_kernels *isa, const float *x, const uint8_t *w, float *y,
                   int T, int ne0, int ne1, int parallel) {
    act_t a;
    if (act_quantize(qt, isa, x, T, ne0, parallel, &a)) return -1;
    mm_ctx c;
    const int n_tasks = mm_setup(&c, qt, isa, w, a, y, T, ne0, ne1);
    const int par = parallel && (c.row_bytes * (size_t)ne1 * (size_t)T >= MM_PARALLEL_MIN);
    parallel_for(mm_task, &c, n_tasks, par);
    act_free(&a);
    return 0;
}

/* Several products of one x, y_m = x @ W_m.T (q, k and v of a layer): x quantized once per
 * activation format, and every product's tasks in one parallel_for, one after another. Each y_m
 * is qmatmul's, bit for bit: the same activations and the same dot products per row. */
#define MM_MANY_MAX 8

typedef struct {
    mm_ctx c[MM_MANY_MAX];
    int first[MM_MANY_MAX + 1];  /* product m's tasks are [first[m], first[m + 1]) */
    int n;
} mm_many_ctx;

static void mm_many_task(void *vctx, int task) {
    const mm_many_ctx *c = vctx;
    int m = 0;
    while (task >= c->first[m + 1]) m++;
    mm_task((void *)&c->c[m], task - c->first[m]);
}

static int qmatmul_many(const qtype_t *const *qts, const isa_kernels *isa, const float *x, const uint8_t *const *ws,
                        float *const *ys, int n, int T, int ne0, const int *ne1s, int parallel) {
    act_t acts[MM_MANY_MAX];
    int act_of[MM_MANY_MAX], n_acts = 0, rc = 0;
    mm_many_ctx mc = {.n = n};
    size_t bytes = 0;
    for (int m = 0; m < n && !rc; m++) {
        const qtype_t *qt = qts[m];
        act_of[m] = -1;
        for (int j = 0; j < m; j++)  /* the same activation format as an earlier product: reuse it */
            if (qts[j]->act_k == qt->act_k && isa->corr_offset[qts[j]->k] == isa->corr_offset[qt->k]) act_of[m] = act_of[j];
        if (act_of[m] < 0) {
            if (act_quantize(qt, isa, x, T, ne0, parallel, &acts[n_acts])) { rc = -1; break; }
            act_of[m] = n_acts++;
        }
        mc.first[m + 1] = mc.first[m] + mm_setup(&mc.c[m], qt, isa, ws[m], acts[act_of[m]], ys[m], T, ne0, ne1s[m]);
        bytes += mc.c[m].row_bytes * (size_t)ne1s[m];
    }
    if (!rc) parallel_for(mm_many_task, &mc, mc.first[n], parallel && bytes * (size_t)T >= MM_PARALLEL_MIN);
    for (int j = 0; j < n_acts; j++) act_free(&acts[j]);
    return rc;
}

/* ------------------------------------------------------------------ attention */

/* One kv head's share of attention, its g query heads' rows together: q (n_kv, R, hd),
 * k and v (S, n_kv, hd), p and scores (n_kv, R, S), out (n_kv, R, hd). A task is one kv head
 * and a block of keys (scores) or of rows (values): each output is computed by one thread. */
typedef struct {
    const isa_kernels *isa;
    const float *q, *p;
    kv_ptr kv;  /* keys or values */
    float *scores;
    double *out;
    int n_kv, R, S, hd, per_task, tasks_per_head;
} attn_ctx;

#define ATTN_TASK_KEYS 256  /* keys per scores task */
#define ATTN_TASK_ROWS 4    /* rows per values task */

static void attn_scores_task(void *vctx, int task) {
    const attn_ctx *c = vctx;
    const int h = task / c->tasks_per_head, s0 = task % c->tasks_per_head * c->per_task;
    const int ns = c->S - s0 < c->per_task ? c->S - s0 : c->per_task;
    const size_t ks = (size_t)c->n_kv * c->hd;
    c->isa->attn_scores(c->q + (size_t)h * c->R * c->hd, c->R, kv_add(c->kv, (size_t)s0 * ks + (size_t)h * c->hd), ks,
                        ns, c->hd, c->scores + (size_t)h * c->R * c->S + s0, (size_t)c->S);
}

static void attn_values_task(void *vctx, int task) {
    const attn_ctx *c = vctx;
    const int h = task / c->tasks_per_head, r0 = task % c->tasks_per_head * c->per_task;
    const int nr = c->R - r0 < c->per_task ? c->R - r0 : c->per_task;
    c->isa->attn_values(c->p + ((size_t)h * c->R + r0) * c->S, (size_t)c->S, nr, kv_add(c->kv, (size_t)h * c->hd),
                        (size_t)c->n_kv * c->hd, c->S, c->hd, c->out + ((size_t)h * c->R + r0) * c->hd);
}

/* a product this small (multiply-adds) costs less than waking the workers */
#define ATTN_PARALLEL_MIN (1 << 16)

static void attn_run(task_fn fn, attn_ctx *c, int per_task, int n_per_head, int parallel) {
    c->per_task = per_task;
    c->tasks_per_head = (n_per_head + per_task - 1) / per_task;
    const double work = (double)c->n_kv * c->R * c->S * c->hd;
    parallel_for(fn, c, c->n_kv * c->tasks_per_head, parallel && work >= ATTN_PARALLEL_MIN);
}

/* ------------------------------------------------------------------ Python bindings */

static int get_buf(PyObject *o, Py_buffer *b, int writable, const char *what) {
    if (PyObject_GetBuffer(o, b, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* y (T, ne1) = x (T, ne0) @ W.T for W of type qt: 1 when the shape is one the kernels take, else 0 with a
 * ValueError */
static int product_shape_ok(const qtype_t *qt, int T, int ne0, int ne1) {
    if (T >= 0 && ne0 > 0 && ne1 >= 0 && ne0 % qt->block_elems == 0) return 1;
    PyErr_Format(PyExc_ValueError, "%s: bad shape T=%d ne0=%d ne1=%d (ne0 must be a multiple of %d)", qt->name, T, ne0,
                 ne1, qt->block_elems);
    return 0;
}

/* the same product's buffers: 1 when x, w and y hold its bytes, else 0 with a ValueError naming the one
 * that does not (xlen < 0: x not checked here) */
static int product_bytes_ok(const qtype_t *qt, Py_ssize_t xlen, Py_ssize_t wlen, Py_ssize_t ylen, int T, int ne0,
                            int ne1) {
    const Py_ssize_t row_bytes = (Py_ssize_t)(ne0 / qt->block_elems) * qt->block_bytes;
    if (xlen >= 0 && xlen != (Py_ssize_t)T * ne0 * 4)
        PyErr_Format(PyExc_ValueError, "x: %zd bytes, expected %zd for float32 (%d, %d)", xlen, (Py_ssize_t)T * ne0 * 4, T, ne0);
    else if (wlen != row_bytes * ne1)
        PyErr_Format(PyExc_ValueError, "w: %zd bytes, expected %zd for %s (%d, %d)", wlen, row_bytes * ne1, qt->name, ne1, ne0);
    else if (ylen != (Py_ssize_t)T * ne1 * 4)
        PyErr_Format(PyExc_ValueError, "y: %zd bytes, expected %zd for float32 (%d, %d)", ylen, (Py_ssize_t)T * ne1 * 4, T, ne1);
    else
        return 1;
    return 0;
}

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"ggml_type", "x", "w", "y", "T", "ne0", "ne1", "simd", "parallel", NULL};
    int type, T, ne0, ne1, simd = 1, parallel = 1;
    PyObject *xo, *wo, *yo;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOOiii|pp", kwlist, &type, &xo, &wo, &yo,
                                     &T, &ne0, &ne1, &simd, &parallel))
        return NULL;
    const qtype_t *qt = find_qtype(type);
    if (!qt) return PyErr_Format(PyExc_ValueError, "no kernel for ggml type id %d", type);
    if (!product_shape_ok(qt, T, ne0, ne1)) return NULL;
    Py_buffer xb, wb, yb;
    if (get_buf(xo, &xb, 0, "x")) return NULL;
    if (get_buf(wo, &wb, 0, "w")) { PyBuffer_Release(&xb); return NULL; }
    if (get_buf(yo, &yb, 1, "y")) { PyBuffer_Release(&xb); PyBuffer_Release(&wb); return NULL; }
    PyObject *ret = NULL;
    if (product_bytes_ok(qt, xb.len, wb.len, yb.len, T, ne0, ne1)) {
        int rc = 0;
        if (T > 0 && ne1 > 0) {
            Py_BEGIN_ALLOW_THREADS
            rc = qmatmul(qt, simd ? isa_current : &ISA_SCALAR, xb.buf, wb.buf, yb.buf, T, ne0, ne1, parallel);
            Py_END_ALLOW_THREADS
        }
        if (rc) PyErr_NoMemory();
        else ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); PyBuffer_Release(&yb);
    return ret;
}

/* matmul_many(x, T, ne0, products, simd=True, parallel=True), products a sequence of
 * (ggml_type, w, y, ne1): each y (T, ne1) = x (T, ne0) @ W.T, in one call (qmatmul_many) */
static PyObject *py_matmul_many(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"x", "T", "ne0", "products", "simd", "parallel", NULL};
    int T, ne0, simd = 1, parallel = 1;
    PyObject *xo, *po;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiiO|pp", kwlist, &xo, &T, &ne0, &po, &simd, &parallel)) return NULL;
    PyObject *seq = PySequence_Fast(po, "products must be a sequence of (ggml_type, w, y, ne1)");
    if (!seq) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MM_MANY_MAX || T < 0 || ne0 <= 0) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "matmul_many: %zd products (1 to %d), T=%d ne0=%d", n, MM_MANY_MAX, T, ne0);
    }
    const qtype_t *qts[MM_MANY_MAX];
    const uint8_t *ws[MM_MANY_MAX];
    float *ys[MM_MANY_MAX];
    int ne1s[MM_MANY_MAX];
    Py_buffer xb, wb[MM_MANY_MAX], yb[MM_MANY_MAX];
    int n_w = 0, n_y = 0, have_x = 0;
    PyObject *ret = NULL;
    if (get_buf(xo, &xb, 0, "x")) goto done;
    have_x = 1;
    for (Py_ssize_t m = 0; m < n; m++) {
        int type;
        PyObject *wo, *yo;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, m), "iOOi", &type, &wo, &yo, &ne1s[m])) goto done;
        const qtype_t *qt = qts[m] = find_qtype(type);
        if (!qt) { PyErr_Format(PyExc_ValueError, "no kernel for ggml type id %d", type); goto done; }
        if (!product_shape_ok(qt, T, ne0, ne1s[m])) goto done;
        if (get_buf(wo, &wb[n_w], 0, "w")) goto done;
        n_w++;
        if (get_buf(yo, &yb[n_y], 1, "y")) goto done;
        n_y++;
        if (!product_bytes_ok(qt, m ? -1 : xb.len, wb[m].len, yb[m].len, T, ne0, ne1s[m])) goto done;
        ws[m] = wb[m].buf;
        ys[m] = yb[m].buf;
    }
    int rc = 0;
    if (T > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = qmatmul_many(qts, simd ? isa_current : &ISA_SCALAR, xb.buf, ws, ys, (int)n, T, ne0, ne1s, parallel);
        Py_END_ALLOW_THREADS
    }
    if (rc) PyErr_NoMemory();
    else ret = Py_NewRef(Py_None);
done:
    if (have_x) PyBuffer_Release(&xb);
    for (int i = 0; i < n_w; i++) PyBuffer_Release(&wb[i]);
    for (int i = 0; i < n_y; i++) PyBuffer_Release(&yb[i]);
    Py_DECREF(seq);
    return ret;
}

static int attn_buffers(PyObject *const *objs, Py_buffer *bufs, const char *const *names, const int *writable,
                        const Py_ssize_t *expect, int n) {
    for (int i = 0; i < n; i++) {
        if (get_buf(objs[i], &bufs[i], writable[i], names[i])) {
            while (i--) PyBuffer_Release(&bufs[i]);
            return -1;
        }
    }
    for (int i = 0; i < n; i++) {
        if (bufs[i].len != expect[i]) {
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", names[i], bufs[i].len, expect[i]);
            for (int j = 0; j < n; j++) PyBuffer_Release(&bufs[j]);
            return -1;
        }
    }
    return 0;
}

static int attn_shape_ok(int n_kv, int R, int S, int hd) {
    if (n_kv < 1 || R < 0 || S < 0 || hd < ATTN_HD_ALIGN || hd > ATTN_MAX_HD || hd % ATTN_HD_ALIGN) {
        PyErr_Format(PyExc_ValueError, "attention: bad shape n_kv=%d R=%d S=%d hd=%d (hd must be a multiple "
                     "of %d, at most %d)", n_kv, R, S, hd, ATTN_HD_ALIGN, ATTN_MAX_HD);
        return 0;
    }
    return 1;
}

/* attn_scores(q f32 (n_kv, R, hd), k (S, n_kv, hd), out f32 (n_kv, R, S), n_kv, R, S, hd) and
 * attn_values(p f32 (n_kv, R, S), v (S, n_kv, hd), out f64 (n_kv, R, hd) +=, n_kv, R, S, hd):
 * k and v float32, or f16 with kv_f16 */
static PyObject *attn_call(PyObject *args, PyObject *kw, int values) {
    static char *kwlist[] = {"a", "kv", "out", "n_kv", "R", "S", "hd", "simd", "parallel", "kv_f16", NULL};
    int n_kv, R, S, hd, simd = 1, parallel = 1, kv_f16 = 0;
    PyObject *objs[3];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOiiii|ppp", kwlist, &objs[0], &objs[1], &objs[2],
                                     &n_kv, &R, &S, &hd, &simd, &parallel, &kv_f16)) return NULL;
    if (!attn_shape_ok(n_kv, R, S, hd)) return NULL;
    static const char *const names[2][3] = {{"q", "k", "out"}, {"p", "v", "out"}};
    static const int writable[] = {0, 0, 1};
    const Py_ssize_t kv_bytes = (Py_ssize_t)S * n_kv * hd * (kv_f16 ? 2 : 4);
    const Py_ssize_t expect[2][3] = {{(Py_ssize_t)n_kv * R * hd * 4, kv_bytes, (Py_ssize_t)n_kv * R * S * 4},
                                     {(Py_ssize_t)n_kv * R * S * 4, kv_bytes, (Py_ssize_t)n_kv * R * hd * 8}};
    Py_buffer b[3];
    if (attn_buffers(objs, b, names[values], writable, expect[values], 3)) return NULL;
    attn_ctx c = {simd ? isa_current : &ISA_SCALAR, NULL, NULL, {b[1].buf, kv_f16}, NULL, NULL, n_kv, R, S, hd, 0, 0};
    if (values) { c.p = b[0].buf; c.out = b[2].buf; }
    else { c.q = b[0].buf; c.scores = b[2].buf; }
    if (R && S) {
        Py_BEGIN_ALLOW_THREADS
        if (values) attn_run(attn_values_task, &c, ATTN_TASK_ROWS, R, parallel);
        else attn_run(attn_scores_task, &c, ATTN_TASK_KEYS, S, parallel);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < 3; i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

static PyObject *py_attn_scores(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return attn_call(args, kw, 0); }
static PyObject *py_attn_values(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return attn_call(args, kw, 1); }

/* A sequence's T new rows, each alone over the keys its decode step saw: row t over keys
 * [0, S - T + 1 + t) (common/models/qwen2.py attend_sequence). The numbers are attention()'s of
 * each row on its own (one tile), with its two products in the same kernels: the scores, scaled,
 * masked (k_pos > q_pos: -inf) and less their row's max, go packed into p, row t's (n_head, n_t)
 * block at rows_offset(t); numpy's exp and float64 sums run on them there (the caller), then each
 * row is scaled by 1 / its sum, rounded to f16 and weighs the values. A task is one row and one kv
 * head, its g query heads 16 at a time. */
typedef struct {
    const isa_kernels *isa;
    const float *q;          /* (T, n_head, hd) */
    kv_ptr kv;               /* k or v, (S, n_kv, hd) */
    const int64_t *q_pos, *k_pos;
    float *p;                /* packed scores, then weights */
    const double *sums;      /* (T, n_head) */
    float *out;              /* (T, n_head * hd) */
    int T, S, n_kv, g, hd;
    float scale;
} rows_ctx;

#define ROWS_HEADS 16  /* query heads per kernel call (its stack buffers) */

static inline int rows_keys(const rows_ctx *c, int t) { return c->S - c->T + 1 + t; }

static inline size_t rows_offset(const rows_ctx *c, int t) {  /* n_head * (n_0 + ... + n_{t-1}) */
    return (size_t)c->n_kv * c->g * ((size_t)t * (size_t)(c->S - c->T + 1) + (size_t)t * (size_t)(t - 1) / 2);
}

static void rows_scores_task(void *vctx, int task) {
    const rows_ctx *c = vctx;
    const int t = task / c->n_kv, h = task % c->n_kv, n = rows_keys(c, t), hd = c->hd;
    const int n_head = c->n_kv * c->g;
    const size_t ks = (size_t)c->n_kv * hd;
    float qf[ROWS_HEADS * ATTN_MAX_HD];
    for (int i0 = 0; i0 < c->g; i0 += ROWS_HEADS) {
        const int ni = c->g - i0 < ROWS_HEADS ? c->g - i0 : ROWS_HEADS;
        const int head0 = h * c->g + i0;
        for (int i = 0; i < ni * hd; i++)  /* q rounded to f16, as attention()'s to_f16 */
            qf[i] = round_f16(c->q[((size_t)t * n_head + head0) * hd + i]);
        float *s0 = c->p + rows_offset(c, t) + (size_t)head0 * n;
        c->isa->attn_scores(qf, ni, kv_add(c->kv, (size_t)h * hd), ks, n, hd, s0, (size_t)n);
        for (int i = 0; i < ni; i++) {
            float *s = s0 + (size_t)i * n;
            float m = -INFINITY;
            int nan = 0;
            for (int j = 0; j < n; j++) {  /* _scores: scale, then the mask; softmax_: the max */
                s[j] = c->k_pos[j] > c->q_pos[t] ? -INFINITY : s[j] * c->scale;
                if (s[j] != s[j]) nan = 1;
                else if (s[j] > m) m = s[j];
            }
            if (nan) m = NAN;  /* numpy's max propagates NaN */
            for (int j = 0; j < n; j++) s[j] = s[j] - m;
        }
    }
}

static void rows_values_task(void *vctx, int task) {
    const rows_ctx *c = vctx;
    const int t = task / c->n_kv, h = task % c->n_kv, n = rows_keys(c, t), hd = c->hd;
    const int n_head = c->n_kv * c->g;
    double o[ROWS_HEADS * ATTN_MAX_HD];
    for (int i0 = 0; i0 < c->g; i0 += ROWS_HEADS) {
        const int ni = c->g - i0 < ROWS_HEADS ? c->g - i0 : ROWS_HEADS;
        const int head0 = h * c->g + i0;
        float *p0 = c->p + rows_offset(c, t) + (size_t)head0 * n;
        for (int i = 0; i < ni; i++) {  /* softmax_: x *= float32(1 / sum) */
            const float r = (float)(1.0 / c->sums[(size_t)t * n_head + head0 + i]);
            float *pr = p0 + (size_t)i * n;
            for (int j = 0; j < n; j++) pr[j] = pr[j] * r;
        }
        memset(o, 0, sizeof(double) * (size_t)ni * hd);
        c->isa->attn_values(p0, (size_t)n, ni, kv_add(c->kv, (size_t)h * hd), (size_t)c->n_kv * hd, n, hd, o);
        float *dst = c->out + ((size_t)t * n_head + head0) * hd;
        for (int i = 0; i < ni * hd; i++) dst[i] = (float)o[i];
    }
}

static PyObject *py_attn_rows(PyObject *self, PyObject *args, PyObject *kw, int values) {
    (void)self;
    static char *kwlist[2][15] = {
        {"q", "k", "q_pos", "k_pos", "p", "n_kv", "n_head", "T", "S", "hd", "scale", "simd", "parallel", "kv_f16", NULL},
        {"p", "sums", "v", "out", "n_kv", "n_head", "T", "S", "hd", "simd", "parallel", "kv_f16", NULL}};
    int n_kv, n_head, T, S, hd, simd = 1, parallel = 1, kv_f16 = 0;
    double scale = 1.0;
    PyObject *objs[5] = {NULL};
    int ok = values
        ? PyArg_ParseTupleAndKeywords(args, kw, "OOOOiiiii|ppp", kwlist[1], &objs[0], &objs[1], &objs[2], &objs[3],
                                      &n_kv, &n_head, &T, &S, &hd, &simd, &parallel, &kv_f16)
        : PyArg_ParseTupleAndKeywords(args, kw, "OOOOOiiiiid|ppp", kwlist[0], &objs[0], &objs[1], &objs[2], &objs[3],
                                      &objs[4], &n_kv, &n_head, &T, &S, &hd, &scale, &simd, &parallel, &kv_f16);
    if (!ok) return NULL;
    if (!attn_shape_ok(n_kv, T, S, hd)) return NULL;
    if (T < 1 || S < T || n_head < n_kv || n_head % n_kv)
        return PyErr_Format(PyExc_ValueError, "attention rows: bad shape T=%d S=%d n_head=%d n_kv=%d (1 <= T <= S, "
                            "n_head a multiple of n_kv)", T, S, n_head, n_kv);
    rows_ctx c = {simd ? isa_current : &ISA_SCALAR, NULL, {NULL, kv_f16}, NULL, NULL, NULL, NULL, NULL,
                  T, S, n_kv, n_head / n_kv, hd, (float)scale};
    const Py_ssize_t packed = (Py_ssize_t)rows_offset(&c, T) * 4;
    const Py_ssize_t kv_bytes = (Py_ssize_t)S * n_kv * hd * (kv_f16 ? 2 : 4);
    static const char *const names[2][5] = {{"q", "k", "q_pos", "k_pos", "p"}, {"p", "sums", "v", "out", ""}};
    static const int writable[2][5] = {{0, 0, 0, 0, 1}, {1, 0, 0, 1, 0}};
    const Py_ssize_t expect[2][5] = {
        {(Py_ssize_t)T * n_head * hd * 4, kv_bytes, (Py_ssize_t)T * 8, (Py_ssize_t)S * 8, packed},
        {packed, (Py_ssize_t)T * n_head * 8, kv_bytes, (Py_ssize_t)T * n_head * hd * 4, 0}};
    const int nbuf = values ? 4 : 5;
    Py_buffer b[5];
    if (attn_buffers(objs, b, names[values], writable[values], expect[values], nbuf)) return NULL;
    if (values) { c.p = b[0].buf; c.sums = b[1].buf; c.kv.p = b[2].buf; c.out = b[3].buf; }
    else { c.q = b[0].buf; c.kv.p = b[1].buf; c.q_pos = b[2].buf; c.k_pos = b[3].buf; c.p = b[4].buf; }
    const double work = (double)rows_offset(&c, T) * hd;  /* multiply-adds of each product */
    Py_BEGIN_ALLOW_THREADS
    parallel_for(values ? rows_values_task : rows_scores_task, &c, T * n_kv, parallel && work >= ATTN_PARALLEL_MIN);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < nbuf; i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

static PyObject *py_attn_rows_scores(PyObject *self, PyObject *args, PyObject *kw) { return py_attn_rows(self, args, kw, 0); }
static PyObject *py_attn_rows_values(PyObject *self, PyObject *args, PyObject *kw) { return py_attn_rows(self, args, kw, 1); }

/* ------------------------------------------------------------------ q, k and v after their products */

/* x (N, nh * hd) in place: x + b, then (rope) NeoX RoPE of each head's pairs (i, i + hd/2) by row t's
 * cos and sin (N, hd/2), then (f16) each value rounded to f16. The float32 operations of
 * common.models.qwen2's numpy (x0*c - x1*s, x0*s + x1*c, each product rounded: -ffp-contract=off)
 * in its order, so the bits are numpy's. */
static void qkv_rows(float *x, const float *b, const float *cs, const float *sn, int N, int nh, int hd,
                     int rope, int f16) {
    const int half = hd / 2, w = nh * hd;
    for (int t = 0; t < N; t++) {
        float *row = x + (size_t)t * w;
        for (int j = 0; j < w; j++) row[j] = row[j] + b[j];
        if (rope) {
            const float *c = cs + (size_t)t * half, *s = sn + (size_t)t * half;
            for (int h = 0; h < nh; h++) {
                float *x0 = row + (size_t)h * hd, *x1 = x0 + half;
                for (int i = 0; i < half; i++) {
                    const float a = x0[i], e = x1[i];
                    const float ac = a * c[i], es = e * s[i], as = a * s[i], ec = e * c[i];
                    x0[i] = ac - es;
                    x1[i] = as + ec;
                }
            }
        }
        if (f16)
            for (int j = 0; j < w; j++) row[j] = round_f16(row[j]);
    }
}

/* rope_qkv(q, k, v, bq, bk, bv, cos, sin, N, n_head, n_kv, hd): in place, float32,
 * q (N, n_head * hd) = rope(q + bq); k (N, n_kv * hd) = f16(rope(k + bk)); v = f16(v + bv) */
static PyObject *py_rope_qkv(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[8];
    int N, n_head, n_kv, hd;
    if (!PyArg_ParseTuple(args, "OOOOOOOOiiii", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &N, &n_head, &n_kv, &hd))
        return NULL;
    if (N < 0 || n_head < 1 || n_kv < 1 || hd < 2 || hd % 2)
        return PyErr_Format(PyExc_ValueError, "rope_qkv: bad shape N=%d n_head=%d n_kv=%d hd=%d (hd even)",
                            N, n_head, n_kv, hd);
    static const char *const names[8] = {"q", "k", "v", "bq", "bk", "bv", "cos", "sin"};
    static const int writable[8] = {1, 1, 1, 0, 0, 0, 0, 0};
    const Py_ssize_t qb = (Py_ssize_t)n_head * hd * 4, kb = (Py_ssize_t)n_kv * hd * 4, cb = (Py_ssize_t)N * (hd / 2) * 4;
    const Py_ssize_t expect[8] = {N * qb, N * kb, N * kb, qb, kb, kb, cb, cb};
    Py_buffer b[8];
    if (attn_buffers(objs, b, names, writable, expect, 8)) return NULL;
    qkv_rows(b[0].buf, b[3].buf, b[6].buf, b[7].buf, N, n_head, hd, 1, 0);
    qkv_rows(b[1].buf, b[4].buf, b[6].buf, b[7].buf, N, n_kv, hd, 1, 1);
    qkv_rows(b[2].buf, b[5].buf, NULL, NULL, N, n_kv, hd, 0, 1);
    for (int i = 0; i < 8; i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ rmsnorm */

/* The sum of x[i]^2 over a row in numpy's order: its float64 add.reduce of a contiguous run is a
 * pairwise sum, 8 accumulators up to 128 values, halves (at a multiple of 8) above that
 * (numpy/_core/src/umath/loops_utils.h.src, pairwise_sum). A float32 squared in float64 is exact,
 * so squaring as it sums gives np.square(x.astype(np.float64)).sum(axis=-1)'s bits. */
#define PAIRWISE_SUM(name, TERM)                                                                   \
static double name(const float *x, Py_ssize_t n) {                                                 \
    if (n < 8) {                                                                                   \
        double res = 0.;                                                                           \
        for (Py_ssize_t i = 0; i < n; i++) res += TERM(x[i]);                                      \
        return res;                                                                                \
    }                                                                                              \
    if (n <= 128) {                                                                                \
        double r[8];                                                                               \
        for (int j = 0; j < 8; j++) r[j] = TERM(x[j]);                                             \
        Py_ssize_t i;                                                                              \
        for (i = 8; i < n - (n % 8); i += 8)                                                       \
            for (int j = 0; j < 8; j++) r[j] += TERM(x[i + j]);                                    \
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));          \
        for (; i < n; i++) res += TERM(x[i]);                                                      \
        return res;                                                                                \
    }                                                                                              \
    Py_ssize_t n2 = n / 2;                                                                         \
    n2 -= n2 % 8;                                                                                  \
    return name(x, n2) + name(x + n2, n - n2);                                                     \
}
#define SQUARE_F64(v) ((double)(v) * (double)(v))
#define AS_F64(v) ((double)(v))
PAIRWISE_SUM(pairwise_sum_sq, SQUARE_F64)
/* numpy's x.sum(dtype=np.float64) of a float32 row in its casting buffer (8,192 values, NPY_BUFSIZE):
 * the same pairwise order, over the values cast to float64 */
PAIRWISE_SUM(pairwise_sum_f64, AS_F64)
/* the longest row whose pairwise_sum_f64 is numpy's sum: it casts a float32 row to float64 in
 * buffers of this many values (NPY_BUFSIZE) and sums a longer one buffer by buffer
 * (deploy/kernels ROW_SUMS_MAX) */
#define ROW_SUMS_MAX 8192

/* x (T, d) -> out (T, d), common.models.qwen2.rmsnorm's float operations in its order: the mean of
 * squares in float64, rounded to float32, + eps, sqrt and 1 / it in float32, then (x * scale) * w. */
static void rms_rows(const float *x, const float *w, float *out, Py_ssize_t T, Py_ssize_t d, float eps) {
    for (Py_ssize_t t = 0; t < T; t++, x += d, out += d) {
        const double mean = pairwise_sum_sq(x, d) / (double)d;
        const float scale = 1.0f / sqrtf((float)mean + eps);
        for (Py_ssize_t i = 0; i < d; i++) out[i] = (x[i] * scale) * w[i];
    }
}

/* sum_sq(x): pairwise_sum_sq of a float32 buffer, so that tests can check its order directly
 * (rms_norm's float32 result rarely shows a different order of the float64 sum) */
static PyObject *py_sum_sq(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    if (!PyArg_ParseTuple(args, "O", &xo)) return NULL;
    Py_buffer xb;
    if (get_buf(xo, &xb, 0, "x")) return NULL;
    if (xb.len % 4) {
        PyBuffer_Release(&xb);
        return PyErr_Format(PyExc_ValueError, "sum_sq: x holds %zd bytes, not float32 values", xb.len);
    }
    const double s = pairwise_sum_sq(xb.buf, xb.len / 4);
    PyBuffer_Release(&xb);
    return PyFloat_FromDouble(s);
}

/* rms_norm(x, w, out, T, d, eps): x (T, d), w (d,), out (T, d), float32 buffers */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[3];
    Py_ssize_t T, d;
    double eps;
    if (!PyArg_ParseTuple(args, "OOOnnd", &objs[0], &objs[1], &objs[2], &T, &d, &eps)) return NULL;
    if (T < 0 || d < 1) return PyErr_Format(PyExc_ValueError, "rms_norm: bad shape T=%zd d=%zd", T, d);
    static const char *const names[3] = {"x", "w", "out"};
    static const int writable[3] = {0, 0, 1};
    const Py_ssize_t expect[3] = {T * d * 4, d * 4, T * d * 4};
    Py_buffer b[3];
    if (attn_buffers(objs, b, names, writable, expect, 3)) return NULL;
    const float e = (float)eps;  /* np.float32(eps) */
    rms_rows(b[0].buf, b[1].buf, b[2].buf, T, d, e);
    for (int i = 0; i < 3; i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

/* attn_row_sums(p, sums, T, S, n_head): the float64 sums of attn_rows_scores' packed rows (after the
 * caller's exp), row t's n_head blocks of n_t = S - T + 1 + t values each: sums (T, n_head) f64 =
 * each block's pairwise_sum_f64, numpy's p_t.reshape(n_head, n_t).sum(axis=-1, dtype=np.float64)
 * for blocks up to its 8,192-value buffer (the caller sums longer ones in numpy) */
static PyObject *py_attn_row_sums(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[2];
    int T, S, n_head;
    if (!PyArg_ParseTuple(args, "OOiii", &objs[0], &objs[1], &T, &S, &n_head)) return NULL;
    if (T < 1 || S < T || n_head < 1)
        return PyErr_Format(PyExc_ValueError, "attn_row_sums: bad shape T=%d S=%d n_head=%d (1 <= T <= S)", T, S, n_head);
    /* only the packed layout of attn_rows_scores' p: rows_offset and rows_keys read n_kv * g = n_head */
    const rows_ctx c = {.T = T, .S = S, .n_kv = 1, .g = n_head};
    static const char *const names[2] = {"p", "sums"};
    static const int writable[2] = {0, 1};
    const Py_ssize_t expect[2] = {(Py_ssize_t)rows_offset(&c, T) * 4, (Py_ssize_t)T * n_head * 8};
    Py_buffer b[2];
    if (attn_buffers(objs, b, names, writable, expect, 2)) return NULL;
    const float *p = b[0].buf;
    double *sums = b[1].buf;
    for (int t = 0; t < T; t++) {
        const int n_t = rows_keys(&c, t);
        for (int h = 0; h < n_head; h++, p += n_t) sums[(size_t)t * n_head + h] = pairwise_sum_f64(p, n_t);
    }
    for (int i = 0; i < 2; i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ numpy's exp, from C */

/* np.exp's float32 loop as numpy chose it for this CPU, from ufunc._get_strided_loop (numpy >= 1.24:
 * a "numpy_1.24_ufunc_call_info" capsule; set_exp_loop). Why not libm's expf: numpy's SIMD exp is its
 * own polynomial (scalar expf where the CPU has no AVX2), and the fused calls below must give the
 * bits of the numpy they replace, np.exp included. The layout is numpy's (NEP 43 ArrayMethod). */
typedef int (*np_loop_fn)(void *context, char *const *data, const Py_ssize_t *dims, const Py_ssize_t *strides,
                          void *auxdata);
typedef struct {
    np_loop_fn loop;
    void *context;
    void *auxdata;
    unsigned char requires_pyapi, no_floatingpoint_errors;
} np_call_info;

#define NP_CALL_INFO "numpy_1.24_ufunc_call_info"
static PyObject *np_exp_capsule = NULL;  /* owns the loop's context */
static const np_call_info *np_exp = NULL;

/* out = exp(x), n float32 (out == x: in place, as np.exp(x, out=x)) */
static void exp_f32(const float *x, float *out, size_t n) {
    char *data[2] = {(char *)x, (char *)out};
    const Py_ssize_t dims[1] = {(Py_ssize_t)n}, strides[2] = {4, 4};
    np_exp->loop(np_exp->context, data, dims, strides, np_exp->auxdata);
}

/* set_exp_loop(capsule | None): the loop the fused calls run for exp; None forgets it */
static PyObject *py_set_exp_loop(PyObject *self, PyObject *arg) {
    (void)self;
    if (arg == Py_None) {
        np_exp = NULL;
        Py_CLEAR(np_exp_capsule);
        Py_RETURN_NONE;
    }
    const np_call_info *ci = PyCapsule_GetPointer(arg, NP_CALL_INFO);
    if (!ci) return NULL;
    if (!ci->loop || ci->requires_pyapi)
        return PyErr_Format(PyExc_ValueError, "set_exp_loop: the capsule holds %s", ci->loop ? "a loop that needs the GIL"
                                                                                             : "no loop");
    Py_INCREF(arg);
    Py_XSETREF(np_exp_capsule, arg);
    np_exp = ci;
    Py_RETURN_NONE;
}

/* silu(x, out, n): out = x / (1 + exp(-x)), float32, numpy's operations in common.models.qwen2.silu's
 * order (negate, np.exp, + 1, divide: each correctly rounded but exp, which is numpy's own) */
static PyObject *py_silu(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[2];
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOn", &objs[0], &objs[1], &n)) return NULL;
    if (!np_exp) return PyErr_Format(PyExc_RuntimeError, "silu: no exp loop (set_exp_loop)");
    if (n < 0) return PyErr_Format(PyExc_ValueError, "silu: n=%zd", n);
    static const char *const names[2] = {"x", "out"};
    static const int writable[2] = {0, 1};
    const Py_ssize_t expect[2] = {n * 4, n * 4};
    Py_buffer b[2];
    if (attn_buffers(objs, b, names, writable, expect, 2)) return NULL;
    const float *x = b[0].buf;
    float *out = b[1].buf;
    if (out == x) {
        PyBuffer_Release(&b[0]); PyBuffer_Release(&b[1]);
        return PyErr_Format(PyExc_ValueError, "silu: out must not be x (x is read after exp)");
    }
    for (Py_ssize_t i = 0; i < n; i++) out[i] = -x[i];
    exp_f32(out, out, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) out[i] = x[i] / (1.0f + out[i]);
    PyBuffer_Release(&b[0]); PyBuffer_Release(&b[1]);
    Py_RETURN_NONE;
}

/* A sequence's rows (attn_rows_scores, numpy's exp, attn_row_sums, attn_rows_values) in one call and
 * one pass of tasks: a task is one row and one kv head, whose g heads' scores it computes, exps,
 * sums and weighs the values by, as those four calls do (the same functions, the same bits). */
typedef struct {
    rows_ctx s, v;  /* s reads the keys, v the values; both share p, sums and out */
    double *sums;
} rows_fused_ctx;

static void rows_fused_task(void *vctx, int task) {
    const rows_fused_ctx *c = vctx;
    rows_scores_task((void *)&c->s, task);
    const int t = task / c->s.n_kv, h = task % c->s.n_kv, n = rows_keys(&c->s, t), g = c->s.g;
    float *blk = c->s.p + rows_offset(&c->s, t) + (size_t)h * g * n;  /* the g heads' rows, (g, n) */
    exp_f32(blk, blk, (size_t)g * n);
    for (int i = 0; i < g; i++) c->sums[(size_t)t * c->s.n_kv * g + h * g + i] = pairwise_sum_f64(blk + (size_t)i * n, n);
    rows_values_task((void *)&c->v, task);
}

/* attn_rows(q, k, v, q_pos, k_pos, out, n_kv, n_head, T, S, hd, scale, simd=True, parallel=True, kv_f16=False) */
static PyObject *py_attn_rows_fused(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"q", "k", "v", "q_pos", "k_pos", "out", "n_kv", "n_head", "T", "S", "hd", "scale",
                             "simd", "parallel", "kv_f16", NULL};
    int n_kv, n_head, T, S, hd, simd = 1, parallel = 1, kv_f16 = 0;
    double scale;
    PyObject *objs[6];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOiiiiid|ppp", kwlist, &objs[0], &objs[1], &objs[2], &objs[3],
                                     &objs[4], &objs[5], &n_kv, &n_head, &T, &S, &hd, &scale, &simd, &parallel, &kv_f16))
        return NULL;
    if (!np_exp) return PyErr_Format(PyExc_RuntimeError, "attn_rows: no exp loop (set_exp_loop)");
    if (!attn_shape_ok(n_kv, T, S, hd)) return NULL;
    if (T < 1 || S < T || n_head < n_kv || n_head % n_kv || S > ROW_SUMS_MAX)
        return PyErr_Format(PyExc_ValueError, "attn_rows: bad shape T=%d S=%d n_head=%d n_kv=%d (1 <= T <= S <= %d, "
                            "n_head a multiple of n_kv)", T, S, n_head, n_kv, ROW_SUMS_MAX);
    const isa_kernels *isa = simd ? isa_current : &ISA_SCALAR;
    rows_fused_ctx c = {.s = {isa, NULL, {NULL, kv_f16}, NULL, NULL, NULL, NULL, NULL, T, S, n_kv, n_head / n_kv, hd,
                              (float)scale}};
    const Py_ssize_t kv_bytes = (Py_ssize_t)S * n_kv * hd * (kv_f16 ? 2 : 4);
    static const char *const names[6] = {"q", "k", "v", "q_pos", "k_pos", "out"};
    static const int writable[6] = {0, 0, 0, 0, 0, 1};
    const Py_ssize_t expect[6] = {(Py_ssize_t)T * n_head * hd * 4, kv_bytes, kv_bytes, (Py_ssize_t)T * 8,
                                  (Py_ssize_t)S * 8, (Py_ssize_t)T * n_head * hd * 4};
    Py_buffer b[6];
    if (attn_buffers(objs, b, names, writable, expect, 6)) return NULL;
    float *p = malloc(rows_offset(&c.s, T) * sizeof(float));
    c.sums = malloc((size_t)T * n_head * sizeof(double));
    if (!p || !c.sums) {
        free(p); free(c.sums);
        for (int i = 0; i < 6; i++) PyBuffer_Release(&b[i]);
        return PyErr_NoMemory();
    }
    c.s.q = b[0].buf; c.s.q_pos = b[3].buf; c.s.k_pos = b[4].buf; c.s.p = p; c.s.out = b[5].buf;
    c.v = c.s;
    c.s.kv.p = b[1].buf;
    c.v.kv.p = b[2].buf;
    c.v.sums = c.sums;
    const double work = (double)rows_offset(&c.s, T) * hd;  /* multiply-adds of each product */
    Py_BEGIN_ALLOW_THREADS
    parallel_for(rows_fused_task, &c, T * n_kv, parallel && 2 * work >= ATTN_PARALLEL_MIN);
    Py_END_ALLOW_THREADS
    free(p); free(c.sums);
    for (int i = 0; i < 6; i++) PyBuffer_Release(&b[i]);
    Py_RETURN_NONE;
}

/* quantize(x float32 (T, ne0) buffer, T, ne0, k) -> (qs bytes, d bytes float32, bsums bytes int16 | None);
 * bsums: per super-block the 16 sums of 16 and the 8 sums of 32 (quants.h, act_t) */
static PyObject *py_quantize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    int T, ne0, k, simd = 1;
    if (!PyArg_ParseTuple(args, "Oiip|p", &xo, &T, &ne0, &k, &simd)) return NULL;
    const int blk = k ? QK_K : QK;
    if (T < 0 || ne0 <= 0 || ne0 % blk) return PyErr_Format(PyExc_ValueError, "ne0=%d is not a multiple of %d", ne0, blk);
    Py_buffer xb;
    if (get_buf(xo, &xb, 0, "x")) return NULL;
    if (xb.len != (Py_ssize_t)T * ne0 * 4) {
        PyBuffer_Release(&xb);
        return PyErr_Format(PyExc_ValueError, "x: %zd bytes, expected %zd", xb.len, (Py_ssize_t)T * ne0 * 4);
    }
    PyObject *qs = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)T * ne0);
    PyObject *d = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)T * (ne0 / blk) * 4);
    PyObject *bs = k ? PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(T * q8k_aux_per_row(ne0) * 2)) : Py_NewRef(Py_None);
    if (!qs || !d || !bs) { Py_XDECREF(qs); Py_XDECREF(d); Py_XDECREF(bs); PyBuffer_Release(&xb); return NULL; }
    quant_ctx c = {xb.buf, {(int8_t *)PyBytes_AS_STRING(qs), (float *)PyBytes_AS_STRING(d),
                            k ? (int16_t *)PyBytes_AS_STRING(bs) : NULL, NULL}, ne0, k,
                   simd ? isa_current : &ISA_SCALAR, 0, T};
    if (T) quant_task(&c, 0);
    PyBuffer_Release(&xb);
    return Py_BuildValue("(NNN)", qs, d, bs);
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    double spin_us = -1;
    if (!PyArg_ParseTuple(args, "i|d", &n, &spin_us)) return NULL;
    if (n < 1 || n > MAX_THREADS) return PyErr_Format(PyExc_ValueError, "threads must be in [1, %d], got %d", MAX_THREADS, n);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&P.busy);
    if (P.pid == getpid()) pool_stop();
    P.n_threads = n;
    if (spin_us >= 0) P.spin_ns = (long)(spin_us * 1000.0);
    pthread_mutex_unlock(&P.busy);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_get_threads(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromLong(P.n_threads);
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int i = 0; i < N_ISAS; i++) {
        if (!ISAS[i]->name || strcmp(ISAS[i]->name, name)) continue;
        if (!isa_runs(ISAS[i])) return PyErr_Format(PyExc_ValueError, "ISA %s: this CPU does not run it", name);
        isa_current = ISAS[i];
        Py_RETURN_NONE;
    }
    return PyErr_Format(PyExc_ValueError, "ISA %s: not compiled in (have: scalar%s%s)", name,
                        knot_isa_avx2.name ? ", avx2" : "", knot_isa_avx512.name ? ", avx512" : "");
}

static PyObject *py_get_isa(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyUnicode_FromString(isa_current->name);
}

static PyMethodDef methods[] = {
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS,
     "matmul(ggml_type, x, w, y, T, ne0, ne1, simd=True, parallel=True): y (T, ne1) = x (T, ne0) @ W.T"},
    {"matmul_many", (PyCFunction)(void (*)(void))py_matmul_many, METH_VARARGS | METH_KEYWORDS,
     "matmul_many(x, T, ne0, products, simd=True, parallel=True), products of (ggml_type, w, y, ne1): each "
     "y (T, ne1) = x (T, ne0) @ W.T, x quantized once per activation format, one parallel pass"},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(x, T, ne0, k, simd=True) -> (qs, d, bsums|None): the Q8_0 (k false) or Q8_K activation"},
    {"attn_scores", (PyCFunction)(void (*)(void))py_attn_scores, METH_VARARGS | METH_KEYWORDS,
     "attn_scores(q, k, out, n_kv, R, S, hd, simd=True, parallel=True, kv_f16=False): out (n_kv, R, S) f32 = q (n_kv, R, hd) . "
     "k (S, n_kv, hd), float64 sums in attn.h's order"},
    {"attn_values", (PyCFunction)(void (*)(void))py_attn_values, METH_VARARGS | METH_KEYWORDS,
     "attn_values(p, v, out, n_kv, R, S, hd, simd=True, parallel=True, kv_f16=False): out (n_kv, R, hd) f64 += f16(p) (n_kv, R, S) "
     "@ v (S, n_kv, hd)"},
    {"attn_rows_scores", (PyCFunction)(void (*)(void))py_attn_rows_scores, METH_VARARGS | METH_KEYWORDS,
     "attn_rows_scores(q, k, q_pos, k_pos, p, n_kv, n_head, T, S, hd, scale, simd=True, parallel=True, kv_f16=False): "
     "row t of q (T, n_head, hd) over keys [0, S - T + 1 + t) of k (S, n_kv, hd): p, packed, = its scaled, masked "
     "scores less their max"},
    {"attn_rows_values", (PyCFunction)(void (*)(void))py_attn_rows_values, METH_VARARGS | METH_KEYWORDS,
     "attn_rows_values(p, sums, v, out, n_kv, n_head, T, S, hd, simd=True, parallel=True, kv_f16=False): "
     "out (T, n_head * hd) f32 = f16(p / sums) @ v, p as attn_rows_scores packed it, after exp"},
    {"rope_qkv", py_rope_qkv, METH_VARARGS,
     "rope_qkv(q, k, v, bq, bk, bv, cos, sin, N, n_head, n_kv, hd): in place, q = rope(q + bq), "
     "k = f16(rope(k + bk)), v = f16(v + bv), float32"},
    {"attn_row_sums", py_attn_row_sums, METH_VARARGS,
     "attn_row_sums(p, sums, T, S, n_head): each packed row block's float64 sum, numpy's pairwise order"},
    {"set_exp_loop", py_set_exp_loop, METH_O,
     "set_exp_loop(capsule | None): np.exp's float32 loop (ufunc._get_strided_loop's call info) for silu and attn_rows"},
    {"silu", py_silu, METH_VARARGS, "silu(x, out, n): out = x / (1 + exp(-x)), float32, numpy's bits (exp: set_exp_loop)"},
    {"attn_rows", (PyCFunction)(void (*)(void))py_attn_rows_fused, METH_VARARGS | METH_KEYWORDS,
     "attn_rows(q, k, v, q_pos, k_pos, out, n_kv, n_head, T, S, hd, scale, simd=True, parallel=True, kv_f16=False): "
     "attn_rows_scores, np.exp, attn_row_sums and attn_rows_values in one call, out (T, n_head * hd) f32"},
    {"sum_sq", py_sum_sq, METH_VARARGS, "sum_sq(x): float64 sum of a float32 buffer's squares, in numpy's pairwise order"},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x, w, out, T, d, eps): out = common.models.qwen2.rmsnorm(x, w, eps), float32, numpy's bits"},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n, spin_us=-1): threads per matmul, caller included"},
    {"get_threads", py_get_threads, METH_NOARGS, "threads per matmul, caller included"},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa(name): the kernels matmul(simd=True) runs, one of ISAS"},
    {"get_isa", py_get_isa, METH_NOARGS, "the name of the kernels matmul(simd=True) runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qmatmul", "Quantized matmul kernels (ggml blocks).", -1,
                                     methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__qmatmul(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *types = PyDict_New();
    for (int i = 0; i < N_QTYPES; i++) {
        PyObject *v = PyLong_FromLong(QTYPES[i].type);
        PyDict_SetItemString(types, QTYPES[i].name, v);
        Py_DECREF(v);
    }
    PyModule_AddObject(m, "TYPES", types);  /* name -> ggml type id */
    /* ISAS: the kernel tables this build has and this CPU runs, worst to best; the best is current */
    PyObject *isas = PyTuple_New(0);
    for (int i = 0; i < N_ISAS; i++) {
        if (!isa_runs(ISAS[i])) continue;
        PyObject *name = PyUnicode_FromString(ISAS[i]->name);
        if (_PyTuple_Resize(&isas, PyTuple_GET_SIZE(isas) + 1)) { Py_DECREF(name); Py_DECREF(m); return NULL; }
        PyTuple_SET_ITEM(isas, PyTuple_GET_SIZE(isas) - 1, name);
        isa_current = ISAS[i];
    }
    PyModule_AddObject(m, "ISAS", isas);
    /* the baseline the module itself was compiled for: x86-64 unless KNOT_KERNELS_MARCH raised it */
    PyModule_AddIntConstant(m, "BASELINE_AVX2", HAVE_AVX2);
    static int forked_hook = 0;
    if (!forked_hook) { pthread_atfork(NULL, NULL, after_fork_child); forked_hook = 1; }
    return m;
}
