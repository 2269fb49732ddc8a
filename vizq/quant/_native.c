/* vizq's CPU fast path for fake quantization. Plain C, no torch headers: builds in < 1 s.
 *
 * A calibrated per-tensor quantizer is a monotone step function: levels[#thresholds <= x].
 * The float's bit pattern shifted right by `shift` indexes a table `base` holding, for each bin
 * of floats (sign, exponent, a few mantissa bits), how many thresholds lie at or below the bin's
 * smallest value; comparing with the (at most SCAN) thresholds that follow finishes the count
 * without a branch (the array is padded with NaN, which no comparison passes). The result
 * equals a binary search (torch.bucketize(..., right=True)) exactly, for every float.
 *
 * Non-finite inputs (the rule of base.py): NaN comes out as NaN, ±inf saturate at the extreme
 * levels, and neither changes any other value (a block's scale ignores them).
 *
 * Block formats (OCP MX, NVFP4) compute a scale per block of the last dimension, then round
 * x / scale with the element format's step function and multiply back: the same IEEE
 * operations, in the same order, as the torch path in fp.py, so the bits agree.
 *
 * Built with -fopenmp where the compiler has it: the library then shares the libgomp that
 * torch already loaded (same soname), so its loops run on torch's own thread pool, sized by
 * torch.set_num_threads, instead of competing with it.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SCAN 2 /* keep equal to MAX_SCAN in step.py */
#define PARALLEL_MIN 65536 /* values below which threads cost more than they save */

static inline int32_t lookup(float v, const uint16_t *base, int32_t shift, const float *thr) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    int32_t c = base[b >> shift];
    const float *t = thr + c; /* thr holds the thresholds, then SCAN NaNs */
    return c + (v >= t[0]) + (v >= t[1]);
}

void vizq_step_apply(const float *restrict x, float *restrict out, int64_t n, const uint16_t *base, int32_t shift,
                     const float *thr, const float *levels) {
#pragma omp parallel for schedule(static) if (n > PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        out[i] = v != v ? v : levels[lookup(v, base, shift, thr)];
    }
}

/* Exact 2^e for -149 <= e <= 127, built from bits (no libm rounding questions). */
static inline float pow2i(int e) {
    uint32_t b = e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << (e + 149);
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* mode 0 (MX): scale = 2^clamp(floor(log2(max(amax, 2^-127))) - emax, -127, 127).
 * mode 1 (NVFP4): scale = E4M3(amax / 6 / tscale) * tscale, 1 * tscale for an all-zero block. */
void vizq_block_apply(const float *restrict x, float *restrict out, int64_t rows, int64_t cols, int32_t block,
                      const uint16_t *ebase, int32_t eshift, const float *ethr, const float *elev,
                      int32_t mode, int32_t emax,
                      const uint16_t *sbase, int32_t sshift, const float *sthr, const float *slev,
                      float tscale) {
#pragma omp parallel for schedule(static) if (rows * cols > PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *yr = out + r * cols;
        for (int64_t j0 = 0; j0 < cols; j0 += block) {
            int64_t j1 = j0 + block < cols ? j0 + block : cols;
            float amax = 0.0f;
            for (int64_t j = j0; j < j1; j++) {
                float a = fabsf(xr[j]);
                if (a > amax && a <= FLT_MAX) amax = a; /* NaN and inf never set the scale */
            }
            float scale, inv = 0.0f;
            if (mode == 0) {
                float a = amax < pow2i(-127) ? pow2i(-127) : amax;
                int e;
                frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1 exactly */
                int es = e - 1 - emax;
                es = es < -127 ? -127 : es > 127 ? 127 : es;
                scale = pow2i(es);
                inv = pow2i(-es); /* x * 2^-e rounds exactly like x / 2^e: the same real value */
            } else {
                float t = amax / 6.0f / tscale;
                float s = slev[lookup(t, sbase, sshift, sthr)];
                scale = (s > 0.0f ? s : 1.0f) * tscale;
            }
            if (mode == 0)
                for (int64_t j = j0; j < j1; j++)
                    yr[j] = xr[j] != xr[j] ? xr[j] : elev[lookup(xr[j] * inv, ebase, eshift, ethr)] * scale;
            else
                for (int64_t j = j0; j < j1; j++)
                    yr[j] = xr[j] != xr[j] ? xr[j] : elev[lookup(xr[j] / scale, ebase, eshift, ethr)] * scale;
        }
    }
}
