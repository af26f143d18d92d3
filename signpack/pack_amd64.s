//go:build amd64 && !purego

#include "textflag.h"

// Sign packing with AVX2. One iteration handles a block of 32 float32
// elements and 4 packed bytes.
//
// Packing: VCMPPS gives an all-ones lane for every element that packs as 1
// (x >= 0 or NaN: predicate NGT_UQ on 0 > x, which also makes -0.0 a 1).
// VPACKSSDW and VPACKSSWB narrow the four masks to bytes (in lane order
// c0[0:4] c1[0:4] c2[0:4] c3[0:4] | c0[4:8] c1[4:8] c2[4:8] c3[4:8]),
// VPERMD puts the dwords of each group of 8 together, high half first, and
// VPSHUFB reverses the bytes of each dword, so that element 8k+i sits in
// byte 8k+7-i. VPMOVMSKB then yields the 4 packed bytes with the first
// element of each byte in its most significant bit.
//
// Unpacking: the 4 packed bytes are broadcast to every lane as one
// little-endian dword; VPSLLVD shifts the bit of element 8k+i (bit
// 8k+7-i of the dword) into the sign position. -scale XOR that sign bit is
// +scale for bit 1 and -scale for bit 0.

// VPERMD indices: for each group of 8 elements, its elements 4..7 then 0..3.
DATA packPerm<>+0(SB)/4, $4
DATA packPerm<>+4(SB)/4, $0
DATA packPerm<>+8(SB)/4, $5
DATA packPerm<>+12(SB)/4, $1
DATA packPerm<>+16(SB)/4, $6
DATA packPerm<>+20(SB)/4, $2
DATA packPerm<>+24(SB)/4, $7
DATA packPerm<>+28(SB)/4, $3
GLOBL packPerm<>(SB), RODATA|NOPTR, $32

// VPSHUFB control reversing the bytes of every dword.
DATA packShuf<>+0(SB)/8, $0x0405060700010203
DATA packShuf<>+8(SB)/8, $0x0c0d0e0f08090a0b
DATA packShuf<>+16(SB)/8, $0x0405060700010203
DATA packShuf<>+24(SB)/8, $0x0c0d0e0f08090a0b
GLOBL packShuf<>(SB), RODATA|NOPTR, $32

// VPSLLVD counts: element i of group k (bit 8k+7-i) goes to bit 31.
DATA unpackShift<>+0(SB)/4, $24
DATA unpackShift<>+4(SB)/4, $25
DATA unpackShift<>+8(SB)/4, $26
DATA unpackShift<>+12(SB)/4, $27
DATA unpackShift<>+16(SB)/4, $28
DATA unpackShift<>+20(SB)/4, $29
DATA unpackShift<>+24(SB)/4, $30
DATA unpackShift<>+28(SB)/4, $31
DATA unpackShift<>+32(SB)/4, $16
DATA unpackShift<>+36(SB)/4, $17
DATA unpackShift<>+40(SB)/4, $18
DATA unpackShift<>+44(SB)/4, $19
DATA unpackShift<>+48(SB)/4, $20
DATA unpackShift<>+52(SB)/4, $21
DATA unpackShift<>+56(SB)/4, $22
DATA unpackShift<>+60(SB)/4, $23
DATA unpackShift<>+64(SB)/4, $8
DATA unpackShift<>+68(SB)/4, $9
DATA unpackShift<>+72(SB)/4, $10
DATA unpackShift<>+76(SB)/4, $11
DATA unpackShift<>+80(SB)/4, $12
DATA unpackShift<>+84(SB)/4, $13
DATA unpackShift<>+88(SB)/4, $14
DATA unpackShift<>+92(SB)/4, $15
DATA unpackShift<>+96(SB)/4, $0
DATA unpackShift<>+100(SB)/4, $1
DATA unpackShift<>+104(SB)/4, $2
DATA unpackShift<>+108(SB)/4, $3
DATA unpackShift<>+112(SB)/4, $4
DATA unpackShift<>+116(SB)/4, $5
DATA unpackShift<>+120(SB)/4, $6
DATA unpackShift<>+124(SB)/4, $7
GLOBL unpackShift<>(SB), RODATA|NOPTR, $128

// PACK4 narrows the masks in Y0..Y3 (elements 0..31) to the packed dword
// in AX. Clobbers Y0 and Y2.
#define PACK4 \
	VPACKSSDW Y1, Y0, Y0 \
	VPACKSSDW Y3, Y2, Y2 \
	VPACKSSWB Y2, Y0, Y0 \
	VPERMD    Y0, Y14, Y0 \
	VPSHUFB   Y13, Y0, Y0 \
	VPMOVMSKB Y0, AX

// func packAVX2(dst *byte, src *float32, blocks int)
TEXT ·packAVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX
	TESTQ CX, CX
	JZ   packDone
	VPXOR   Y15, Y15, Y15
	VMOVDQU packPerm<>(SB), Y14
	VMOVDQU packShuf<>(SB), Y13

packLoop:
	// Y = !(0 > x): 1 for x >= 0, -0.0 and NaN.
	VCMPPS $0x1a, (SI), Y15, Y0
	VCMPPS $0x1a, 32(SI), Y15, Y1
	VCMPPS $0x1a, 64(SI), Y15, Y2
	VCMPPS $0x1a, 96(SI), Y15, Y3
	PACK4
	MOVL AX, (DI)
	ADDQ $128, SI
	ADDQ $4, DI
	DECQ CX
	JNZ  packLoop
	VZEROUPPER

packDone:
	RET

// RESID computes the mask of the vector at off(SI) into Ym and writes
// x - scale (mask set) or x + scale (mask clear) back. Y12 holds scale,
// Y15 zero; Y8..Y10 are scratch.
#define RESID(off, Ym) \
	VMOVUPS   off(SI), Y8 \
	VCMPPS    $0x15, Y15, Y8, Ym \
	VSUBPS    Y12, Y8, Y9 \
	VADDPS    Y12, Y8, Y10 \
	VBLENDVPS Ym, Y9, Y10, Y9 \
	VMOVUPS   Y9, off(SI)

// func packResidualAVX2(dst *byte, x *float32, blocks int, scale float32)
TEXT ·packResidualAVX2(SB), NOSPLIT, $0-28
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ blocks+16(FP), CX
	TESTQ CX, CX
	JZ   residDone
	VBROADCASTSS scale+24(FP), Y12
	VPXOR   Y15, Y15, Y15
	VMOVDQU packPerm<>(SB), Y14
	VMOVDQU packShuf<>(SB), Y13

residLoop:
	// Mask = !(x < 0) (NLT_UQ): 1 for x >= 0, -0.0 and NaN. x - scale is
	// computed as such (not as x + -scale) so that NaNs come out exactly
	// as the generic code's do.
	RESID(0, Y0)
	RESID(32, Y1)
	RESID(64, Y2)
	RESID(96, Y3)
	PACK4
	MOVL AX, (DI)
	ADDQ $128, SI
	ADDQ $4, DI
	DECQ CX
	JNZ  residLoop
	VZEROUPPER

residDone:
	RET

// UNPACK_SETUP loads the constants of the unpack kernels: Y4..Y7 the shift
// counts, Y11 the sign bit, Y10 -scale.
#define UNPACK_SETUP \
	VBROADCASTSS scale+24(FP), Y12 \
	MOVL         $0x80000000, AX \
	MOVQ         AX, X11 \
	VPBROADCASTD X11, Y11 \
	VXORPS       Y11, Y12, Y10 \
	VMOVDQU      unpackShift<>+0(SB), Y4 \
	VMOVDQU      unpackShift<>+32(SB), Y5 \
	VMOVDQU      unpackShift<>+64(SB), Y6 \
	VMOVDQU      unpackShift<>+96(SB), Y7

// SIGNED sets Yd to ±scale for the group of 8 elements whose shift counts
// are in Ycnt, from the broadcast packed dword in Y0.
#define SIGNED(Ycnt, Yd) \
	VPSLLVD Ycnt, Y0, Yd \
	VPAND   Y11, Yd, Yd \
	VPXOR   Y10, Yd, Yd

// UNPACK4 sets Y1, Y2, Y3 and Y8 to the ±scale of the 32 elements whose
// packed dword is at (SI).
#define UNPACK4 \
	VPBROADCASTD (SI), Y0 \
	SIGNED(Y4, Y1) \
	SIGNED(Y5, Y2) \
	SIGNED(Y6, Y3) \
	SIGNED(Y7, Y8)

// func unpackScaleAVX2(dst *float32, src *byte, blocks int, scale float32)
TEXT ·unpackScaleAVX2(SB), NOSPLIT, $0-28
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX
	TESTQ CX, CX
	JZ   unpackDone
	UNPACK_SETUP

unpackLoop:
	UNPACK4
	VMOVUPS Y1, (DI)
	VMOVUPS Y2, 32(DI)
	VMOVUPS Y3, 64(DI)
	VMOVUPS Y8, 96(DI)
	ADDQ $4, SI
	ADDQ $128, DI
	DECQ CX
	JNZ  unpackLoop
	VZEROUPPER

unpackDone:
	RET

// func unpackScaleStreamAVX2(dst *float32, src *byte, blocks int, scale float32)
//
// unpackScaleAVX2 with non-temporal stores (dst 32-byte aligned): the
// lines go to memory through the write-combining buffers without being
// read for ownership first. SFENCE makes them visible before any store
// the caller makes after it, as ordinary stores would be.
TEXT ·unpackScaleStreamAVX2(SB), NOSPLIT, $0-28
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX
	TESTQ CX, CX
	JZ   streamDone
	UNPACK_SETUP

streamLoop:
	UNPACK4
	VMOVNTPS Y1, (DI)
	VMOVNTPS Y2, 32(DI)
	VMOVNTPS Y3, 64(DI)
	VMOVNTPS Y8, 96(DI)
	ADDQ $4, SI
	ADDQ $128, DI
	DECQ CX
	JNZ  streamLoop
	SFENCE
	VZEROUPPER

streamDone:
	RET

// func unpackScaleAddAVX2(acc *float32, src *byte, blocks int, scale float32)
TEXT ·unpackScaleAddAVX2(SB), NOSPLIT, $0-28
	MOVQ acc+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX
	TESTQ CX, CX
	JZ   addDone
	UNPACK_SETUP

addLoop:
	UNPACK4

	// acc + (±scale) with acc as the first operand, like the generic
	// acc[i] += s, so that NaNs come out identical.
	VMOVUPS (DI), Y9
	VADDPS  Y1, Y9, Y9
	VMOVUPS Y9, (DI)
	VMOVUPS 32(DI), Y9
	VADDPS  Y2, Y9, Y9
	VMOVUPS Y9, 32(DI)
	VMOVUPS 64(DI), Y9
	VADDPS  Y3, Y9, Y9
	VMOVUPS Y9, 64(DI)
	VMOVUPS 96(DI), Y9
	VADDPS  Y8, Y9, Y9
	VMOVUPS Y9, 96(DI)
	ADDQ $4, SI
	ADDQ $128, DI
	DECQ CX
	JNZ  addLoop
	VZEROUPPER

addDone:
	RET

// func readAVX2(p *float32, blocks int) uint32
TEXT ·readAVX2(SB), NOSPLIT, $0-20
	MOVQ p+0(FP), SI
	MOVQ blocks+8(FP), CX
	VPXOR Y0, Y0, Y0
	VPXOR Y1, Y1, Y1
	VPXOR Y2, Y2, Y2
	VPXOR Y3, Y3, Y3
	TESTQ CX, CX
	JZ   readDone

readLoop:
	VPOR (SI), Y0, Y0
	VPOR 32(SI), Y1, Y1
	VPOR 64(SI), Y2, Y2
	VPOR 96(SI), Y3, Y3
	VPOR 128(SI), Y0, Y0
	VPOR 160(SI), Y1, Y1
	VPOR 192(SI), Y2, Y2
	VPOR 224(SI), Y3, Y3
	ADDQ $256, SI
	DECQ CX
	JNZ  readLoop

readDone:
	VPOR Y1, Y0, Y0
	VPOR Y3, Y2, Y2
	VPOR Y2, Y0, Y0
	VEXTRACTI128 $1, Y0, X1
	VPOR   X1, X0, X0
	VPSHUFD $0x4e, X0, X1
	VPOR   X1, X0, X0
	VPSHUFD $0xb1, X0, X1
	VPOR   X1, X0, X0
	MOVL   X0, AX
	VZEROUPPER
	MOVL   AX, ret+16(FP)
	RET
