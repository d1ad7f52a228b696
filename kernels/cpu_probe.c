// Which kernel variant this CPU can run, asked of the CPU itself: built for the x86-64 baseline (it runs anywhere,
// and compiles in a fraction of a second), loaded before the kernels. Elsewhere (ARM) it reports no bits.
#include <stdint.h>
// kernels/cpu_lib.py loads this first, asks the CPU (CPUID, and XGETBV: the OS must save the
// wider registers) which variants it can run, then loads the best one. Bits: 0 AVX2, 1 FMA, 2 F16C, 3 AVX512F,
// 4 AVX512BW, 5 AVX512VL, 6 AVX512_VNNI, 7 AVX512_BF16, 8 AVX (with the OS's YMM state), 9 AMX-BF16 (with AMX-TILE
// and the OS's tile state: oneDNN's bf16 GEMM then runs on the tiles).
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

uint64_t kvchat_cpu_features(void) {
    uint64_t f = 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    int ymm = (xcr0 & 0x6) == 0x6, zmm = (xcr0 & 0xe6) == 0xe6;
    if (!(avx && ymm)) return 0;
    f |= 1u << 8;
    if (fma) f |= 1u << 1;
    if (f16c) f |= 1u << 2;
    if (__get_cpuid_max(0, 0) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if ((b >> 5) & 1) f |= 1u << 0;                     // AVX2
        if ((d >> 22) & 1 && (d >> 24) & 1 && (xcr0 & 0x60000) == 0x60000) f |= 1u << 9;     // AMX-BF16, AMX-TILE
        if (zmm) {
            if ((b >> 16) & 1) f |= 1u << 3;                // AVX512F
            if ((b >> 30) & 1) f |= 1u << 4;                // AVX512BW
            if ((b >> 31) & 1) f |= 1u << 5;                // AVX512VL
            if ((c >> 11) & 1) f |= 1u << 6;                // AVX512_VNNI
            __cpuid_count(7, 1, a, b, c, d);
            if ((a >> 5) & 1) f |= 1u << 7;                 // AVX512_BF16
        }
    }
#endif
    return f;
}

