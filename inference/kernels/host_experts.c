/* Routed experts on the CPU, from their stored bytes: MXFP4 or FP8 weights times dequantised E4M3
 * activations, exact products, fp32 sums. host_experts.py builds this file (gcc -O3 -shared -fPIC, once per
 * variant, cached) and keeps the torch version it must agree with; the numbers are explained there.
 *
 * One variant per build, chosen by the compiler flags: AVX-512 (F, BW), AVX2 + FMA, or portable C. Each runs
 * a list of jobs (one projection of one expert on its tokens) split into chunks of CHUNK weight rows, which
 * the calling thread and n_threads - 1 pthreads take in turn from a shared counter.
 *
 * Weights, one expert's projection [N, K]:
 *   fp4: bytes [N, K/2], low nibble = even element, E2M1 code (bit 3 = sign); UE8M0 scales [N, K/32].
 *   fp8: E4M3 bytes [N, K]; UE8M0 scales [ceil(N/32), K/32], one per 32 x 32 block.
 * Activations x [M, K] fp32 (act_quant's q * s, exact; he_act_quant makes them) in the order the weights
 * unpack in: fp8 as is; fp4 each 32-block as its 16 even elements then its 16 odd ones (portable C), on
 * AVX-512 each 128 as [8, 16], K padded to 128, on AVX2 each 32 as [4, 2, 4] (see the two tile_fp4). Scale
 * byte e means 2^(e - 127); byte 0 is 2^-127. K is a multiple of 32; E4M3 NaN codes (0x7F, 0xFF) are not
 * expected (checkpoints have none).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BLK 32   /* elements per scale block along K */
#define CHUNK 256 /* weight rows per work item: whole FP8 scale rows (32), and long for the prefetch */

#if defined(__AVX512F__)
#include <immintrin.h>
#define VARIANT "avx512"  /* F and BW */
#define WIDTH 16
#define ROWS 4 /* rows x tokens held in registers per tile: 16 accumulators */
#define TOKS 4
#define FP4_TOKS TOKS
#define FP8_TOKS TOKS
#define FP4_ORDER 2 /* the activation order of its MXFP4 tiles (he_act_quant) */
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vsum(a) _mm512_reduce_add_ps(a)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VARIANT "avx2"
#define WIDTH 8
#define ROWS 2 /* 16 ymm registers: 4 accumulators, 8 weight vectors */
#define TOKS 2
#define FP4_TOKS 4 /* tile_fp4: 8 accumulators; a block's 4 decoded vectors feed 16 FMAs */
#define FP8_TOKS 4 /* tile: 2 rows' 4 decoded vectors feed 4 tokens (a batch of 4 decodes each weight once) */
#define FP4_ORDER 3 /* tile_fp4; one token may come in order 4 (tile_fp4_pairs) */
#define PAIR_ROWS ROWS /* tile_fp4_pairs: 4 rows spill sums (Zen 3: 8 % slower) */
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define VARIANT "scalar"
#define WIDTH 1
#define ROWS 4
#define TOKS 1
#define FP4_TOKS TOKS
#define FP8_TOKS TOKS
#define FP4_ORDER 1
typedef float vec;
#define vzero() 0.0f
#define vload(p) (*(p))
#define vfma(a, b, c) ((a) * (b) + (c))
#define vsum(a) (a)
#endif


#if defined(__AVX2__)
static inline float vsum256(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#define PARTS (BLK / WIDTH) /* vectors per 32-block */

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float bits_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* UE8M0 byte -> 2^(e - 127) (byte 0: the subnormal 2^-127, byte 255: inf, as quant.ue8m0_to_float). */
static inline float ue8m0(uint8_t e) {
    return e ? bits_float((uint32_t)e << 23) : bits_float(1u << 22);
}

/* ---- one 32-block of one weight row -> PARTS vectors of its exact fp32 values ---- */

#if WIDTH == 1
/* fp4 (the portable build; AVX-512 and AVX2 have tile_fp4): the 16 bytes of the block at p, scale byte e;
   out in the activation order (even elements first) */
static inline void decode_fp4(const uint8_t *p, uint8_t e, vec out[PARTS]) {
    float sc = ue8m0(e);
    for (int i = 0; i < 16; i++) {
        out[i] = E2M1[p[i] & 15] * sc;
        out[16 + i] = E2M1[p[i] >> 4] * sc;
    }
}
#endif

/* fp8: the 32 bytes of the block at p, scale byte e. An E4M3 code's magnitude bits placed at fp32 bits
   20..26 read as its value times 2^-120 (subnormal codes included: they land on fp32 subnormals), and the
   sign at bit 31; times 2^(e - 7) that is the value times the scale, in one exact multiply. Scales from
   2^8 up (e >= 135) do not fit 2^(e - 7): two multiplies, as the torch version does. */
static inline void decode_fp8(const uint8_t *p, uint8_t e, vec out[PARTS]) {
    float f1 = e < 135 ? bits_float((uint32_t)(e + 120) << 23) : bits_float(247u << 23);
    float f2 = e < 135 ? 1.0f : ue8m0(e);
#if WIDTH > 1
    for (int q = 0; q < PARTS; q++) {
#if WIDTH == 16
        __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * q)));
        /* sign-extended byte << 20: bits 20..26 = magnitude, 27..31 = copies of the sign -> keep bit 31 */
        v = _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32((int)0x87F00000u));
        __m512 w = _mm512_mul_ps(_mm512_castsi512_ps(v), _mm512_set1_ps(f1));
        out[q] = f2 == 1.0f ? w : _mm512_mul_ps(w, _mm512_set1_ps(f2));
#else
        __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * q)));
        v = _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32((int)0x87F00000u));
        __m256 w = _mm256_mul_ps(_mm256_castsi256_ps(v), _mm256_set1_ps(f1));
        out[q] = f2 == 1.0f ? w : _mm256_mul_ps(w, _mm256_set1_ps(f2));
#endif
    }
#else
    for (int i = 0; i < BLK; i++) {
        uint32_t b = (uint32_t)(int32_t)(int8_t)p[i];
        out[i] = bits_float((b << 20) & 0x87F00000u) * f1 * f2;
    }
#endif
}

/* ---- a tile: R weight rows x T tokens, over all of K ---- */

typedef struct {
    const uint8_t *w, *s; /* this job's weight and scale bytes */
    const float *x;       /* [m, K] activations */
    float *y;             /* [m, ldy] outputs (this projection's columns) */
    int64_t n, m, ldy;
    int x_exp;            /* every |x| < 2^x_exp (he_run sets it for tile_fp8_one) */
} job_t;

static inline __attribute__((always_inline)) void tile(const job_t *j, int64_t k, int fp4, int64_t r0,
                                                       int64_t t0, const int R, const int T) {
    const int64_t kb_n = k / BLK;
    vec acc[ROWS * 2][FP8_TOKS > TOKS ? FP8_TOKS : TOKS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = vzero();
    for (int64_t kb = 0; kb < kb_n; kb++) {
        vec wv[ROWS * 2][PARTS];
        for (int r = 0; r < R; r++) {
            int64_t row = r0 + r;
            const int64_t row_bytes = fp4 ? k / 2 : k, block_bytes = fp4 ? 16 : BLK;
#if WIDTH == 1
            if (fp4)
                decode_fp4(j->w + row * (k / 2) + kb * 16, j->s[row * kb_n + kb], wv[r]);
            else
#endif
                decode_fp8(j->w + row * k + kb * BLK, j->s[(row / BLK) * kb_n + kb], wv[r]);
#if WIDTH > 1 /* the tile after next, in step (as tile_fp4 does) */
            __builtin_prefetch(j->w + (row + 2 * R) * row_bytes + kb * block_bytes);
#endif
        }
        for (int t = 0; t < T; t++) {
            const float *xp = j->x + (t0 + t) * k + kb * BLK;
            for (int q = 0; q < PARTS; q++) {
                vec xv = vload(xp + q * WIDTH);
                for (int r = 0; r < R; r++) acc[r][t] = vfma(wv[r][q], xv, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) j->y[(t0 + t) * j->ldy + r0 + r] = vsum(acc[r][t]);
}

#if WIDTH == 16
/* AVX-512 MXFP4 works on groups of 4 blocks (64 bytes, 128 elements, one load): dword d of the load holds
   elements 8d .. 8d + 7 as nibbles, so nibble q of every dword (the load shifted right by 4q; vpermps reads
   the low 4 bits) is the vector of elements 8d + q, d = 0..15, whose lanes 4b .. 4b + 3 lie in block b.
   The activations come in that order (host_experts.py: each 128 as [8, 16], K padded with zeros to a
   multiple of 128, kx columns). A row's 4 scales, one per 4 lanes, multiply the weights (or, for one
   token, the row's 8 partial sums once: exact, a power of two). */

/* the scale bytes of blocks 0 .. nb - 1 at s -> 2^(e - 127) in lanes 4b .. 4b + 3 (missing blocks: byte 0,
   times zero weights) */
static inline __m512 scales16(const uint8_t *s, int nb) {
    uint32_t b = 0;
    if (nb == 4)
        memcpy(&b, s, 4); /* one load (a memcpy of a variable size would be a call) */
    else
        for (int i = 0; i < nb; i++) b |= (uint32_t)s[i] << (8 * i);
    const __m512i spread = _mm512_set_epi32(
        (int)0x80808003u, (int)0x80808003u, (int)0x80808003u, (int)0x80808003u,
        (int)0x80808002u, (int)0x80808002u, (int)0x80808002u, (int)0x80808002u,
        (int)0x80808001u, (int)0x80808001u, (int)0x80808001u, (int)0x80808001u,
        (int)0x80808000u, (int)0x80808000u, (int)0x80808000u, (int)0x80808000u);
    __m512i e = _mm512_shuffle_epi8(_mm512_set1_epi32((int)b), spread);         /* byte b/4 per lane */
    /* e << 23 is 2^(e - 127) as fp32 bits; byte 0 gives 0, raised to 2^-127's bits (below every other) */
    e = _mm512_max_epu32(_mm512_slli_epi32(e, 23), _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(e);
}

static inline __attribute__((always_inline)) void tile_fp4(const job_t *j, int64_t k, int64_t r0,
                                                           int64_t t0, const int R, const int T) {
    const int64_t kb_n = k / BLK, groups = (kb_n + 3) / 4, kx = groups * 128;
    const __m512 tab = _mm512_loadu_ps(E2M1);
    __m512 acc[2 * ROWS][TOKS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        int nb = kb_n - 4 * g < 4 ? (int)(kb_n - 4 * g) : 4;
        __mmask16 lanes = nb == 4 ? (__mmask16)0xFFFF : (__mmask16)((1u << (4 * nb)) - 1);
        __m512i v[2 * ROWS];
        for (int r = 0; r < R; r++) {
            v[r] = _mm512_maskz_loadu_epi32(lanes, j->w + (r0 + r) * (k / 2) + 64 * g);
            /* the next tile's rows, in step: R streams of k/2 bytes are too short for the hardware
               prefetchers to find in time (a prefetch past the end does not fault) */
            _mm_prefetch((const char *)(j->w + (r0 + 2 * R + r) * (k / 2) + 64 * g), _MM_HINT_T0);
            if (g % 16 == 0)
                _mm_prefetch((const char *)(j->s + (r0 + 2 * R + r) * kb_n + 4 * g), _MM_HINT_T0);
        }
        if (T == 1) {
            const float *xp = j->x + t0 * kx + 128 * g;
            __m512 part[2 * ROWS];
            for (int r = 0; r < R; r++) part[r] = _mm512_setzero_ps();
            for (int q = 0; q < 8; q++) {
                __m512 xv = _mm512_loadu_ps(xp + 16 * q);
                for (int r = 0; r < R; r++) {
                    part[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v[r], tab), xv, part[r]);
                    v[r] = _mm512_srli_epi32(v[r], 4);
                }
            }
            for (int r = 0; r < R; r++)
                acc[r][0] = _mm512_fmadd_ps(part[r], scales16(j->s + (r0 + r) * kb_n + 4 * g, nb), acc[r][0]);
        } else {
            __m512 sv[2 * ROWS];
            for (int r = 0; r < R; r++) sv[r] = scales16(j->s + (r0 + r) * kb_n + 4 * g, nb);
            for (int q = 0; q < 8; q++) {
                __m512 w[2 * ROWS];
                for (int r = 0; r < R; r++) {
                    w[r] = _mm512_mul_ps(_mm512_permutexvar_ps(v[r], tab), sv[r]);
                    v[r] = _mm512_srli_epi32(v[r], 4);
                }
                for (int t = 0; t < T; t++) {
                    __m512 xv = _mm512_loadu_ps(j->x + (t0 + t) * kx + 128 * g + 16 * q);
                    for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], xv, acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) j->y[(t0 + t) * j->ldy + r0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}
#elif WIDTH == 8
/* AVX2 MXFP4, no multiply by the scale and no permute in the decode. Every E2M1 value times a UE8M0 scale is
   a bf16 (<= 2 significant bits; bf16 subnormals reach 2^-133, below the smallest, 0.5 x 2^-127): vpshufb
   looks up each code's high and low bf16 byte in the two 16-entry tables of its block's scale byte (sign
   included), vpunpck{l,h}bw pairs them into words, and a bf16 word w is the fp32 w << 16: the even words
   moved up, the odd ones masked in place. Each product is the reference's (weight times scale, then times the
   activation: exact), and nothing multiplies by the scale afterwards. Two ways in:
   - tile_fp4, any number of tokens, a block (16 bytes) at a time: the bytes in both 128-bit lanes, the high
     lane shifted right by 4, so that byte j's low nibble is element 2j's code (low lane) or element 2j + 1's
     (high lane); 3 loads and 10 vector operations give the block's 4 vectors. Vector 2h + i, lane 4p + d
     holds element 16h + 4d + 2i + p: the activations' order 3 (host_experts.py).
   - tile_fp4_pairs, one token (a decode step), two neighbouring blocks A, B at a time: one 32-byte load holds
     A in its low lane and B in the high one, so the low nibbles are the even elements of both and the high
     nibbles (each word shifted right by 4, by a multiply) the odd ones, looked up in one pair of tables per
     two scale bytes, A's in the low lane and B's in the high one (PAIRS): 3 loads and 19 operations for 8
     vectors, 4 shuffles a block instead of 5 (the two shuffle pipes are the limit: Zen 3, a decode tile in
     L2, 4.9 cycles a block against 5.3). Vector 4p + 2h + i, lane 4l + d holds element 16h + 4d + 2i + p of
     block l: order 4 (a last block of an odd count alone, in order 3). With several tokens the pair's tile
     was 9-13 % slower than tile_fp4 (its 8 vectors, tables and sums want more than 16 registers).
   One token keeps two sums per row: one chain of dependent FMAs per row would wait on the FMA's latency
   rather than on the weights; a tile of several tokens has chains enough, and each decoded block feeds the
   FMAs of all of them. */

/* SCALED[e][0][c], SCALED[e][1][c]: the high and low byte of the bf16 E2M1[c] x 2^(e - 127) (ue8m0).
   PAIRS[eA + 256 eB][h]: SCALED[eA][h] and SCALED[eB][h] side by side, the tables of a block pair with scale
   bytes eA, eB (one 16-bit load of the two). 4 MiB, made once, of which a layer reads the lines of the scale
   pairs it holds: a few dozen where its block scales span a few powers of two (trained weights' usually do;
   not yet seen on the released checkpoint). Scales spread over many more read it at random: slower, not
   wrong. */
static uint8_t SCALED[256][2][16];
static uint8_t PAIRS[256 * 256][2][32] __attribute__((aligned(64)));
static pthread_once_t scaled_once = PTHREAD_ONCE_INIT;

static void make_scaled(void) {
    for (int e = 0; e < 256; e++)
        for (int c = 0; c < 16; c++) {
            float v = E2M1[c] * ue8m0((uint8_t)e);
            uint32_t b;
            memcpy(&b, &v, 4); /* the low 16 bits are zero: the product is a bf16 */
            SCALED[e][0][c] = (uint8_t)(b >> 24);
            SCALED[e][1][c] = (uint8_t)(b >> 16);
        }
    for (int i = 0; i < 256 * 256; i++)
        for (int h = 0; h < 2; h++) {
            memcpy(PAIRS[i][h], SCALED[i & 255][h], 16);
            memcpy(PAIRS[i][h] + 16, SCALED[i >> 8][h], 16);
        }
}

/* bf16 words -> the fp32 vectors of the even words (moved up) and of the odd ones (masked in place). For one
   token the even words go up by a multiply by 2^16, not a shift: vpmulld runs beside the shuffles, leaving
   the two pipes that shift and shuffle to the lookups (Zen 3, blocks one at a time: 5.7 -> 5.2 cycles a
   block); the empty asm hides the constant so that the compiler does not turn the multiply back into a shift.
   A tile of several tokens keeps the shift: its FMAs want those pipes (1-2 % slower with the multiply). */
static inline __attribute__((always_inline)) void words_fp32(__m256i b, __m256 *even, __m256 *odd,
                                                             const int by_multiply) {
    __m256i up = _mm256_set1_epi32(1 << 16);
    __asm__("" : "+x"(up));
    *even = _mm256_castsi256_ps(by_multiply ? _mm256_mullo_epi32(b, up) : _mm256_slli_epi32(b, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* the looked-up high and low bytes of 32 codes -> their 4 fp32 vectors: [0], [1] from bytes 0 .. 7 of each
   lane (even, odd words), [2], [3] from bytes 8 .. 15 */
static inline __attribute__((always_inline)) void bf16_vectors(__m256i hi, __m256i lo, __m256 w[4],
                                                               const int by_multiply) {
    words_fp32(_mm256_unpacklo_epi8(lo, hi), &w[0], &w[1], by_multiply);
    words_fp32(_mm256_unpackhi_epi8(lo, hi), &w[2], &w[3], by_multiply);
}

/* the 4 scaled vectors of the block at p, scale byte e: the bytes in both lanes, the high lane shifted right
   by 4, so that byte j's low nibble is element 2j's code (low lane) or element 2j + 1's (high lane) */
static inline __attribute__((always_inline)) void e2m1_block(const uint8_t *p, uint8_t e, __m256 w[4],
                                                             const int by_multiply) {
    const __m256i tab_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)SCALED[e][0]));
    const __m256i tab_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)SCALED[e][1]));
    __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    c = _mm256_and_si256(_mm256_srlv_epi32(c, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                         _mm256_set1_epi8(0x0F));
    bf16_vectors(_mm256_shuffle_epi8(tab_hi, c), _mm256_shuffle_epi8(tab_lo, c), w, by_multiply);
}

/* the two blocks at p (32 bytes), scale bytes at s -> their tables (high, low bytes) and codes;
   bf16_vectors(vpshufb(hi, n), vpshufb(lo, n)) with n = nibbles(c, q) gives vectors 4 q .. 4 q + 3 of the
   pair: q = 0 the low nibbles (even elements), 1 the high ones */
static inline __attribute__((always_inline)) void pair_codes(const uint8_t *p, const uint8_t *s, __m256i *hi,
                                                             __m256i *lo, __m256i *c) {
    uint16_t e2;
    memcpy(&e2, s, 2); /* eA + 256 eB */
    *hi = _mm256_load_si256((const __m256i *)PAIRS[e2][0]);
    *lo = _mm256_load_si256((const __m256i *)PAIRS[e2][1]);
    *c = _mm256_loadu_si256((const __m256i *)p);
}

static inline __attribute__((always_inline)) __m256i nibbles(__m256i c, const int q) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    if (q == 0)
        return _mm256_and_si256(c, low);
    __m256i by16 = _mm256_set1_epi16(1 << 12); /* the high half of x 2^12: a word shifted right by 4 */
    __asm__("" : "+x"(by16));                  /* (kept a multiply, as in words_fp32) */
    return _mm256_and_si256(_mm256_mulhi_epu16(c, by16), low);
}

/* the tile after next (R rows from w, k/2 bytes a row, and their scales), in step with block kb, one line
   (4 blocks, 64 scale bytes) of each row at a time: R streams of k/2 bytes are too short for the hardware
   prefetchers to find in time (past the end: no fault) */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *w, const uint8_t *s,
                                                                 int64_t row_bytes, int64_t kb_n, int64_t kb,
                                                                 const int R) {
    if (kb % 4 == 0)
        for (int r = 0; r < R; r++)
            _mm_prefetch((const char *)(w + (2 * R + r) * row_bytes + 16 * kb), _MM_HINT_T0);
    if (kb % 64 == 0)
        for (int r = 0; r < R; r++)
            _mm_prefetch((const char *)(s + (2 * R + r) * kb_n + kb), _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void tile_fp4(const job_t *j, int64_t k, int64_t r0,
                                                           int64_t t0, const int R, const int T) {
    const int64_t kb_n = k / BLK, row_bytes = k / 2;
    const uint8_t *w = j->w + r0 * row_bytes, *s = j->s + r0 * kb_n;
    const float *x = j->x + t0 * k;
    const int S = T == 1 ? 2 : 1; /* sums per row and token */
    __m256 acc[2 * ROWS][FP4_TOKS][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < kb_n; kb++) {
        prefetch_ahead(w, s, row_bytes, kb_n, kb, R);
        for (int r = 0; r < R; r++) {
            __m256 wv[4];
            e2m1_block(w + r * row_bytes + 16 * kb, s[r * kb_n + kb], wv, T == 1);
            for (int t = 0; t < T; t++)
                for (int q = 0; q < 4; q++)
                    acc[r][t][q % S] = _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(x + t * k + kb * BLK + 8 * q),
                                                       acc[r][t][q % S]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            j->y[(t0 + t) * j->ldy + r0 + r] = vsum(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));
}

/* One token, MXFP4 in pairs (activations in order 4): R rows, two sums per row */
static inline __attribute__((always_inline)) void tile_fp4_pairs(const job_t *j, int64_t k, int64_t r0,
                                                                 const int R) {
    const int64_t kb_n = k / BLK, row_bytes = k / 2;
    const uint8_t *w = j->w + r0 * row_bytes, *s = j->s + r0 * kb_n;
    const float *x = j->x;
    __m256 acc[2 * ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t kb = 0;
    for (; kb + 2 <= kb_n; kb += 2) {
        prefetch_ahead(w, s, row_bytes, kb_n, kb, R);
        for (int r = 0; r < R; r++) {
            __m256i hi, lo, c;
            pair_codes(w + r * row_bytes + 16 * kb, s + r * kb_n + kb, &hi, &lo, &c);
            for (int q = 0; q < 2; q++) { /* the low nibbles (even elements), then the high ones */
                const __m256i n = nibbles(c, q);
                __m256 wv[4];
                bf16_vectors(_mm256_shuffle_epi8(hi, n), _mm256_shuffle_epi8(lo, n), wv, 1);
                for (int v = 0; v < 4; v++)
                    acc[r][v % 2] = _mm256_fmadd_ps(wv[v], _mm256_loadu_ps(x + kb * BLK + 32 * q + 8 * v),
                                                    acc[r][v % 2]);
            }
        }
    }
    if (kb < kb_n) /* an odd block count: the last block alone, in order 3 */
        for (int r = 0; r < R; r++) {
            __m256 wv[4];
            e2m1_block(w + r * row_bytes + 16 * kb, s[r * kb_n + kb], wv, 1);
            for (int v = 0; v < 4; v++)
                acc[r][v % 2] = _mm256_fmadd_ps(wv[v], _mm256_loadu_ps(x + kb * BLK + 8 * v), acc[r][v % 2]);
        }
    for (int r = 0; r < R; r++) j->y[r0 + r] = vsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}


/* One token, FP8 (activations in order 5): R rows, two sums per row, no shuffle. Each 32-block is read by
   four loads 3, 2, 1 and 0 bytes before it, so that the top byte of dword i of load q is the block's element
   4i + q (order 5: element 4i + q at 8q + i); shifted right by 4 with the sign (vpsrad), that byte becomes
   decode_fp8's bits (the sign at 31, the magnitude at 20..26) in two operations where the sign extension took
   three. Those bits read as fp32 are the code's value times 2^-120; decode_fp8 multiplies each weight by
   2^(e - 7) (e the block's scale byte). Here the block's 32 activations are multiplied by it instead, once for
   the R rows that share the scale (W x 2^(e - 7) x = W x (2^(e - 7) x): the same exact products, the same
   sums), which frees the FMA pipes of a multiply a weight (a fifth less time in cache, Zen 3), wherever
   2^(e - 7) |x| stays below 2^127 (x_exp); other blocks multiply their weights. The first block of a job reads
   its bytes from a copy (the bytes before a tensor may be unmapped). */
static inline __attribute__((always_inline)) void tile_fp8_one(const job_t *j, int64_t k, int64_t r0,
                                                               const int R) {
    const int64_t kb_n = k / BLK;
    const float *x = j->x;
    const __m256i keep = _mm256_set1_epi32((int)0x87F00000u);
    uint8_t first[3 + BLK];
    __m256 acc[2 * ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < kb_n; kb++) {
        const uint8_t e = j->s[(r0 / BLK) * kb_n + kb]; /* the R rows share their scale row (rows()) */
        const __m256 m1 = _mm256_set1_ps(e < 135 ? bits_float((uint32_t)(e + 120) << 23)
                                                 : bits_float(247u << 23));
        const __m256 m2 = _mm256_set1_ps(e < 135 ? 1.0f : ue8m0(e));
        const int scaled_x = e >= 7 && (int)e - 7 + j->x_exp <= 126; /* 2^(e - 7) x: no overflow */
        __m256 xs[4];
        for (int q = 0; q < 4; q++) {
            xs[q] = _mm256_loadu_ps(x + kb * BLK + 8 * q);
            if (scaled_x) xs[q] = _mm256_mul_ps(xs[q], m1); /* m1 is 2^(e - 7) there */
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *p = j->w + (r0 + r) * k + kb * BLK;
            _mm_prefetch((const char *)(p + 2 * R * k), _MM_HINT_T0);
            if (r0 + r == 0 && kb == 0) {
                memset(first, 0, 3);
                memcpy(first + 3, p, BLK);
                p = first + 3;
            }
            for (int q = 0; q < 4; q++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + q - 3));
                __m256 w = _mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(v, 4), keep));
                if (!scaled_x) {
                    w = _mm256_mul_ps(w, m1);
                    if (e >= 135) w = _mm256_mul_ps(w, m2);
                }
                acc[r][q % 2] = _mm256_fmadd_ps(w, xs[q], acc[r][q % 2]);
            }
        }
    }
    for (int r = 0; r < R; r++) j->y[r0 + r] = vsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#endif


/* ---- bf16 weights: y = x W^T with fp32 sums (--cpu-linears stored: the head, wo_a, bf16 Linears) ----
   A bf16 weight w is the fp32 w << 16, every product with an fp32 activation one FMA, as in a GEMM on the
   widened copy. Rows of k bf16 (2 bytes each, k a multiple of 32); the activations in order 1 (each 32 as its
   16 even then 16 odd elements: he_widen). With AVX2 (the AVX-512 build too: a stream of 2 bytes a weight is
   bound by memory, not by the vector width) a 32-byte load holds 16 weights: its words moved up are the even
   elements, its words masked in place the odd ones, no shuffle. */
#if defined(__AVX2__) && defined(__FMA__)
#define BF_ROWS 4 /* one token: 4 rows x 2 sums; several: 2 rows x 4 tokens */
#define BF_TOKS 4
static inline __attribute__((always_inline)) void tile_bf16(const job_t *j, int64_t k, int64_t r0,
                                                            int64_t t0, const int R, const int T) {
    const uint16_t *w = (const uint16_t *)j->w + r0 * k;
    const float *x = j->x + t0 * k;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const int S = T == 1 ? 2 : 1; /* sums per row and token */
    __m256 acc[BF_ROWS][BF_TOKS][2];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < k; kb += BLK) {
        for (int r = 0; r < R; r++) {
            const uint16_t *p = w + r * k + kb;
            _mm_prefetch((const char *)(p + 2 * R * k), _MM_HINT_T0); /* the tile after next, in step */
            const __m256i a = _mm256_loadu_si256((const __m256i *)p);
            const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 16));
            const __m256 wv[4] = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)),
                                  _mm256_castsi256_ps(_mm256_and_si256(a, high)),
                                  _mm256_castsi256_ps(_mm256_and_si256(b, high))};
            for (int t = 0; t < T; t++)
                for (int q = 0; q < 4; q++)
                    acc[r][t][q % S] = _mm256_fmadd_ps(wv[q], _mm256_loadu_ps(x + t * k + kb + 8 * q),
                                                       acc[r][t][q % S]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            j->y[(t0 + t) * j->ldy + r0 + r] = vsum256(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));
}
#else
#define BF_ROWS 4
#define BF_TOKS 1
static inline void tile_bf16(const job_t *j, int64_t k, int64_t r0, int64_t t0, const int R, const int T) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
            const uint16_t *w = (const uint16_t *)j->w + (r0 + r) * k;
            const float *x = j->x + (t0 + t) * k;
            float acc = 0.0f;
            for (int64_t kb = 0; kb < k; kb += BLK)
                for (int e = 0; e < BLK; e++) /* element kb + e sits at kb + (e % 2) * 16 + e / 2 */
                    acc += bits_float((uint32_t)w[kb + e] << 16) * x[kb + (e % 2) * 16 + e / 2];
            j->y[(t0 + t) * j->ldy + r0 + r] = acc;
        }
}
#endif

/* rows [r0, r1) of a bf16 job: a token at a time 4 rows at once, else tiles of 2 rows x 4 tokens */
static void rows_bf16(const job_t *j, int64_t k, int64_t r0, int64_t r1) {
    int64_t t = 0;
    if (BF_TOKS > 1)
        for (; t + BF_TOKS <= j->m; t += BF_TOKS) {
            int64_t r = r0;
            for (; r + 2 <= r1; r += 2) tile_bf16(j, k, r, t, 2, BF_TOKS);
            for (; r < r1; r++) tile_bf16(j, k, r, t, 1, BF_TOKS);
        }
    for (; t < j->m; t++) {
        int64_t r = r0;
        for (; r + BF_ROWS <= r1; r += BF_ROWS) tile_bf16(j, k, r, t, BF_ROWS, 1);
        for (; r < r1; r++) tile_bf16(j, k, r, t, 1, 1);
    }
}

/* x [m, k] bf16 bits (src_bf16) or fp32 -> out [m, k] fp32 in order 1, exact (the bf16 tiles' activations) */
void he_widen(const void *x, int64_t m, int64_t k, float *out, int src_bf16) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < k; c++) {
            const float v = src_bf16 ? bits_float((uint32_t)((const uint16_t *)x)[i * k + c] << 16)
                                     : ((const float *)x)[i * k + c];
            out[i * k + c / BLK * BLK + (c % 2) * 16 + c % BLK / 2] = v;
        }
}

#if WIDTH > 1
#define TILE(j, k, fp4, r, t, R, T) ((fp4) ? tile_fp4(j, k, r, t, R, T) : tile(j, k, 0, r, t, R, T))
#else
#define TILE(j, k, fp4, r, t, R, T) tile(j, k, fp4, r, t, R, T)
#endif

/* Rows [r0, r1) of job j: tiles of ROWS x TOKS, a decode step (one token) 2 * ROWS rows at a time (more
   independent sums in flight while the weights stream; MXFP4 in order 4: PAIR_ROWS), single rows and tokens
   at the edges. */
/* the tokens from t on in tiles of TT, rows [r0, r1) for each tile; returns the first token left */
static inline __attribute__((always_inline)) int64_t token_tiles(const job_t *j, int64_t k, int fp4,
                                                                 int64_t r0, int64_t r1, int64_t t,
                                                                 const int TT) {
    for (; t + TT <= j->m; t += TT) {
        int64_t r = r0;
        for (; r + ROWS <= r1; r += ROWS) TILE(j, k, fp4, r, t, ROWS, TT);
        for (; r < r1; r++) TILE(j, k, fp4, r, t, 1, TT);
    }
    return t;
}

static void rows(const job_t *j, int64_t k, int fp4, int paired, int64_t r0, int64_t r1) {
    if (j->m == 1) {
        int64_t r = r0;
#if WIDTH == 8
        if (paired && fp4) { /* he_run admits order 4 only for MXFP4 jobs of one row */
            for (; r + PAIR_ROWS <= r1; r += PAIR_ROWS) tile_fp4_pairs(j, k, r, PAIR_ROWS);
            for (; r < r1; r++) tile_fp4_pairs(j, k, r, 1);
            return;
        }
        if (paired) { /* FP8 in order 5 (jobs of one row): tiles of rows under one scale row */
            for (; r + 2 * ROWS <= r1 && r % BLK + 2 * ROWS <= BLK; r += 2 * ROWS)
                tile_fp8_one(j, k, r, 2 * ROWS);
            for (; r < r1; r++) tile_fp8_one(j, k, r, 1);
            return;
        }
#endif
        for (; r + 2 * ROWS <= r1; r += 2 * ROWS) TILE(j, k, fp4, r, 0, 2 * ROWS, 1);
        for (; r < r1; r++) TILE(j, k, fp4, r, 0, 1, 1);
        return;
    }
    int64_t t = 0;
    if (fp4 && FP4_TOKS > TOKS) /* the rest goes by TOKS and by 1 */
        t = token_tiles(j, k, 1, r0, r1, t, FP4_TOKS);
    if (!fp4 && FP8_TOKS > TOKS)
        t = token_tiles(j, k, 0, r0, r1, t, FP8_TOKS);
    t = token_tiles(j, k, fp4, r0, r1, t, TOKS);
    token_tiles(j, k, fp4, r0, r1, t, 1);
}

/* ---- the jobs, split into chunks of CHUNK rows, taken from a shared counter ---- */

typedef struct {
    const job_t *jobs;
    const int64_t *first; /* [n_jobs + 1]: index of each job's first chunk */
    int64_t n_jobs, k, next;
    int fmt, paired; /* 4 (MXFP4), 8 (FP8) or 16 (bf16) */
} work_t;

static void *worker(void *arg) {
    work_t *wk = (work_t *)arg;
    int64_t total = wk->first[wk->n_jobs], j = 0;
    for (;;) {
        int64_t c = __atomic_fetch_add(&wk->next, 1, __ATOMIC_RELAXED);
        if (c >= total) return NULL;
        while (wk->first[j + 1] <= c) j++; /* a thread's chunks come in increasing order */
        const job_t *jb = &wk->jobs[j];
        int64_t r0 = (c - wk->first[j]) * CHUNK, r1 = r0 + CHUNK < jb->n ? r0 + CHUNK : jb->n;
        if (wk->fmt == 16)
            rows_bf16(jb, wk->k, r0, r1);
        else
            rows(jb, wk->k, wk->fmt == 4, wk->paired, r0, r1);
    }
}


/* ---- a persistent team: the calling thread and up to MAX_THREADS - 1 helpers, started once ----
   A call publishes its work, bumps the generation and wakes the helpers that sleep; it takes chunks like
   them and waits for them to finish. Between calls a helper watches the generation for SPIN_NS (the next
   Linear of a decode step is usually that close: no system call to wake it), then sleeps on a condition
   variable. Starting the threads per call cost 40 us a call with 2 threads (a decode step makes hundreds). A
   forked child starts with no helpers (pthread_atfork). */
#define MAX_THREADS 64
static int64_t spin_ns = 50000; /* $DSV4_HOST_SPIN_US overrides (read once) */

typedef struct {
    pthread_mutex_t busy;            /* held by the call that uses the team */
    pthread_mutex_t m;               /* guards sleepers, with cv */
    pthread_cond_t cv;
    int started, sleepers, active, pending;
    uint64_t gen, born[MAX_THREADS]; /* born: the generation when each helper was started */
    work_t *wk;
} team_t;

static team_t team = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void pause_once(void) {
#if WIDTH > 1
    _mm_pause();
#endif
}

static int64_t ns_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *team_helper(void *arg) {
    const int idx = (int)(intptr_t)arg;
    uint64_t seen = team.born[idx]; /* (a call may have begun before this thread ran) */
    for (;;) {
        uint64_t g;
        int64_t since = ns_now();
        for (int spins = 1; (g = __atomic_load_n(&team.gen, __ATOMIC_ACQUIRE)) == seen; spins++) {
            pause_once();
            if (spins % 256 == 0 && ns_now() - since > spin_ns) {
                pthread_mutex_lock(&team.m);
                team.sleepers++;
                while ((g = __atomic_load_n(&team.gen, __ATOMIC_ACQUIRE)) == seen)
                    pthread_cond_wait(&team.cv, &team.m);
                team.sleepers--;
                pthread_mutex_unlock(&team.m);
                break;
            }
        }
        seen = g;
        if (idx < __atomic_load_n(&team.active, __ATOMIC_RELAXED)) {
            worker(team.wk);
            __atomic_fetch_sub(&team.pending, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

static void team_after_fork(void) { /* the child has no helpers: forget them, start anew on use */
    pthread_mutex_init(&team.busy, NULL);
    pthread_mutex_init(&team.m, NULL);
    pthread_cond_init(&team.cv, NULL);
    team.started = team.sleepers = team.active = team.pending = 0;
}

static pthread_once_t team_once = PTHREAD_ONCE_INIT;
static void team_init(void) {
    const char *us = getenv("DSV4_HOST_SPIN_US");
    if (us) spin_ns = 1000 * (int64_t)atoll(us);
    pthread_atfork(NULL, NULL, team_after_fork);
}

/* at least `want` helpers started (fewer where the system refuses more) -> how many there are */
static int team_grow(int want) {
    pthread_once(&team_once, team_init);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (team.started < want) {
        pthread_t t;
        team.born[team.started] = team.gen;
        if (pthread_create(&t, &attr, team_helper, (void *)(intptr_t)team.started) != 0) break;
        team.started++;
    }
    pthread_attr_destroy(&attr);
    return team.started < want ? team.started : want;
}

/* ---- activations: reference.act_quant, dequantised, in the kernel's order ---- */

/* fp32 |v| <= 448 -> the nearest E4M3 value, ties to even (subnormals: multiples of 2^-9) */
static inline float e4m3_round(float v) {
    float a = v < 0 ? -v : v, r;
    if (a >= 0x1p-6f) {
        uint32_t b;
        memcpy(&b, &a, 4);
        b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u; /* 3 mantissa bits, ties to even */
        r = bits_float(b);
    } else {
        r = (a + 0x1p14f) - 0x1p14f; /* fp32's spacing at 2^14 is 2^-9: rounds to the subnormal grid */
    }
    return copysignf(r, v); /* -0 stays -0, as in torch; no branch on the sign (random: mispredicted) */
}

#if WIDTH == 8
/* One block of he_act_quant in order 3 or 4 with AVX2: the scalar loop's operations 8 at a time, the same
   bits (max keeps the running value where a lane is NaN, as the scalar compare does; the clamp and the
   rounding pass a NaN through) and the order made with two permutes and a blend per output vector: element
   16h + 4d + 2i + p at o + p_step p + 16h + 8i + l_off + d (order 3: p_step 4, l_off 0; a block of a pair in
   order 4: p_step 32, l_off 4 l). */
static void act_block_avx2(const uint16_t *x, float *o, int p_step, int l_off, float c448, float floor_amax) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 g[4], m = _mm256_setzero_ps();
    for (int v = 0; v < 4; v++) { /* elements 8v .. 8v + 7 */
        __m128i h = _mm_loadu_si128((const __m128i *)(x + 8 * v));
        g[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        m = _mm256_max_ps(_mm256_and_ps(g[v], magnitude), m);
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int e = 0; e < 8; e++) amax = lanes[e] > amax ? lanes[e] : amax;
    amax = amax > floor_amax ? amax : floor_amax;
    float t = amax * c448;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    const float sc = bits_float((tb + 0x7FFFFFu) & 0x7F800000u), inv = 1.0f / sc;
    const __m256i low19 = _mm256_set1_epi32(0x7FFFF), one = _mm256_set1_epi32(1);
    const __m256i keep = _mm256_set1_epi32((int)0xFFF00000u);
    const __m256 big = _mm256_set1_ps(0x1p14f), smallest_normal = _mm256_set1_ps(0x1p-6f);
    __m256 q[4];
    for (int v = 0; v < 4; v++) {
        __m256 val = _mm256_mul_ps(g[v], _mm256_set1_ps(inv));
        val = _mm256_min_ps(_mm256_set1_ps(448.0f), _mm256_max_ps(_mm256_set1_ps(-448.0f), val));
        __m256 a = _mm256_and_ps(val, magnitude);
        __m256i b = _mm256_castps_si256(a);
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 20), one); /* ties to even */
        __m256i up = _mm256_add_epi32(_mm256_add_epi32(b, low19), odd);
        __m256 normal = _mm256_castsi256_ps(_mm256_and_si256(up, keep));
        __m256 sub = _mm256_sub_ps(_mm256_add_ps(a, big), big);
        __m256 r = _mm256_blendv_ps(sub, normal, _mm256_cmp_ps(a, smallest_normal, _CMP_GE_OQ));
        r = _mm256_or_ps(r, _mm256_andnot_ps(magnitude, val)); /* the sign */
        q[v] = _mm256_mul_ps(r, _mm256_set1_ps(sc));
    }
    /* vector 2h + i, lane 4p + d <- element 16h + 4d + 2i + p: of q[2h] (d < 2) or q[2h + 1] (d >= 2), at
       lane 4 (d % 2) + 2i + p; its lanes 4p .. 4p + 3 go to o + p_step p + 16h + 8i + l_off */
    for (int i = 0; i < 2; i++) {
        const __m256i idx = _mm256_setr_epi32(2 * i, 4 + 2 * i, 2 * i, 4 + 2 * i,
                                              2 * i + 1, 5 + 2 * i, 2 * i + 1, 5 + 2 * i);
        for (int h = 0; h < 2; h++) {
            __m256 lo = _mm256_permutevar8x32_ps(q[2 * h], idx);
            __m256 hi = _mm256_permutevar8x32_ps(q[2 * h + 1], idx);
            __m256 v = _mm256_blend_ps(lo, hi, 0xCC);
            float *at = o + 16 * h + 8 * i + l_off;
            if (p_step == 4) {
                _mm256_storeu_ps(at, v);
            } else {
                _mm_storeu_ps(at, _mm256_castps256_ps128(v));
                _mm_storeu_ps(at + p_step, _mm256_extractf128_ps(v, 1));
            }
        }
    }
}
#endif

/* x [m, k] bf16 bits -> out [m, kx] fp32: per 32, s = ceil_pow2(max(amax, fl32(1e-4)) * fl32(1/448)),
   e4m3(clamp(x / s, +-448)) * s, the numbers of reference.act_quant and fast.quant_act. order: 0 as is,
   1 each 32 as its even then odd elements, 2 each 128 as [8, 16] (kx: k rounded up to 128, zeros after),
   3 each 32 as [4, 2, 4] (element 16h + 4d + 2i + p at 16h + 8i + 4p + d: AVX2's e2m1_block), 4 each 64
   (two 32-blocks, l = 0, 1) as [2, 2, 2, 2, 4] (element 16h + 4d + 2i + p of block l at 32p + 16h + 8i +
   4l + d: AVX2's pair_codes), a last 32-block of an odd count as in order 3, 5 each 32 as [4, 8] (element
   4i + q at 8q + i: AVX2's tile_fp8_one). */
void he_act_quant(const uint16_t *x, int64_t m, int64_t k, float *out, int64_t kx, int order) {
    const float c448 = 1.0f / 448.0f, floor_amax = 1e-4f;
    for (int64_t i = 0; i < m; i++) {
        float *o = out + i * kx;
        for (int64_t c = k; c < kx; c++) /* the padding's elements, wherever the order puts them */
            o[(c / 128) * 128 + (c % 8) * 16 + (c % 128) / 8] = 0.0f;
        for (int64_t b0 = 0; b0 < k; b0 += BLK) {
            /* orders 3 and 4: element 16h + 4d + 2i + p at base + p_step p + 16h + 8i + l_off + d */
            const int l = (int)(b0 / BLK % 2), paired = order == 4 && (l || b0 + BLK < k);
            const int64_t base = paired ? b0 - l * BLK : b0;
            const int p_step = paired ? 32 : 4, l_off = paired ? 4 * l : 0;
#if WIDTH == 8
            if (order == 3 || order == 4) {
                act_block_avx2(x + i * k + b0, o + base, p_step, l_off, c448, floor_amax);
                continue;
            }
#endif
            float g[BLK], amax = 0.0f;
            for (int e = 0; e < BLK; e++) {
                g[e] = bits_float((uint32_t)x[i * k + b0 + e] << 16);
                float a = g[e] < 0 ? -g[e] : g[e];
                amax = a > amax ? a : amax;
            }
            amax = amax > floor_amax ? amax : floor_amax;
            float t = amax * c448;
            uint32_t tb;
            memcpy(&tb, &t, 4);
            float sc = bits_float((tb + 0x7FFFFFu) & 0x7F800000u); /* the next power of two up */
            const float inv = 1.0f / sc; /* exact (a power of two, 2^-120 at least): x * inv is x / sc */
            for (int e = 0; e < BLK; e++) {
                float v = g[e] * inv;
                v = v > 448.0f ? 448.0f : v < -448.0f ? -448.0f : v;
                int64_t col = b0 + e, pos = col;
                if (order == 1)
                    pos = b0 + (e & 1) * 16 + e / 2;
                else if (order == 2)
                    pos = (col / 128) * 128 + (col % 8) * 16 + (col % 128) / 8;
                else if (order == 3 || order == 4)
                    pos = base + p_step * (e % 2) + 16 * (e / 16) + 8 * (e / 2 % 2) + l_off + e % 16 / 4;
                else if (order == 5)
                    pos = b0 + 8 * (e % 4) + e / 4;
                o[pos] = e4m3_round(v) * sc;
            }
        }
    }
}

const char *he_variant(void) { return VARIANT; }

/* the smallest e with every |x[i]| < 2^e, i < n (128 for an inf or NaN: no block takes tile_fp8_one's scaled
   activations then) */
static int exponent_bound(const float *x, int64_t n) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        top = a > top || a != a ? a : top;
    }
    if (!(top <= 0x1.fffffep127f)) return 128;
    int e;
    frexpf(top, &e); /* top < 2^e */
    return e;
}

/* jobs: n_jobs x 7 int64 (w, s, x, y pointers, n, m, ldy). first: n_jobs + 1 int64 of scratch.
   fmt: 4 (MXFP4), 8 (FP8) or 16 (bf16, no scales: s unused). order: the activations' (he_act_quant,
   he_widen), FP8 0, MXFP4 this build's FP4_ORDER, or on AVX2 4 where every job has one row (a decode step),
   bf16 1. Returns 0, or -1 for a bad argument. */
int he_run(const int64_t *jobs, int64_t n_jobs, int64_t *first, int64_t k, int fmt, int order,
           int n_threads) {
    if (k <= 0 || k % BLK || (fmt != 4 && fmt != 8 && fmt != 16) || n_jobs < 0) return -1;
    const int paired = WIDTH == 8 && ((fmt == 4 && order == 4) || (fmt == 8 && order == 5));
    if (order != (fmt == 8 ? 0 : fmt == 16 ? 1 : FP4_ORDER) && !paired) return -1;
    for (int64_t i = 0; paired && i < n_jobs; i++)
        if (jobs[7 * i + 5] > 1) return -1;
#if WIDTH == 8
    pthread_once(&scaled_once, make_scaled);
#endif
    job_t js[n_jobs > 0 ? n_jobs : 1];
    first[0] = 0;
    for (int64_t i = 0; i < n_jobs; i++) {
        const int64_t *d = jobs + 7 * i;
        js[i] = (job_t){(const uint8_t *)(intptr_t)d[0], (const uint8_t *)(intptr_t)d[1],
                        (const float *)(intptr_t)d[2], (float *)(intptr_t)d[3], d[4], d[5], d[6], 128};
        if (paired && fmt == 8) js[i].x_exp = exponent_bound(js[i].x, js[i].m * k);
        first[i + 1] = first[i] + (js[i].m > 0 ? (js[i].n + CHUNK - 1) / CHUNK : 0);
    }
    work_t wk = {js, first, n_jobs, k, 0, fmt, paired};
    int helpers = (n_threads > MAX_THREADS ? MAX_THREADS : n_threads) - 1;
    if (helpers > first[n_jobs] - 1) helpers = (int)(first[n_jobs] - 1); /* no more threads than chunks */
    if (helpers <= 0 || pthread_mutex_trylock(&team.busy) != 0) { /* (a concurrent call runs alone) */
        worker(&wk);
        return 0;
    }
    helpers = team_grow(helpers);
    team.wk = &wk;
    __atomic_store_n(&team.active, helpers, __ATOMIC_RELAXED);
    __atomic_store_n(&team.pending, helpers, __ATOMIC_RELAXED);
    __atomic_fetch_add(&team.gen, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&team.m);
    if (team.sleepers) pthread_cond_broadcast(&team.cv);
    pthread_mutex_unlock(&team.m);
    worker(&wk); /* a helper that is late finds the counter past the last chunk */
    while (__atomic_load_n(&team.pending, __ATOMIC_ACQUIRE) > 0) pause_once();
    pthread_mutex_unlock(&team.busy);
    return 0;
}
