//go:build amd64 && !purego

#include "textflag.h"

// 16-bit float conversion kernels. One iteration handles a block of 32
// elements: 128 bytes of float32 and 64 bytes of 16-bit values.
//
// fp16 uses F16C: VCVTPS2PH with immediate 0 (round to nearest even, not
// MXCSR's mode) and the exact VCVTPH2PS. bfloat16 has no conversion
// instruction before AVX512-BF16 (which flushes subnormals), so it is done
// on the integer bits with AVX2: (x + 0x7FFF + ((x >> 16) & 1)) >> 16, NaN
// replaced by (x >> 16) | 0x40 (made quiet), and the dwords packed to words
// with VPACKUSDW (values are at most 0xFFFF, so nothing saturates) and
// VPERMQ to undo its lane interleaving.
//
// The narrowing kernels count finite values at or above the overflow
// threshold T (0 < |x| bits: T-1 < a < 0x7F800000, signed compares on
// non-negative dwords) in 8 int32 lanes of Y15, summed at the end.

// BCAST sets every dword of y (the Y register of x) to c.
#define BCAST(c, x, y) \
	MOVL         $c, AX \
	MOVD         AX, x  \
	VPBROADCASTD x, y

// OVERFLOW adds to Y15 the lanes of v whose magnitude overflows. Needs
// Y12 = 0x7FFFFFFF, Y13 = T-1, Y14 = 0x7F800000; clobbers Y6, Y8, Y9.
#define OVERFLOW(v) \
	VPAND    Y12, v, Y8  \
	VPCMPGTD Y13, Y8, Y9 \
	VPCMPGTD Y8, Y14, Y6 \
	VPAND    Y6, Y9, Y9  \
	VPSUBD   Y9, Y15, Y15

// HSUM leaves the sum of Y15's dwords in AX.
#define HSUM \
	VEXTRACTI128 $1, Y15, X1 \
	VPADDD       X1, X15, X15 \
	VPSHUFD      $0x4e, X15, X1 \
	VPADDD       X1, X15, X15 \
	VPSHUFD      $0xb1, X15, X1 \
	VPADDD       X1, X15, X15 \
	VMOVD        X15, AX

// func cpuid(eax, ecx uint32) (a, b, c, d uint32)
TEXT ·cpuid(SB), NOSPLIT, $0-24
	MOVL eax+0(FP), AX
	MOVL ecx+4(FP), CX
	CPUID
	MOVL AX, a+8(FP)
	MOVL BX, b+12(FP)
	MOVL CX, c+16(FP)
	MOVL DX, d+20(FP)
	RET

// func narrowFP16F16C(dst *uint16, src *float32, blocks int, stream bool) int32
TEXT ·narrowFP16F16C(SB), NOSPLIT, $0-36
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX
	MOVB stream+24(FP), DX
	BCAST(0x7fffffff, X12, Y12)
	BCAST(0x477fefff, X13, Y13)
	BCAST(0x7f800000, X14, Y14)
	VPXOR Y15, Y15, Y15
	TESTB DL, DL
	JNZ   fp16Stream

fp16Loop:
	VMOVUPS   (SI), Y0
	VMOVUPS   32(SI), Y1
	VMOVUPS   64(SI), Y2
	VMOVUPS   96(SI), Y3
	VCVTPS2PH $0, Y0, X4
	VCVTPS2PH $0, Y1, X5
	VCVTPS2PH $0, Y2, X6
	VCVTPS2PH $0, Y3, X7
	VMOVDQU   X4, (DI)
	VMOVDQU   X5, 16(DI)
	VMOVDQU   X6, 32(DI)
	VMOVDQU   X7, 48(DI)
	OVERFLOW(Y0)
	OVERFLOW(Y1)
	OVERFLOW(Y2)
	OVERFLOW(Y3)
	ADDQ      $128, SI
	ADDQ      $64, DI
	DECQ      CX
	JNZ       fp16Loop

fp16Done:
	HSUM
	VZEROUPPER
	MOVL AX, ret+32(FP)
	RET

	// The same loop with non-temporal stores (dst 16-byte aligned).
fp16Stream:
	VMOVUPS   (SI), Y0
	VMOVUPS   32(SI), Y1
	VMOVUPS   64(SI), Y2
	VMOVUPS   96(SI), Y3
	VCVTPS2PH $0, Y0, X4
	VCVTPS2PH $0, Y1, X5
	VCVTPS2PH $0, Y2, X6
	VCVTPS2PH $0, Y3, X7
	VMOVNTDQ  X4, (DI)
	VMOVNTDQ  X5, 16(DI)
	VMOVNTDQ  X6, 32(DI)
	VMOVNTDQ  X7, 48(DI)
	OVERFLOW(Y0)
	OVERFLOW(Y1)
	OVERFLOW(Y2)
	OVERFLOW(Y3)
	ADDQ      $128, SI
	ADDQ      $64, DI
	DECQ      CX
	JNZ       fp16Stream
	SFENCE
	JMP       fp16Done

// BF16 rounds the 8 floats of v to bfloat16 in the low word of each dword
// of v. Needs Y7 = 0x40, Y10 = 0x7FFF, Y11 = 1, Y12 = 0x7FFFFFFF,
// Y14 = 0x7F800000; clobbers Y4 to Y6, Y8 and Y9.
#define BF16(v) \
	VPSRLD    $16, v, Y4     \
	VPAND     Y11, Y4, Y5    \
	VPADDD    Y10, v, Y6     \
	VPADDD    Y5, Y6, Y6     \
	VPSRLD    $16, Y6, Y6    \
	VPAND     Y12, v, Y8     \
	VPCMPGTD  Y14, Y8, Y9    \
	VPOR      Y7, Y4, Y4     \
	VPBLENDVB Y9, Y4, Y6, v

// func narrowBF16AVX2(dst *uint16, src *float32, blocks int, stream bool) int32
TEXT ·narrowBF16AVX2(SB), NOSPLIT, $0-36
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX
	MOVB stream+24(FP), DX
	BCAST(0x40, X7, Y7)
	BCAST(0x7fff, X10, Y10)
	BCAST(1, X11, Y11)
	BCAST(0x7fffffff, X12, Y12)
	BCAST(0x7f7f7fff, X13, Y13)
	BCAST(0x7f800000, X14, Y14)
	VPXOR Y15, Y15, Y15

bf16Loop:
	VMOVDQU (SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	OVERFLOW(Y0)
	OVERFLOW(Y1)
	OVERFLOW(Y2)
	OVERFLOW(Y3)
	BF16(Y0)
	BF16(Y1)
	BF16(Y2)
	BF16(Y3)
	VPACKUSDW Y1, Y0, Y0
	VPACKUSDW Y3, Y2, Y2
	VPERMQ    $0xd8, Y0, Y0
	VPERMQ    $0xd8, Y2, Y2
	TESTB     DL, DL
	JNZ       bf16Stream
	VMOVDQU   Y0, (DI)
	VMOVDQU   Y2, 32(DI)
	JMP       bf16Next

bf16Stream:
	VMOVNTDQ Y0, (DI)
	VMOVNTDQ Y2, 32(DI)

bf16Next:
	ADDQ      $128, SI
	ADDQ      $64, DI
	DECQ      CX
	JNZ       bf16Loop

	SFENCE
	HSUM
	VZEROUPPER
	MOVL AX, ret+32(FP)
	RET

// func widenFP16F16C(dst *float32, src *uint16, blocks int)
TEXT ·widenFP16F16C(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX

widenFP16Loop:
	VCVTPH2PS (SI), Y0
	VCVTPH2PS 16(SI), Y1
	VCVTPH2PS 32(SI), Y2
	VCVTPH2PS 48(SI), Y3
	VMOVUPS   Y0, (DI)
	VMOVUPS   Y1, 32(DI)
	VMOVUPS   Y2, 64(DI)
	VMOVUPS   Y3, 96(DI)
	ADDQ      $64, SI
	ADDQ      $128, DI
	DECQ      CX
	JNZ       widenFP16Loop
	VZEROUPPER
	RET

// func widenAddFP16F16C(acc *float32, src *uint16, blocks int)
TEXT ·widenAddFP16F16C(SB), NOSPLIT, $0-24
	MOVQ acc+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX

widenAddFP16Loop:
	VCVTPH2PS (SI), Y0
	VCVTPH2PS 16(SI), Y1
	VCVTPH2PS 32(SI), Y2
	VCVTPH2PS 48(SI), Y3
	VADDPS    (DI), Y0, Y0
	VADDPS    32(DI), Y1, Y1
	VADDPS    64(DI), Y2, Y2
	VADDPS    96(DI), Y3, Y3
	VMOVUPS   Y0, (DI)
	VMOVUPS   Y1, 32(DI)
	VMOVUPS   Y2, 64(DI)
	VMOVUPS   Y3, 96(DI)
	ADDQ      $64, SI
	ADDQ      $128, DI
	DECQ      CX
	JNZ       widenAddFP16Loop
	VZEROUPPER
	RET

// func widenBF16AVX2(dst *float32, src *uint16, blocks int)
TEXT ·widenBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX

widenBF16Loop:
	VPMOVZXWD (SI), Y0
	VPMOVZXWD 16(SI), Y1
	VPMOVZXWD 32(SI), Y2
	VPMOVZXWD 48(SI), Y3
	VPSLLD    $16, Y0, Y0
	VPSLLD    $16, Y1, Y1
	VPSLLD    $16, Y2, Y2
	VPSLLD    $16, Y3, Y3
	VMOVDQU   Y0, (DI)
	VMOVDQU   Y1, 32(DI)
	VMOVDQU   Y2, 64(DI)
	VMOVDQU   Y3, 96(DI)
	ADDQ      $64, SI
	ADDQ      $128, DI
	DECQ      CX
	JNZ       widenBF16Loop
	VZEROUPPER
	RET

// func widenAddBF16AVX2(acc *float32, src *uint16, blocks int)
TEXT ·widenAddBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ acc+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ blocks+16(FP), CX

widenAddBF16Loop:
	VPMOVZXWD (SI), Y0
	VPMOVZXWD 16(SI), Y1
	VPMOVZXWD 32(SI), Y2
	VPMOVZXWD 48(SI), Y3
	VPSLLD    $16, Y0, Y0
	VPSLLD    $16, Y1, Y1
	VPSLLD    $16, Y2, Y2
	VPSLLD    $16, Y3, Y3
	VADDPS    (DI), Y0, Y0
	VADDPS    32(DI), Y1, Y1
	VADDPS    64(DI), Y2, Y2
	VADDPS    96(DI), Y3, Y3
	VMOVUPS   Y0, (DI)
	VMOVUPS   Y1, 32(DI)
	VMOVUPS   Y2, 64(DI)
	VMOVUPS   Y3, 96(DI)
	ADDQ      $64, SI
	ADDQ      $128, DI
	DECQ      CX
	JNZ       widenAddBF16Loop
	VZEROUPPER
	RET

// func readAVX2(p *float32, blocks int) uint32
TEXT ·readAVX2(SB), NOSPLIT, $0-20
	MOVQ  p+0(FP), SI
	MOVQ  blocks+8(FP), CX
	VPXOR Y0, Y0, Y0
	VPXOR Y1, Y1, Y1
	VPXOR Y2, Y2, Y2
	VPXOR Y3, Y3, Y3

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

	VPOR         Y1, Y0, Y0
	VPOR         Y3, Y2, Y2
	VPOR         Y2, Y0, Y0
	VEXTRACTI128 $1, Y0, X1
	VPOR         X1, X0, X0
	VPSHUFD      $0x4e, X0, X1
	VPOR         X1, X0, X0
	VPSHUFD      $0xb1, X0, X1
	VPOR         X1, X0, X0
	VMOVD        X0, AX
	VZEROUPPER
	MOVL         AX, ret+16(FP)
	RET
