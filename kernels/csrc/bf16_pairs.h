// bf16 values as 32-bit pairs, for the bf16 dot product (vdpbf16ps) and its stand-ins.
//
// F16 is 16 fp32 lanes: one AVX-512 register, else an array. dot2(acc, a, b) adds a.even * b.even + a.odd * b.odd
// to each lane, a holding 16 pairs and b one pair broadcast: vdpbf16ps with AVX512-BF16, else two FMAs on the
// widened halves (a bf16 product is exact in fp32; the odd one is added first, as Intel documents the
// instruction), a vector at a time on other AVX-512 CPUs and a lane at a time elsewhere. Two rows of bf16 interleaved by 16-bit unpacks pair the dims of each 32 in
// a fixed order, {0-3, 8-11, 16-19, 24-27} then {4-7, 12-15, 20-23, 28-31}; permuted_dim says where dim d went.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace radixrt::pairs {

#if defined(CPU_CAPABILITY_AVX512)
using F16 = __m512;
inline F16 zeros() { return _mm512_setzero_ps(); }
inline F16 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline F16 scale16(F16 v, float s) { return _mm512_mul_ps(v, _mm512_set1_ps(s)); }
inline F16 add16(F16 a, F16 b) { return _mm512_add_ps(a, b); }
inline F16 mul16(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
// acc + a.even * b.even + a.odd * b.odd per lane, a and b holding bf16 pairs (b broadcast from one pair)
inline F16 dot2(F16 acc, __m512i a, uint32_t b_pair) {
  const __m512i b = _mm512_set1_epi32(static_cast<int>(b_pair));
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)), _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
}
inline F16 dot2(F16 acc, const uint32_t* a, uint32_t b_pair) { return dot2(acc, _mm512_loadu_si512(a), b_pair); }
#else
struct F16 {
  float v[16];
};
inline F16 zeros() { return F16{}; }
inline F16 load16(const float* p) {
  F16 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void store16(float* p, F16 x) { std::memcpy(p, x.v, sizeof(x.v)); }
inline F16 scale16(F16 x, float s) {
  for (float& e : x.v) e *= s;
  return x;
}
inline F16 add16(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline F16 mul16(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
inline float high_half(uint32_t pair) {
  const uint32_t bits = pair & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float low_half(uint32_t pair) { return high_half(pair << 16); }
inline F16 dot2(F16 acc, const uint32_t* a, uint32_t b_pair) {
  const float b_hi = high_half(b_pair), b_lo = low_half(b_pair);
  for (int i = 0; i < 16; ++i) acc.v[i] = std::fma(low_half(a[i]), b_lo, std::fma(high_half(a[i]), b_hi, acc.v[i]));
  return acc;
}
#endif

inline uint32_t pair_at(const c10::BFloat16* p) {
  uint32_t pair;
  std::memcpy(&pair, p, 4);
  return pair;
}

// where dim d of a row sits in an accumulator row (the unpack order of the packed values)
inline int64_t permuted_dim(int64_t d) {
  const int64_t base = d - d % 32, i = d % 32, lane = i / 8, within = i % 8;
  return base + (within < 4 ? 0 : 16) + lane * 4 + within % 4;
}

}  // namespace radixrt::pairs
