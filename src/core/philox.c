/* philox.c - the counter-based generator behind kl_rand / kl_randn:
 * Philox-4x32-10 (Salmon et al., SC'11). Element i of a tensor depends on
 * (seed, i) only, so every backend and thread count draws the same numbers.
 */
#include "core/core.h"

void kl__philox(uint64_t seed, uint64_t counter, uint32_t out[4])
{
	uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32), c2 = 0, c3 = 0;
	uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
	for (int r = 0; r < 10; r++) {
		uint64_t p0 = (uint64_t)0xD2511F53u * c0;
		uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
		uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
		uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
		c1 = (uint32_t)p1;
		c3 = (uint32_t)p0;
		c0 = n0;
		c2 = n2;
		k0 += 0x9E3779B9u;
		k1 += 0xBB67AE85u;
	}
	out[0] = c0;
	out[1] = c1;
	out[2] = c2;
	out[3] = c3;
}

uint64_t kl__philox_key(uint64_t seed, uint64_t offset)
{
	uint32_t k[4];
	kl__philox(seed, offset, k);
	return (uint64_t)k[0] | (uint64_t)k[1] << 32;
}

/* 24 bits: exactly representable in f32, so every float dtype sees the same
 * grid of values and the result is < 1 in all of them */
double kl__rand_uniform(uint64_t seed, uint64_t i)
{
	uint32_t o[4];
	kl__philox(seed, i, o);
	return (double)(o[0] >> 8) * 0x1p-24;
}

double kl__rand_normal(uint64_t seed, uint64_t i)
{
	uint32_t o[4];
	kl__philox(seed, i, o);
	double u1 = ((double)(o[0] >> 8) + 1.0) * 0x1p-24; /* (0, 1]: log is finite */
	double u2 = (double)(o[1] >> 8) * 0x1p-24;
	return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

double kl__rand_uniform_as(kl_dtype dt, uint64_t seed, uint64_t i)
{
	double u = kl__round_to(dt, kl__rand_uniform(seed, i));
	if (u >= 1.0) /* 24 bits fit f32 and f64: only the 16-bit floats get here */
		u = dt == KL_F16 ? 1.0 - 0x1p-11 : 1.0 - 0x1p-8;
	return u;
}
