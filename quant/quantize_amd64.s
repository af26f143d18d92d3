//go:build amd64 && !purego

#include "textflag.h"

// The block quantizer with AVX2. One iteration handles a block of 32
// float32 elements: 32 int8 codes, or 16 bytes of packed int4 codes.
//
// Quantizing: y = x*q_scale (VMULPS), clamped with VMAXPS(y, lo) and
// VMINPS(y, hi) (a NaN product becomes lo, as in the portable code), then
// VCVTPS2DQ, which rounds half to even under the default MXCSR that Go
// keeps. VPACKSSDW and VPACKSSWB narrow four vectors of 8 int32 to 32
// bytes in the dword order a0 b0 c0 d0 a1 b1 c1 d1 (a0 = elements 0..3 of
// the first vector, a1 its elements 4..7); VPERMD restores element order.
// For int4 the codes are masked to nibbles and VPMADDUBSW with the bytes
// 16, 1 makes each word hi*16 + lo, the packed byte; VPACKUSWB and VPERMQ
// gather the 16 bytes.
//
// Dequantizing: int8 codes widen with VPMOVSXBD; packed int4 bytes are
// split into nibbles, interleaved high nibble first, and mapped to signed
// bytes with a VPSHUFB table. code*scale (VMULPS) is then added to dst
// (VADDPS): two roundings, as the portable code does.

DATA qAbsMask<>+0(SB)/4, $0x7fffffff
GLOBL qAbsMask<>(SB), RODATA|NOPTR, $4

DATA qLo8<>+0(SB)/4, $0xc3000000 // -128
GLOBL qLo8<>(SB), RODATA|NOPTR, $4
DATA qHi8<>+0(SB)/4, $0x42fe0000 // 127
GLOBL qHi8<>(SB), RODATA|NOPTR, $4
DATA qLo4<>+0(SB)/4, $0xc1000000 // -8
GLOBL qLo4<>(SB), RODATA|NOPTR, $4
DATA qHi4<>+0(SB)/4, $0x40e00000 // 7
GLOBL qHi4<>(SB), RODATA|NOPTR, $4

// VPERMD indices restoring element order after the two packs.
DATA qPerm<>+0(SB)/4, $0
DATA qPerm<>+4(SB)/4, $4
DATA qPerm<>+8(SB)/4, $1
DATA qPerm<>+12(SB)/4, $5
DATA qPerm<>+16(SB)/4, $2
DATA qPerm<>+20(SB)/4, $6
DATA qPerm<>+24(SB)/4, $3
DATA qPerm<>+28(SB)/4, $7
GLOBL qPerm<>(SB), RODATA|NOPTR, $32

DATA qNib<>+0(SB)/8, $0x0f0f0f0f0f0f0f0f
DATA qNib<>+8(SB)/8, $0x0f0f0f0f0f0f0f0f
DATA qNib<>+16(SB)/8, $0x0f0f0f0f0f0f0f0f
DATA qNib<>+24(SB)/8, $0x0f0f0f0f0f0f0f0f
GLOBL qNib<>(SB), RODATA|NOPTR, $32

// VPMADDUBSW weights: the first element of a pair to the high nibble.
DATA qMadd<>+0(SB)/8, $0x0110011001100110
DATA qMadd<>+8(SB)/8, $0x0110011001100110
DATA qMadd<>+16(SB)/8, $0x0110011001100110
DATA qMadd<>+24(SB)/8, $0x0110011001100110
GLOBL qMadd<>(SB), RODATA|NOPTR, $32

// VPSHUFB table from an unsigned nibble to its two's-complement value.
DATA qNibTab<>+0(SB)/8, $0x0706050403020100
DATA qNibTab<>+8(SB)/8, $0xfffefdfcfbfaf9f8
GLOBL qNibTab<>(SB), RODATA|NOPTR, $16

// func amaxAVX2(x *float32, blocks int) float32
TEXT ·amaxAVX2(SB), NOSPLIT, $0-20
	MOVQ x+0(FP), SI
	MOVQ blocks+8(FP), CX
	VBROADCASTSS qAbsMask<>(SB), Y7
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3

amaxLoop:
	VANDPS (SI), Y7, Y4
	VANDPS 32(SI), Y7, Y5
	VANDPS 64(SI), Y7, Y6
	VANDPS 96(SI), Y7, Y8
	// VMAXPS returns its second source (the accumulator) unless the
	// first is greater: NaN is skipped.
	VMAXPS Y0, Y4, Y0
	VMAXPS Y1, Y5, Y1
	VMAXPS Y2, Y6, Y2
	VMAXPS Y3, Y8, Y3
	ADDQ $128, SI
	DECQ CX
	JNZ  amaxLoop

	VMAXPS       Y1, Y0, Y0
	VMAXPS       Y3, Y2, Y2
	VMAXPS       Y2, Y0, Y0
	VEXTRACTF128 $1, Y0, X1
	VMAXPS       X1, X0, X0
	VPSHUFD      $0x4e, X0, X1
	VMAXPS       X1, X0, X0
	VPSHUFD      $0xb1, X0, X1
	VMAXPS       X1, X0, X0
	VZEROUPPER
	MOVSS        X0, ret+16(FP)
	RET

// QUANT32 leaves the 32 int8 codes of the block at SI in Y0, in element
// order. Y15 = q_scale, Y14 = lo, Y13 = hi, Y12 = qPerm.
#define QUANT32 \
	VMULPS    (SI), Y15, Y0 \
	VMULPS    32(SI), Y15, Y1 \
	VMULPS    64(SI), Y15, Y2 \
	VMULPS    96(SI), Y15, Y3 \
	VMAXPS    Y14, Y0, Y0 \
	VMAXPS    Y14, Y1, Y1 \
	VMAXPS    Y14, Y2, Y2 \
	VMAXPS    Y14, Y3, Y3 \
	VMINPS    Y13, Y0, Y0 \
	VMINPS    Y13, Y1, Y1 \
	VMINPS    Y13, Y2, Y2 \
	VMINPS    Y13, Y3, Y3 \
	VCVTPS2DQ Y0, Y0 \
	VCVTPS2DQ Y1, Y1 \
	VCVTPS2DQ Y2, Y2 \
	VCVTPS2DQ Y3, Y3 \
	VPACKSSDW Y1, Y0, Y0 \
	VPACKSSDW Y3, Y2, Y2 \
	VPACKSSWB Y2, Y0, Y0 \
	VPERMD    Y0, Y12, Y0

// func quant8AVX2(dst *byte, src *float32, blocks int, qs float32)
TEXT ·quant8AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         blocks+16(FP), CX
	VBROADCASTSS qs+24(FP), Y15
	VBROADCASTSS qLo8<>(SB), Y14
	VBROADCASTSS qHi8<>(SB), Y13
	VMOVDQU      qPerm<>(SB), Y12

q8Loop:
	QUANT32
	VMOVDQU Y0, (DI)
	ADDQ    $128, SI
	ADDQ    $32, DI
	DECQ    CX
	JNZ     q8Loop
	VZEROUPPER
	RET

// func quant4AVX2(dst *byte, src *float32, blocks int, qs float32)
TEXT ·quant4AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         blocks+16(FP), CX
	VBROADCASTSS qs+24(FP), Y15
	VBROADCASTSS qLo4<>(SB), Y14
	VBROADCASTSS qHi4<>(SB), Y13
	VMOVDQU      qPerm<>(SB), Y12
	VMOVDQU      qNib<>(SB), Y11
	VMOVDQU      qMadd<>(SB), Y10

q4Loop:
	QUANT32
	VPAND      Y11, Y0, Y0
	VPMADDUBSW Y10, Y0, Y0
	VPACKUSWB  Y0, Y0, Y0
	VPERMQ     $0x08, Y0, Y0
	VMOVDQU    X0, (DI)
	ADDQ       $128, SI
	ADDQ       $16, DI
	DECQ       CX
	JNZ        q4Loop
	VZEROUPPER
	RET

// ACC8 adds Y(r)*scale to the 8 floats at off(DI).
#define ACC8(r, off) \
	VCVTDQ2PS r, r \
	VMULPS    Y15, r, r \
	VADDPS    off(DI), r, r \
	VMOVUPS   r, off(DI)

// func dequantAdd8AVX2(dst *float32, src *byte, blocks int, scale float32)
TEXT ·dequantAdd8AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         blocks+16(FP), CX
	VBROADCASTSS scale+24(FP), Y15

d8Loop:
	VPMOVSXBD (SI), Y0
	VPMOVSXBD 8(SI), Y1
	VPMOVSXBD 16(SI), Y2
	VPMOVSXBD 24(SI), Y3
	ACC8(Y0, 0)
	ACC8(Y1, 32)
	ACC8(Y2, 64)
	ACC8(Y3, 96)
	ADDQ      $32, SI
	ADDQ      $128, DI
	DECQ      CX
	JNZ       d8Loop
	VZEROUPPER
	RET

// func dequantAdd4AVX2(dst *float32, src *byte, blocks int, scale float32)
TEXT ·dequantAdd4AVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         blocks+16(FP), CX
	VBROADCASTSS scale+24(FP), Y15
	VMOVDQU      qNib<>(SB), X11
	VMOVDQU      qNibTab<>(SB), X10

d4Loop:
	VMOVDQU    (SI), X0
	VPSRLW     $4, X0, X1
	VPAND      X11, X1, X1 // high nibbles
	VPAND      X11, X0, X0 // low nibbles
	VPUNPCKLBW X0, X1, X2  // codes 0..15, high nibble first
	VPUNPCKHBW X0, X1, X3  // codes 16..31
	VPSHUFB    X2, X10, X2
	VPSHUFB    X3, X10, X3
	VPMOVSXBD  X2, Y0
	VPSRLDQ    $8, X2, X2
	VPMOVSXBD  X2, Y1
	VPMOVSXBD  X3, Y2
	VPSRLDQ    $8, X3, X3
	VPMOVSXBD  X3, Y3
	ACC8(Y0, 0)
	ACC8(Y1, 32)
	ACC8(Y2, 64)
	ACC8(Y3, 96)
	ADDQ       $16, SI
	ADDQ       $128, DI
	DECQ       CX
	JNZ        d4Loop
	VZEROUPPER
	RET
