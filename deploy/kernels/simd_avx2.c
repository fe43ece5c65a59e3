/* The AVX2 kernels (quants_avx2.h) for CPUs with AVX2, F16C and FMA. Only these functions carry the
 * target: the extension is built for the baseline x86-64, and _qmatmul.c calls this table only
 * when the CPU has the instructions (__builtin_cpu_supports), so one build runs on any x86-64. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC target("avx2,f16c,fma")
#endif
#define KNOT_ISA knot_isa_avx2
#define KNOT_ISA_NAME "avx2"
#include "quants_avx2.h"
