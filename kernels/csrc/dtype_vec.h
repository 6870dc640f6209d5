// Rows of float, bf16 or fp16 read and written as fp32 vectors (at::vec's Vectorized<float>, 16 lanes with
// AVX-512, 8 with AVX2), for kernels that do their arithmetic in fp32 and round where the torch reference
// rounds. Rounding is to nearest even, bit for bit as c10::BFloat16 and c10::Half convert a float (NaN stays
// NaN); bf16 takes integer shifts, fp16 the F16C conversions. Without AVX2 each lane goes through c10.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixrt {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

namespace detail {

template <typename T>
inline Vec load_lanes(const T* p) {
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return Vec::loadu(tmp);
}

template <typename T>
inline void store_lanes(T* p, Vec v) {
  float tmp[kLanes];
  v.store(tmp);
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(tmp[i]);
}

#if defined(CPU_CAPABILITY_AVX512)
// the upper 16 bits of each lane after rounding to nearest even; NaN lanes become c10's quiet NaN (0x7fc0)
inline __m512i bf16_bits(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), rounded);
}
#elif defined(CPU_CAPABILITY_AVX2)
inline __m256i bf16_bits(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc0), rounded, _mm256_castps_si256(ordered));
}
#endif

}  // namespace detail

// kLanes elements from p, as fp32
template <typename T>
inline Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
    return detail::load_lanes(p);
#endif
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    return detail::load_lanes(p);
#endif
  } else {
    return detail::load_lanes(p);
  }
}

// v rounded to T, written as kLanes elements at p
template <typename T>
inline void store_floats(T* p, Vec v) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(detail::bf16_bits(v)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i bits = detail::bf16_bits(v);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
#else
    detail::store_lanes(p, v);
#endif
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(CPU_CAPABILITY_AVX2)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
    detail::store_lanes(p, v);
#endif
  } else {
    detail::store_lanes(p, v);
  }
}

// v rounded to T and widened back to fp32 (a no-op for float): where the reference rounds an intermediate
template <typename T>
inline Vec round_to(Vec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_castsi512_ps(_mm512_slli_epi32(detail::bf16_bits(v), 16));
#elif defined(CPU_CAPABILITY_AVX2)
    return _mm256_castsi256_ps(_mm256_slli_epi32(detail::bf16_bits(v), 16));
#else
    T tmp[kLanes];
    detail::store_lanes(tmp, v);
    return detail::load_lanes(tmp);
#endif
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(CPU_CAPABILITY_AVX2)
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
    T tmp[kLanes];
    detail::store_lanes(tmp, v);
    return detail::load_lanes(tmp);
#endif
  } else {
    T tmp[kLanes];
    detail::store_lanes(tmp, v);
    return detail::load_lanes(tmp);
  }
}

// dst[i] = bf16(even[i]) | bf16(odd[i]) << 16 for the kLanes lanes: pairs of bf16 as one 32-bit word each
inline void store_bf16_pairs(uint32_t* dst, Vec even, Vec odd) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i pairs = _mm512_or_si512(detail::bf16_bits(even), _mm512_slli_epi32(detail::bf16_bits(odd), 16));
  _mm512_storeu_si512(dst, pairs);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i pairs = _mm256_or_si256(detail::bf16_bits(even), _mm256_slli_epi32(detail::bf16_bits(odd), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), pairs);
#else
  float e[kLanes], o[kLanes];
  even.store(e);
  odd.store(o);
  for (int64_t i = 0; i < kLanes; ++i) {
    dst[i] = static_cast<uint32_t>(c10::BFloat16(e[i]).x) | static_cast<uint32_t>(c10::BFloat16(o[i]).x) << 16;
  }
#endif
}

inline float hsum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v); }

inline float hmax(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}

// An online softmax's rescale of what was summed under the running max `old_m` once the max is `new_m`:
// exp(old_m - new_m), with the two cases that need no exp exact: 1 when the max stayed (-inf included) and 0 on
// a row's first keys (old_m = -inf). Most spans leave a row's max where it was: the scalar exp each row took at
// each span was 0.7% of a bf16 forward of the default model at 8 and at 40 decode rows.
inline float softmax_rescale(float old_m, float new_m) {
  if (old_m == new_m) return 1.f;
  if (old_m == -std::numeric_limits<float>::infinity()) return 0.f;
  return std::exp(old_m - new_m);
}

// the scalar twin of round_to<T>, for the tails of rows
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

}  // namespace radixrt
