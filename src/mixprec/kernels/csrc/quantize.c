/* Quantize of a 2-D fp32 or bf16 tensor to FP8 (E4M3, E5M2) or FP4 (E2M1, optionally packed two codes
 * a byte) with fp32 scales on a block grid, and the error statistics of the inference reports, for
 * mixprec.kernels.c_quantize (loaded with ctypes).
 *
 * Bit-identical to mixprec's torch backends by construction, not by tolerance:
 *   - the scaled value is x / s, an IEEE fp32 division (no reciprocal; built without -ffast-math, with
 *     -ffp-contract=off so no product is fused into another operation);
 *   - the clamp to +-max and the round to nearest even of the clamped value are done on the fp32 bit
 *     pattern: normal results round their mantissa (add half an ulp minus one, plus the kept lsb, then
 *     shift: ties go to the even code); results below the format's smallest normal are rounded by the
 *     fp32 adder itself, by adding a power of two whose ulp is the format's subnormal step;
 *   - the sign is kept (-0.0 gives the negative-zero code, as torch's cast and mixprec's E2M1 encode do).
 * Non-finite inputs are not handled here: both passes report them and the caller takes the torch path,
 * which has the rules for NaN and inf.
 *
 * The statistics are sum x^2 and sum (x - deq(q) * s)^2 over the tensor: fp32 partial sums over 256
 * elements (redone in double where a square overflows fp32), accumulated in double.
 * Every loop is written so that the compiler vectorizes it (-O3, and `omp simd` for the reductions,
 * which without -ffast-math a compiler may not reorder by itself).
 */
#include <stdint.h>
#include <string.h>

typedef struct {
    int mbits;           /* mantissa bits: 3 (E4M3), 2 (E5M2) or 1 (E2M1) */
    uint32_t min_normal; /* fp32 bits of the format's smallest normal */
    uint32_t exp_offset; /* (127 - format bias) << mbits: fp32 exponent -> format exponent */
    float magic;         /* 2^(23 + log2 of the subnormal step): its ulp is the subnormal step */
    float max;           /* the largest finite value */
    int sign_shift;      /* fp32 sign bit -> the code's sign bit (bit 7, or bit 3 for E2M1) */
} Minifloat;

static Minifloat minifloat(int mbits) {
    Minifloat f;
    f.mbits = mbits;
    if (mbits == 3) { /* E4M3 (fn): bias 7, normals from 2^-6, subnormal step 2^-9, max 448 */
        f.min_normal = 0x3C800000u;
        f.exp_offset = 120u << 3;
        f.magic = 16384.0f; /* 2^14 */
        f.max = 448.0f;
        f.sign_shift = 24;
    } else if (mbits == 2) { /* E5M2: bias 15, normals from 2^-14, subnormal step 2^-16, max 57344 */
        f.min_normal = 0x38800000u;
        f.exp_offset = 112u << 2;
        f.magic = 128.0f; /* 2^7 */
        f.max = 57344.0f;
        f.sign_shift = 24;
    } else { /* E2M1: bias 1, normals from 1, subnormal step 0.5, max 6 */
        f.min_normal = 0x3F800000u;
        f.exp_offset = 126u << 1;
        f.magic = 4194304.0f; /* 2^22 */
        f.max = 6.0f;
        f.sign_shift = 28;
    }
    return f;
}

static inline uint32_t f2u(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline float u2f(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }

/* bf16 or fp32 element j of a row, as fp32 (bf16 -> fp32 is exact: the high half of the pattern) */
static inline float load(const void *row, int bf16, int64_t j) {
    if (bf16) return u2f((uint32_t)((const uint16_t *)row)[j] << 16);
    return ((const float *)row)[j];
}

/* max |x| of the elements j0 <= j < j0 + n of a row, as a bit pattern (non-negative floats order as
 * their patterns; NaN's lie above inf's). n is a constant at the calls for the small blocks (16, 32):
 * the compiler unrolls those into a few vector operations instead of a loop with a remainder. */
static inline __attribute__((always_inline)) uint32_t absmax_bits(const void *row, const int bf16,
                                                                  int64_t j0, int64_t n) {
    uint32_t m = 0;
    if (bf16) {
        const uint16_t *r = (const uint16_t *)row + j0;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) {
            uint32_t a = (uint32_t)(r[j] & 0x7FFF) << 16;
            m = a > m ? a : m;
        }
    } else {
        const uint32_t *r = (const uint32_t *)row + j0;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; j++) {
            uint32_t a = r[j] & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
    }
    return m;
}

/* Per-block max |x| into amax (fp32, gr x gc, zeroed here). Returns 1 when any element is NaN or inf
 * (the caller then quantizes on the torch path), else 0. */
int mixprec_block_amax(const void *x, int bf16, int64_t rows, int64_t cols, int64_t ld, int64_t br,
                       int64_t bc, int64_t gc, float *amax) {
    int64_t gr = (rows + br - 1) / br;
    uint32_t *grid = (uint32_t *)amax;
    memset(grid, 0, (size_t)(gr * gc) * sizeof(uint32_t));
    uint32_t worst = 0;
    for (int64_t i = 0; i < rows; i++) {
        const char *row = (const char *)x + i * ld * (bf16 ? 2 : 4);
        uint32_t *g = grid + (i / br) * gc;
        for (int64_t j0 = 0, b = 0; j0 < cols; j0 += bc, b++) {
            int64_t n = j0 + bc < cols ? bc : cols - j0;
            uint32_t m;
            if (n == 16)
                m = bf16 ? absmax_bits(row, 1, j0, 16) : absmax_bits(row, 0, j0, 16);
            else if (n == 32)
                m = bf16 ? absmax_bits(row, 1, j0, 32) : absmax_bits(row, 0, j0, 32);
            else
                m = bf16 ? absmax_bits(row, 1, j0, n) : absmax_bits(row, 0, j0, n);
            if (m > g[b]) g[b] = m;
            if (m > worst) worst = m;
        }
    }
    return worst >= 0x7F800000u; /* inf's pattern, or above it: NaN */
}

/* The code of the fp32 value y (not NaN) clamped to +-max and rounded to nearest even; *deq is the
 * value of that code. */
static inline __attribute__((always_inline)) uint8_t encode(float y, Minifloat f, float *deq) {
    const int shift = 23 - f.mbits;
    y = y > f.max ? f.max : (y < -f.max ? -f.max : y);
    uint32_t bits = f2u(y);
    uint32_t sign = bits & 0x80000000u;
    uint32_t a = bits & 0x7FFFFFFFu;
    uint32_t rounded = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift; /* exp | mant */
    float sub = u2f(a) + f.magic; /* the fp32 adder rounds onto the subnormal step */
    int normal = a >= f.min_normal;
    uint32_t code = normal ? rounded - f.exp_offset : f2u(sub) - f2u(f.magic);
    float mag = normal ? u2f(rounded << shift) : sub - f.magic;
    *deq = u2f(f2u(mag) | sign);
    return (uint8_t)(code | (sign >> f.sign_shift));
}

#define CHUNK 256 /* elements of a row per step: fp32 partial sums over at most this many, then double */

/* q = encode(x / s) for the elements c0 <= j < c1 of a row, s = sv[j - c0]; with_stats adds sum x^2 and
 * sum (x - deq * s)^2 to sums[0], sums[1]. bf16, packed and with_stats are constants at each call: the
 * compiler makes one vectorized loop per combination (and drops the decode without the statistics).
 * Codes go one a byte to out[j], or (packed: E2M1, c0 and c1 even) two a byte to out[j / 2], element
 * 2i in the low nibble. Returns 1 when an input is NaN or inf (the caller then takes the torch path). */
static inline __attribute__((always_inline)) int quantize_chunk(const void *restrict row, const int bf16,
                                                                  int64_t c0, int64_t c1,
                                                                  const float *restrict sv, Minifloat f,
                                                                  uint8_t *restrict out, const int packed,
                                                                  double *sums, const int with_stats) {
    int nonfinite = 0;
    float ref = 0.0f, err = 0.0f;
    uint8_t codes[CHUNK]; /* packed: the chunk's codes one a byte, then two a byte into out */
    uint8_t *dst = packed ? codes : out;
    const int64_t base = packed ? c0 : 0;
#pragma omp simd reduction(+ : ref, err) reduction(| : nonfinite)
    for (int64_t j = c0; j < c1; j++) {
        float xv = load(row, bf16, j), s = sv[j - c0], deq;
        nonfinite |= !(xv - xv == 0.0f); /* inf or NaN */
        dst[j - base] = encode(xv / s, f, &deq);
        if (with_stats) {
            float e = xv - deq * s;
            ref += xv * xv;
            err += e * e;
        }
    }
    if (packed) {
        for (int64_t p = 0; p < (c1 - c0) / 2; p++)
            out[c0 / 2 + p] = (uint8_t)(codes[2 * p] | (codes[2 * p + 1] << 4));
    }
    if (!with_stats) return nonfinite;
    double ref_d = ref, err_d = err;
    if (!(ref - ref == 0.0f && err - err == 0.0f)) { /* fp32 squares overflowed: again in double */
        ref_d = err_d = 0.0;
        for (int64_t j = c0; j < c1; j++) {
            float xv = load(row, bf16, j), s = sv[j - c0], deq;
            encode(xv / s, f, &deq);
            double e = (double)xv - (double)deq * s; /* exact product */
            ref_d += (double)xv * xv;
            err_d += e * e;
        }
    }
    sums[0] += ref_d;
    sums[1] += err_d;
    return nonfinite;
}

/* The payload of x (rows x cols, row stride ld elements) with scale[i / br][j / bc] (gc scale columns)
 * into out (row stride ldo bytes; packed: E2M1 two codes a byte, cols even); sums (double[2]) or NULL.
 * Each chunk of a row gets its scales expanded per element first (a broadcast store per block), so
 * blocks of 16 or 32 cost no more than one scale per row. Returns 1 when x holds NaN or inf (out is
 * then incomplete: the caller takes the torch path), else 0. */
int mixprec_quantize(const void *x, int bf16, int mbits, int64_t rows, int64_t cols, int64_t ld,
                     const float *scale, int64_t br, int64_t bc, int64_t gc, uint8_t *out, int64_t ldo,
                     int packed, double *sums) {
    Minifloat f = minifloat(mbits);
    float sv[CHUNK];
    if (sums) sums[0] = sums[1] = 0.0;
    for (int64_t i = 0; i < rows; i++) {
        const char *row = (const char *)x + i * ld * (bf16 ? 2 : 4);
        const float *srow = scale + (i / br) * gc;
        uint8_t *o = out + i * ldo;
        int nonfinite = 0;
        for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
            int64_t c1 = c0 + CHUNK < cols ? c0 + CHUNK : cols;
            for (int64_t k = c0; k < c1;) { /* the chunk's scales, one per element */
                int64_t b = k / bc, end = (b + 1) * bc < c1 ? (b + 1) * bc : c1;
                float sc = srow[b];
                for (; k < end; k++) sv[k - c0] = sc;
            }
#define CHUNK_(BF16, PACKED)                                                                   \
    (sums ? quantize_chunk(row, BF16, c0, c1, sv, f, o, PACKED, sums, 1)                      \
          : quantize_chunk(row, BF16, c0, c1, sv, f, o, PACKED, NULL, 0))
            if (bf16)
                nonfinite |= packed ? CHUNK_(1, 1) : CHUNK_(1, 0);
            else
                nonfinite |= packed ? CHUNK_(0, 1) : CHUNK_(0, 0);
#undef CHUNK_
        }
        if (nonfinite) return 1;
    }
    return 0;
}
