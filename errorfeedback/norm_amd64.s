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

// FUSE_IN forms the 8 sums x + in of x at off(DI) and in (a register or
// memory operand; x first, as in the generic x[i] + in[i]), stores them
// into x, sets Ym to their sign mask (1 for x >= 0, -0.0 and NaN: NLT_UQ
// against zero, as signpack's residual kernel) and adds their squares into
// Ylo (elements 0..3) and Yhi (4..7). Y4..Y6 are scratch.
#define FUSE_IN(off, in, Ym, Ylo, Yhi) \
	VMOVUPS      off(DI), Y4 \
	VADDPS       in, Y4, Y4 \
	VMOVUPS      Y4, off(DI) \
	VCMPPS       $0x15, fuseZero<>(SB), Y4, Ym \
	VCVTPS2PD    X4, Y5 \
	VEXTRACTF128 $1, Y4, X6 \
	VCVTPS2PD    X6, Y6 \
	VFMADD231PD  Y5, Y5, Ylo \
	VFMADD231PD  Y6, Y6, Yhi

// FUSE_SQ is FUSE_IN with in at off(SI).
#define FUSE_SQ(off, Ym, Ylo, Yhi) FUSE_IN(off, off(SI), Ym, Ylo, Yhi)

// FUSE_BLOCK handles one block of 32 elements and writes its 4 packed
// bytes to (DX).
#define FUSE_BLOCK \
	FUSE_SQ(0, Y0, Y8, Y9) \
	FUSE_SQ(32, Y1, Y10, Y11) \
	FUSE_SQ(64, Y2, Y12, Y13) \
	FUSE_SQ(96, Y3, Y14, Y15) \
	FUSE_PACK

// FUSE_PACK narrows the masks of a block in Y0..Y3 to its 4 packed bytes
// and writes them to (DX), fusePerm in Y7. Clobbers Y0, Y2 and BX.
#define FUSE_PACK \
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

// The summing kernel forms in from packed signs, as signpack's unpack
// kernels do (see pack_amd64.s there): the 4 packed bytes of a block are
// broadcast to every lane as one little-endian dword, VPSLLVD with
// sumShift shifts the bit of element 8k+i (bit 8k+7-i) into the sign
// position, and -scale XOR that sign bit is +scale for bit 1 and -scale
// for bit 0.
DATA sumShift<>+0(SB)/4, $24
DATA sumShift<>+4(SB)/4, $25
DATA sumShift<>+8(SB)/4, $26
DATA sumShift<>+12(SB)/4, $27
DATA sumShift<>+16(SB)/4, $28
DATA sumShift<>+20(SB)/4, $29
DATA sumShift<>+24(SB)/4, $30
DATA sumShift<>+28(SB)/4, $31
DATA sumShift<>+32(SB)/4, $16
DATA sumShift<>+36(SB)/4, $17
DATA sumShift<>+40(SB)/4, $18
DATA sumShift<>+44(SB)/4, $19
DATA sumShift<>+48(SB)/4, $20
DATA sumShift<>+52(SB)/4, $21
DATA sumShift<>+56(SB)/4, $22
DATA sumShift<>+60(SB)/4, $23
DATA sumShift<>+64(SB)/4, $8
DATA sumShift<>+68(SB)/4, $9
DATA sumShift<>+72(SB)/4, $10
DATA sumShift<>+76(SB)/4, $11
DATA sumShift<>+80(SB)/4, $12
DATA sumShift<>+84(SB)/4, $13
DATA sumShift<>+88(SB)/4, $14
DATA sumShift<>+92(SB)/4, $15
DATA sumShift<>+96(SB)/4, $0
DATA sumShift<>+100(SB)/4, $1
DATA sumShift<>+104(SB)/4, $2
DATA sumShift<>+108(SB)/4, $3
DATA sumShift<>+112(SB)/4, $4
DATA sumShift<>+116(SB)/4, $5
DATA sumShift<>+120(SB)/4, $6
DATA sumShift<>+124(SB)/4, $7
GLOBL sumShift<>(SB), RODATA|NOPTR, $128

DATA sumSign<>+0(SB)/8, $0x8000000080000000
DATA sumSign<>+8(SB)/8, $0x8000000080000000
DATA sumSign<>+16(SB)/8, $0x8000000080000000
DATA sumSign<>+24(SB)/8, $0x8000000080000000
GLOBL sumSign<>(SB), RODATA|NOPTR, $32

// SUM_SIGNED sets Yd to ±scale for group k of the block (shift counts at
// sumShift+off), from the broadcast dword in Y4, +scale in Y7 and -scale
// in Y6: VBLENDVPS picks by the sign bit alone, the element's bit.
#define SUM_SIGNED(off, Yd) \
	VPSLLVD   sumShift<>+off(SB), Y4, Yd \
	VBLENDVPS Yd, Y7, Y6, Yd

// SUM_ADD adds ±scale of group k into Yacc (Yacc the first operand, like
// the generic acc[i] += s, so that NaNs come out identical). Y5 is scratch.
#define SUM_ADD(off, Yacc) \
	SUM_SIGNED(off, Y5) \
	VADDPS Y5, Yacc, Yacc

// SUM_FUSE is FUSE_IN with in in Ym, which then takes the mask.
#define SUM_FUSE(off, Ym, Ylo, Yhi) FUSE_IN(off, Ym, Ym, Ylo, Yhi)

// func sumCompensatePackAVX2(acc *[32]float64, x *float32, dst *byte, srcs *[]byte, scales *float32, nsrc, blocks int)
//
// For every block of 32 elements: in = the ±scales[j] of srcs[j]'s bits,
// added in order of j (srcs: nsrc >= 1 slice headers, 24 bytes apart,
// each holding blocks*4 bytes), then as compensatePackAVX2 with in.
TEXT ·sumCompensatePackAVX2(SB), NOSPLIT, $0-56
	MOVQ acc+0(FP), AX
	MOVQ x+8(FP), DI
	MOVQ dst+16(FP), DX
	MOVQ srcs+24(FP), R8
	MOVQ scales+32(FP), R9
	MOVQ nsrc+40(FP), R10
	MOVQ blocks+48(FP), CX
	TESTQ CX, CX
	JZ    sumFuseRet
	LOAD_ACC
	XORQ    R11, R11 // the byte offset of the block in every source

sumFuseLoop:
	// Source 0 sets in.
	MOVQ         (R8), SI
	VPBROADCASTD (SI)(R11*1), Y4
	VBROADCASTSS (R9), Y7
	VXORPS       sumSign<>(SB), Y7, Y6
	SUM_SIGNED(0, Y0)
	SUM_SIGNED(32, Y1)
	SUM_SIGNED(64, Y2)
	SUM_SIGNED(96, Y3)
	MOVQ $1, R12
	MOVQ R8, R13

sumSrcLoop:
	CMPQ R12, R10
	JGE  sumSrcDone
	ADDQ $24, R13
	MOVQ (R13), SI
	VPBROADCASTD (SI)(R11*1), Y4
	VBROADCASTSS (R9)(R12*4), Y7
	VXORPS       sumSign<>(SB), Y7, Y6
	SUM_ADD(0, Y0)
	SUM_ADD(32, Y1)
	SUM_ADD(64, Y2)
	SUM_ADD(96, Y3)
	INCQ R12
	JMP  sumSrcLoop

sumSrcDone:
	SUM_FUSE(0, Y0, Y8, Y9)
	SUM_FUSE(32, Y1, Y10, Y11)
	SUM_FUSE(64, Y2, Y12, Y13)
	SUM_FUSE(96, Y3, Y14, Y15)
	VMOVDQU fusePerm<>(SB), Y7
	FUSE_PACK
	ADDQ $128, DI
	ADDQ $4, DX
	ADDQ $4, R11
	DECQ CX
	JNZ  sumFuseLoop
	STORE_ACC

sumFuseRet:
	RET
