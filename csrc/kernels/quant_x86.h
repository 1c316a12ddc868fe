/* What the x86 levels of quant.c share (quant_avx2.c, quant_avx512.c): scalar and 256-bit
 * helpers, compiled for AVX2 + FMA + F16C, which inline into either level (the AVX-512 level's
 * target includes these features), and the form of their fma_loop. Included on x86 only. */
#ifndef LLAISYS_KERNELS_QUANT_X86_H
#define LLAISYS_KERNELS_QUANT_X86_H

#include <immintrin.h>

#include "quant.h"

#define LQ_X86_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

LQ_X86_INLINE float half(lq_half h) { return _cvtsh_ss(h); }

/* Ask for the weight bytes a few rows ahead of [p, p + n): at M = 1 the kernels stream weights
 * at close to memory speed, and the hardware prefetcher alone leaves ~10% on the table (the
 * decoders too: without it, decoding the 30 MB output head took 1.5x as long). */
LQ_X86_INLINE void prefetch_ahead(const void *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + LQ_PREFETCH_BYTES + i, _MM_HINT_T0);
}

/* q - 32 as 32 int8 for the elements 128h + 32t .. +31 of a q6_K super-block, in element order:
 * their low 4 bits are the low (t < 2) or high nibbles of ql[64h + 32(t & 1) ..] and their top
 * 2 bits the pair t of qh[32h ..], worked out on all 32 bytes at once. (16-bit shifts carry
 * bits across bytes only into positions the masks clear.) */
LQ_X86_INLINE __m256i q6_codes(const block_q6_K *b, int h, int t) {
    const __m256i l = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32 * (t & 1)));
    const __m256i hq = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
    const __m256i low = _mm256_and_si256(t < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(0x0f));
    const __m256i top = t < 2 ? _mm256_slli_epi16(hq, 4 - 2 * t) : _mm256_srli_epi16(hq, 2 * t - 4);
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(top, _mm256_set1_epi8(0x30))), _mm256_set1_epi8(32));
}

/* out[i] = add(shuffle(in[2i], in[2i+1], lo), shuffle(in[2i], in[2i+1], hi)) for i < n: one
 * halving step of a level's lane-sum tree (reduce8, reduce16), each pair of vectors folded
 * into one by adding two of their interleavings (shuffle takes an immediate, hence a macro). */
#define LQ_TREE_STEP(out, in, n, add, shuffle, lo, hi)                                                             \
    for (int i_ = 0; i_ < (n); i_++)                                                                               \
        (out)[i_] = add(shuffle((in)[2 * i_], (in)[2 * i_ + 1], lo), shuffle((in)[2 * i_], (in)[2 * i_ + 1], hi))

/* A level's fma_loop (quant.h) on vectors of `bits` bits (256 or 512: the intrinsics are named
 * after it), `attr` its target attribute; returns reduce(the sum of the chains). */
#define LQ_FMA_LOOP(attr, bits, reduce)                                                                            \
    static attr float fma_loop(size_t rounds) {                                                                    \
        __m##bits a[LQ_FMA_CHAINS];                                                                                \
        const __m##bits b = _mm##bits##_set1_ps(0.999f), c = _mm##bits##_set1_ps(1e-3f);                           \
        for (int i = 0; i < LQ_FMA_CHAINS; i++) a[i] = _mm##bits##_set1_ps((float)i);                              \
        for (size_t r = 0; r < rounds; r++)                                                                        \
            for (int i = 0; i < LQ_FMA_CHAINS; i++) a[i] = _mm##bits##_fmadd_ps(a[i], b, c);                       \
        __m##bits s = a[0];                                                                                        \
        for (int i = 1; i < LQ_FMA_CHAINS; i++) s = _mm##bits##_add_ps(s, a[i]);                                   \
        return reduce(s);                                                                                          \
    }

#endif
