/* The AVX2 kernels (quants_avx2.h) with AVX-512 VL/BW/VNNI on 32-byte vectors: vpdpbusd for
 * the legacy types. Only these functions carry the target (see simd_avx2.c). */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC target("avx2,f16c,fma,avx512f,avx512vl,avx512bw,avx512vnni")
#endif
#define KNOT_ISA knot_isa_avx512
#define KNOT_ISA_NAME "avx512"
#include "quants_avx2.h"
