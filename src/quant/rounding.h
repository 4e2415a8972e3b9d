// Float-to-integer rounding for the codecs, written with a truncating conversion (which compilers
// inline) instead of nearbyintf/roundf (which stay library calls without SSE4.1 or -ffast-math).
#pragma once

namespace quantmla {

// Round half to even, for 0 <= value < 2^23 (the default FP rounding mode, as nearbyint).
inline int round_half_even_nonnegative(float value) {
  const int whole = static_cast<int>(value);
  // Exact: below 2^23 the fraction bits of a float fit in the float itself.
  const float fraction = value - static_cast<float>(whole);
  return whole + ((fraction > 0.5f || (fraction == 0.5f && (whole & 1))) ? 1 : 0);
}

// Round half away from zero, for |value| < 2^23 (as roundf).
inline int round_half_away_from_zero(float value) {
  const int whole = static_cast<int>(value);  // toward zero
  const float fraction = value - static_cast<float>(whole);
  if (fraction >= 0.5f) return whole + 1;
  if (fraction <= -0.5f) return whole - 1;
  return whole;
}

}  // namespace quantmla
