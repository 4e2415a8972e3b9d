// Index maps of the fragment decode kernel (decode_fragments.cuh): which cache channel
// each register half of an mma.m16n8k16 fragment holds when the fragments are built straight from
// a record's int4 or int2 codes, without a BF16 tile in shared memory. Plain constexpr functions,
// so that the host test (test_decode_schedule.cpp) checks them exhaustively and the kernel uses the
// same arithmetic.
//
// Fragment layouts (g = lane / 4, t = lane % 4), as in mma.cuh: A 16x16 row-major holds
// a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];
// B 16x8 holds b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]. Register half e (0 low, 1 high) is the
// first or second of each pair; "h" below is 0 for a0/a1/b0 and 1 for a2/a3/b1.
#pragma once

#include "kernels/cuda/host_device.h"

namespace quantmla::gpu {

// Scores S^T = K Q^T: A = 16 keys x 16 channels (one k-step), B = the same channels x 8 heads. For
// a g64 group of int4 codes, lane t takes code words 2t and 2t + 1 of each key (channels 16t to
// 16t + 15; nibble n of word w is channel 8w + n). K-step s of the group uses word 2t + (s >> 1);
// its register h holds the nibble pair (q, q + 4), q = 2 (s & 1) + h, which one shift and one mask
// put into the two halves. So the channel (0..63 in the group) of k-step s, lane t, register h,
// half e is:
QUANTMLA_HOST_DEVICE constexpr int int4_key_channel(int s, int t, int h, int e) {
  return 16 * t + 8 * (s >> 1) + 2 * (s & 1) + h + 4 * e;
}
// The nibble of word 2t + (s >> 1) that register h, half e of k-step s takes.
QUANTMLA_HOST_DEVICE constexpr int int4_key_nibble(int s, int h, int e) {
  return 2 * (s & 1) + h + 4 * e;
}

// The same for a BF16 path (the RoPE key stored in BF16): channel order, k-step s covers channels
// [16 s, 16 s + 16) of the 64.
QUANTMLA_HOST_DEVICE constexpr int bf16_key_channel(int s, int t, int h, int e) {
  return 16 * s + 2 * t + 8 * h + e;
}

// Output O^T = V^T P^T: A = 16 channels x 16 keys. M-tile j (0..3) of a g64 group puts rows g and
// g + 8 on the low and high nibble of byte j of code word g: channels 8g + 2j and 8g + 2j + 1, so
// that one byte of each key gives both rows, and the two rows of an output column are adjacent
// channels (one 32-bit store of a BF16 pair).
QUANTMLA_HOST_DEVICE constexpr int int4_value_channel(int j, int row) {
  return 8 * (row % 8) + 2 * j + row / 8;
}

// Where channel c (0..63) of an int4 key group sits: lane t = c / 16, and within it d = c % 16 =
// 8 (s >> 1) + 2 (s & 1) + h + 4 e. The kernel patches the RoPE pairs kept in BF16 there.
struct FragmentPlace {
  int s, t, h, e;
};
QUANTMLA_HOST_DEVICE constexpr FragmentPlace int4_key_place(int channel) {
  const int d = channel % 16;
  const int r = d % 8;
  return {2 * (d / 8) + (r % 4) / 2, channel / 16, r % 2, r / 4};
}

// The transposed kernel's converting form (decode_transposed.cu) takes its keys' A fragments of
// S^T = K Q^T (rows: the keys; k: a box's 64 columns) in the tile column order of the codes' pair
// span (record_formats.cuh), which the values' tile and Q keep: register h, half e of k-step s of
// lane t holds column transposed_key_column, the pair of codes that one shift of code word
// transposed_key_code_word by transposed_key_code_shift and one mask put into the halves. Int4
// (span 4: code word u gives columns 8u to 8u + 7, column 8u + 2n + e its nibble n + 4e): pair t
// (nibbles t, t + 4) of word 2s + h. Int2 (span 8: code word w gives columns 16w to 16w + 15,
// column 16w + 2i + e its code i + 8e): pair 4h + t (codes 4h + t, 4h + t + 8) of word s.
QUANTMLA_HOST_DEVICE constexpr int transposed_key_column(int s, int t, int h, int e) {
  return 16 * s + 8 * h + 2 * t + e;
}
QUANTMLA_HOST_DEVICE constexpr int transposed_key_code_word(int bits, int s, int h) {
  return bits == 4 ? 2 * s + h : s;
}
QUANTMLA_HOST_DEVICE constexpr int transposed_key_code_shift(int bits, int t, int h) {
  return bits == 4 ? 4 * t : 2 * (4 * h + t);
}
// Where column c (0..63) sits: the kernel patches the RoPE pairs kept in BF16 there.
QUANTMLA_HOST_DEVICE constexpr FragmentPlace transposed_key_place(int column) {
  return {column / 16, column % 8 / 2, column % 16 / 8, column % 2};
}

// Content int2 g64 (16 codes a 32-bit word, channel i of word w at bits 2i: channel 16w + i).
// Scores: lane t takes word t of each key's group (channels 16t to 16t + 15); k-step s, register h
// holds the code pair (i, i + 8), i = 2s + h, which one shift by 2i and one mask put into the two
// halves. So the channel of k-step s, lane t, register h, half e is
QUANTMLA_HOST_DEVICE constexpr int int2_key_channel(int s, int t, int h, int e) {
  return 16 * t + 2 * s + h + 8 * e;
}
// and the shift of word t that register h of k-step s takes.
QUANTMLA_HOST_DEVICE constexpr int int2_key_shift(int s, int h) { return 2 * (2 * s + h); }

// Output: m-tile j (0..3) of an int2 g64 group takes rows g and g + 8 from byte g % 4 of code word
// g / 4 (j < 2) or g / 4 + 2 (j >= 2), codes 2 (j % 2) and 2 (j % 2) + 1 of the byte: adjacent
// channels, so that an output column's two rows are one 32-bit store as for int4.
QUANTMLA_HOST_DEVICE constexpr int int2_value_channel(int j, int row) {
  return 32 * (j / 2) + 4 * (row % 8) + 2 * (j % 2) + row / 8;
}
// The shift of that byte's code of row g (+ 2 for row g + 8) after the byte moved to bit 0.
QUANTMLA_HOST_DEVICE constexpr int int2_value_shift(int j) { return 4 * (j % 2); }

// Content fp8 (e4m3 bytes in channel order; one FP32 scale a group of 128 channels). Scores: k-step
// s (0..7) of a group covers channels [16 s, 16 s + 16); lane t reads the group's 32-bit word
// 4 s + t (channels 16 s + 4 t to + 3: the 8 keys' words of a load fall in distinct banks when a
// record is 4 words past a multiple of 32, as with a BF16 RoPE key), whose bytes 2h, 2h + 1 one
// conversion makes register h. So the channel of k-step s, lane t, register h, half e is
QUANTMLA_HOST_DEVICE constexpr int fp8_key_channel(int s, int t, int h, int e) {
  return 16 * s + 4 * t + 2 * h + e;
}
// Output: a warp takes one group (128 channels) as two halves of 64. M-tile j (0..3) of a half puts
// rows g and g + 8 on bytes 2 (j % 2) and 2 (j % 2) + 1 of the half's word g + 8 (j / 2): channels
// of an output column adjacent again, and one byte permute of two keys' words gives two m-tiles'
// registers.
QUANTMLA_HOST_DEVICE constexpr int fp8_value_channel(int j, int row) {
  return 4 * (row % 8) + 32 * (j / 2) + 2 * (j % 2) + row / 8;
}

// The kernel multiplies with the codes themselves: a register half holds code * 2^p, p the code's
// bit position in its 16-bit half once the word is shifted as below, so that one mask isolates it
// (the FP16 subnormal code * 2^(p - 24)). The kernel divides Q's channel (scores) or the output's
// (values) by 2^p.
// Int4 keys: word 2t + (s >> 1) of k-step s shifted right by
QUANTMLA_HOST_DEVICE constexpr int int4_key_word_shift(int s) { return 8 * (s & 1); }
// so that the code of channel c sits at (keys and values alike)
QUANTMLA_HOST_DEVICE constexpr int int4_code_position(int channel) { return 4 * (channel % 2); }
// Int2 keys: word t shifted right by 10 for the codes 5-7 of a half (past FP16's 10 mantissa bits
// otherwise), so that the code of channel c sits at
QUANTMLA_HOST_DEVICE constexpr int int2_key_word_shift(int s, int h) {
  return 2 * s + h >= 5 ? 10 : 0;
}
QUANTMLA_HOST_DEVICE constexpr int int2_key_code_position(int channel) {
  return channel % 8 <= 4 ? 2 * (channel % 8) : 2 * (channel % 8) - 10;
}
// Int2 values: the byte's code of channel c at
QUANTMLA_HOST_DEVICE constexpr int int2_value_code_position(int channel) {
  return 2 * (channel % 4);
}

// The order in which the kernel takes a page's 64 keys for int4 content, chosen so that its
// shared-memory loads of the records are free of bank conflicts when a record is an odd number of
// 32-bit words (`spread`: an int4 RoPE key with an even number of kept pairs). Records are
// contiguous in a stage, so in the natural order the lanes' keys land 4 to a bank. With an even
// number of words (a BF16 RoPE key) no order spreads them further than the natural one (2 to a
// bank); int2 content keeps it too (2 to a bank in the scores only, and the spread order measured
// 4% slower there).
// Scores: warp w's A-tile row `row` (lane group g takes rows g and g + 8; lane (g, t) reads words
// 2t and 2t + 1 of its key's group, so the 8 keys' banks must be {0, 8, 16, 24} and those plus
// one, up to a shift) is key
QUANTMLA_HOST_DEVICE constexpr int score_key(int w, int row, bool spread) {
  return spread ? 32 * (row / 8) + 8 * (row % 8 / 2) + 2 * w + row % 2 : 16 * w + row;
}
// Values: the MMA's k index k (0..15) of k-tile ks (0..3) is key (lane t takes k = 2t, 2t + 1,
// 2t + 8, 2t + 9 and reads word g of each, so each of those four keys' banks must be 8 apart
// over t)
QUANTMLA_HOST_DEVICE constexpr int value_key(int ks, int k, bool spread) {
  const int slot = 4 * ks + 2 * (k / 8) + k % 2;  // 0..15
  return spread ? 32 * (slot / 8) + slot % 8 + 8 * (k % 8 / 2) : 16 * ks + k;
}
// and the column of P^T (16 ks + k) that holds a key's probability.
QUANTMLA_HOST_DEVICE constexpr int value_column(int key, bool spread) {
  if (!spread) return key;
  const int slot = 8 * (key / 32) + key % 8;
  const int q = slot % 4;
  return 16 * (slot / 4) + 2 * (key % 32 / 8) + q % 2 + 8 * (q / 2);
}

// The kernel loads Q for a k-step as two words, channels (c, c + 1) and (c + 4, c + 5), and a BF16
// path's registers as one word each: the maps must keep those neighbours (checked for every
// k-step and lane by the host test too).
static_assert(int4_key_channel(1, 2, 1, 0) == int4_key_channel(1, 2, 0, 0) + 1 &&
              int4_key_channel(1, 2, 0, 1) == int4_key_channel(1, 2, 0, 0) + 4 &&
              bf16_key_channel(2, 1, 0, 1) == bf16_key_channel(2, 1, 0, 0) + 1);
static_assert(int4_key_channel(3, 3, 1, 1) == 63 && int4_value_channel(3, 15) == 63);
static_assert(int2_key_channel(1, 2, 1, 0) == int2_key_channel(1, 2, 0, 0) + 1 &&
              int2_key_channel(1, 2, 0, 1) == int2_key_channel(1, 2, 0, 0) + 8);
static_assert(int2_key_channel(3, 3, 1, 1) == 63 && int2_value_channel(3, 15) == 63 &&
              int2_value_channel(2, 8) == int2_value_channel(2, 0) + 1);

}  // namespace quantmla::gpu
