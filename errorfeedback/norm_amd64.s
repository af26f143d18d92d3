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

// SUM_ADD_SQ is ADD_SQ without the store: x is left as it is.
#define SUM_ADD_SQ(off, Ylo, Yhi) \
	VMOVUPS      off(DI), Y0 \
	VADDPS       off(SI), Y0, Y0 \
	VCVTPS2PD    X0, Y1 \
	VEXTRACTF128 $1, Y0, X2 \
	VCVTPS2PD    X2, Y2 \
	VFMADD231PD  Y1, Y1, Ylo \
	VFMADD231PD  Y2, Y2, Yhi

// func sumAddedSquaresAVX2(x, in *float32, blocks int) float64
TEXT ·sumAddedSquaresAVX2(SB), NOSPLIT, $0-32
	MOVQ x+0(FP), DI
	MOVQ in+8(FP), SI
	MOVQ blocks+16(FP), CX
	ZERO_ACC
	TESTQ CX, CX
	JZ    sumAddDone

sumAddLoop:
	SUM_ADD_SQ(0, Y8, Y9)
	SUM_ADD_SQ(32, Y10, Y11)
	SUM_ADD_SQ(64, Y12, Y13)
	SUM_ADD_SQ(96, Y14, Y15)
	ADDQ $128, DI
	ADDQ $128, SI
	DECQ CX
	JNZ  sumAddLoop

sumAddDone:
	REDUCE_ACC
	MOVSD X8, ret+24(FP)
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

// func sumAddedSquaresLanesAVX2(acc *[32]float64, x, in *float32, blocks int)
TEXT ·sumAddedSquaresLanesAVX2(SB), NOSPLIT, $0-32
	MOVQ acc+0(FP), AX
	MOVQ x+8(FP), DI
	MOVQ in+16(FP), SI
	MOVQ blocks+24(FP), CX
	TESTQ CX, CX
	JZ    sumLanesRet
	LOAD_ACC

sumLanesLoop:
	SUM_ADD_SQ(0, Y8, Y9)
	SUM_ADD_SQ(32, Y10, Y11)
	SUM_ADD_SQ(64, Y12, Y13)
	SUM_ADD_SQ(96, Y14, Y15)
	ADDQ $128, DI
	ADDQ $128, SI
	DECQ CX
	JNZ  sumLanesLoop
	STORE_ACC

sumLanesRet:
	RET
