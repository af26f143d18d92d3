//go:build amd64 && !purego

#include "textflag.h"

// Sums of squares with AVX2 and FMA. One iteration handles a block of 32
// float32 elements. Each group of 8 is widened to float64 in two halves of
// 4 (VCVTPS2PD) and squared into its own accumulator (VFMADD231PD), so the
// loop keeps 8 independent float64 accumulators, Y8..Y15, each holding 4
// partial sums. The square of a float32 is exact in float64, so the fused
// multiply-add rounds exactly as a multiply then an add would; the result
// differs from the scalar code's only in the order of summation.

// ZERO_ACC clears the accumulators Y8..Y15.
#define ZERO_ACC \
	VXORPD Y8, Y8, Y8 \
	VXORPD Y9, Y9, Y9 \
	VXORPD Y10, Y10, Y10 \
	VXORPD Y11, Y11, Y11 \
	VXORPD Y12, Y12, Y12 \
	VXORPD Y13, Y13, Y13 \
	VXORPD Y14, Y14, Y14 \
	VXORPD Y15, Y15, Y15

// REDUCE_ACC sums the 32 partial sums in Y8..Y15 into X8 (low lane) and
// clears the upper halves of the ymm registers.
#define REDUCE_ACC \
	VADDPD       Y9, Y8, Y8 \
	VADDPD       Y11, Y10, Y10 \
	VADDPD       Y13, Y12, Y12 \
	VADDPD       Y15, Y14, Y14 \
	VADDPD       Y10, Y8, Y8 \
	VADDPD       Y14, Y12, Y12 \
	VADDPD       Y12, Y8, Y8 \
	VEXTRACTF128 $1, Y8, X9 \
	VADDPD       X9, X8, X8 \
	VUNPCKHPD    X8, X8, X9 \
	VADDSD       X9, X8, X8 \
	VZEROUPPER

// ADD_SQ adds the 8 elements of in at off(SI) to those of x at off(DI),
// stores the sums back into x and adds their squares into Ylo (elements
// 0..3) and Yhi (4..7). x is the first operand of the addition, as in the
// generic x[i] + in[i], so that NaNs come out identical.
#define ADD_SQ(off, Ylo, Yhi) \
	VMOVUPS      off(DI), Y0 \
	VADDPS       off(SI), Y0, Y0 \
	VMOVUPS      Y0, off(DI) \
	VCVTPS2PD    X0, Y1 \
	VEXTRACTF128 $1, Y0, X2 \
	VCVTPS2PD    X2, Y2 \
	VFMADD231PD  Y1, Y1, Ylo \
	VFMADD231PD  Y2, Y2, Yhi

// func addSumSquaresAVX2(x, in *float32, blocks int) float64
TEXT ·addSumSquaresAVX2(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), DI
	MOVQ in+8(FP), SI
	MOVQ blocks+16(FP), CX
	ZERO_ACC
	TESTQ CX, CX
	JZ    addDone

addLoop:
	ADD_SQ(0, Y8, Y9)
	ADD_SQ(32, Y10, Y11)
	ADD_SQ(64, Y12, Y13)
	ADD_SQ(96, Y14, Y15)
	ADDQ $128, DI
	ADDQ $128, SI
	DECQ CX
	JNZ  addLoop

addDone:
	REDUCE_ACC
	MOVSD X8, ret+24(FP)
	RET

// SQ widens the 4 elements at off(DI) and adds their squares into Yacc.
#define SQ(off, Yt, Yacc) \
	VCVTPS2PD   off(DI), Yt \
	VFMADD231PD Yt, Yt, Yacc

// func sumSquaresAVX2(x *float32, blocks int) float64
TEXT ·sumSquaresAVX2(SB), NOSPLIT, $0-24
	MOVQ x+0(FP), DI
	MOVQ blocks+8(FP), CX
	ZERO_ACC
	TESTQ CX, CX
	JZ    sumDone

sumLoop:
	SQ(0, Y0, Y8)
	SQ(16, Y1, Y9)
	SQ(32, Y2, Y10)
	SQ(48, Y3, Y11)
	SQ(64, Y4, Y12)
	SQ(80, Y5, Y13)
	SQ(96, Y6, Y14)
	SQ(112, Y7, Y15)
	ADDQ $128, DI
	DECQ CX
	JNZ  sumLoop

sumDone:
	REDUCE_ACC
	MOVSD X8, ret+16(FP)
	RET

// LOAD_ACC and STORE_ACC move the 32 partial sums between acc (AX) and
// Y8..Y15, element i of a block in acc[i].
#define LOAD_ACC \
	VMOVUPD 0(AX), Y8 \
	VMOVUPD 32(AX), Y9 \
	VMOVUPD 64(AX), Y10 \
	VMOVUPD 96(AX), Y11 \
	VMOVUPD 128(AX), Y12 \
	VMOVUPD 160(AX), Y13 \
	VMOVUPD 192(AX), Y14 \
	VMOVUPD 224(AX), Y15

#define STORE_ACC \
	VMOVUPD Y8, 0(AX) \
	VMOVUPD Y9, 32(AX) \
	VMOVUPD Y10, 64(AX) \
	VMOVUPD Y11, 96(AX) \
	VMOVUPD Y12, 128(AX) \
	VMOVUPD Y13, 160(AX) \
	VMOVUPD Y14, 192(AX) \
	VMOVUPD Y15, 224(AX) \
	VZEROUPPER

// func addSumSquaresLanesAVX2(acc *[32]float64, x, in *float32, blocks int)
TEXT ·addSumSquaresLanesAVX2(SB), NOSPLIT, $0-32
	MOVQ acc+0(FP), AX
	MOVQ x+8(FP), DI
	MOVQ in+16(FP), SI
	MOVQ blocks+24(FP), CX
	TESTQ CX, CX
	JZ    addLanesRet
	LOAD_ACC

addLanesLoop:
	ADD_SQ(0, Y8, Y9)
	ADD_SQ(32, Y10, Y11)
	ADD_SQ(64, Y12, Y13)
	ADD_SQ(96, Y14, Y15)
	ADDQ $128, DI
	ADDQ $128, SI
	DECQ CX
	JNZ  addLanesLoop
	STORE_ACC

addLanesRet:
	RET

// The fused compensate-norm-pack kernel packs signs exactly as package
// signpack's AVX2 kernels do (see pack_amd64.s there): a compare gives a
// mask per element, VPACKSSDW and VPACKSSWB narrow four masks to bytes,
// VPERMD with fusePerm puts each group of 8 together, high half first,
// VPSHUFB with fuseShuf reverses the bytes of every dword, and VPMOVMSKB
// yields the 4 packed bytes of 32 elements, the first element in the most
// significant bit of its byte.
DATA fusePerm<>+0(SB)/4, $4
DATA fusePerm<>+4(SB)/4, $0
DATA fusePerm<>+8(SB)/4, $5
DATA fusePerm<>+12(SB)/4, $1
DATA fusePerm<>+16(SB)/4, $6
DATA fusePerm<>+20(SB)/4, $2
DATA fusePerm<>+24(SB)/4, $7
DATA fusePerm<>+28(SB)/4, $3
GLOBL fusePerm<>(SB), RODATA|NOPTR, $32

DATA fuseShuf<>+0(SB)/8, $0x0405060700010203
DATA fuseShuf<>+8(SB)/8, $0x0c0d0e0f08090a0b
DATA fuseShuf<>+16(SB)/8, $0x0405060700010203
DATA fuseShuf<>+24(SB)/8, $0x0c0d0e0f08090a0b
GLOBL fuseShuf<>(SB), RODATA|NOPTR, $32

DATA fuseZero<>+0(SB)/8, $0
DATA fuseZero<>+8(SB)/8, $0
DATA fuseZero<>+16(SB)/8, $0
DATA fuseZero<>+24(SB)/8, $0
GLOBL fuseZero<>(SB), RODATA|NOPTR, $32

// FUSE_SQ forms the 8 sums x + in at off (x first, as in the generic
// x[i] + in[i]), stores them into x, sets Ym to their sign mask (1 for
// x >= 0, -0.0 and NaN: NLT_UQ against zero, as signpack's residual
// kernel) and adds their squares into Ylo (elements 0..3) and Yhi (4..7).
// Y4..Y6 are scratch.
#define FUSE_SQ(off, Ym, Ylo, Yhi) \
	VMOVUPS      off(DI), Y4 \
	VADDPS       off(SI), Y4, Y4 \
	VMOVUPS      Y4, off(DI) \
	VCMPPS       $0x15, fuseZero<>(SB), Y4, Ym \
	VCVTPS2PD    X4, Y5 \
	VEXTRACTF128 $1, Y4, X6 \
	VCVTPS2PD    X6, Y6 \
	VFMADD231PD  Y5, Y5, Ylo \
	VFMADD231PD  Y6, Y6, Yhi

// FUSE_BLOCK handles one block of 32 elements and writes its 4 packed
// bytes to (DX).
#define FUSE_BLOCK \
	FUSE_SQ(0, Y0, Y8, Y9) \
	FUSE_SQ(32, Y1, Y10, Y11) \
	FUSE_SQ(64, Y2, Y12, Y13) \
	FUSE_SQ(96, Y3, Y14, Y15) \
	VPACKSSDW Y1, Y0, Y0 \
	VPACKSSDW Y3, Y2, Y2 \
	VPACKSSWB Y2, Y0, Y0 \
	VPERMD    Y0, Y7, Y0 \
	VPSHUFB   fuseShuf<>(SB), Y0, Y0 \
	VPMOVMSKB Y0, BX \
	MOVL      BX, (DX)

// func compensatePackAVX2(acc *[32]float64, x, in *float32, dst *byte, blocks int)
TEXT ·compensatePackAVX2(SB), NOSPLIT, $0-40
	MOVQ acc+0(FP), AX
	MOVQ x+8(FP), DI
	MOVQ in+16(FP), SI
	MOVQ dst+24(FP), DX
	MOVQ blocks+32(FP), CX
	TESTQ CX, CX
	JZ    fuseRet
	LOAD_ACC
	VMOVDQU fusePerm<>(SB), Y7

fuseLoop:
	FUSE_BLOCK
	ADDQ $128, DI
	ADDQ $128, SI
	ADDQ $4, DX
	DECQ CX
	JNZ  fuseLoop
	STORE_ACC

fuseRet:
	RET
